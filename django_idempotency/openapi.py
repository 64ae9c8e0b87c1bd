"""drf-spectacular support: protected operations document the ``Idempotency-Key`` header.

Loaded by the app's ``ready()`` only when drf-spectacular is installed; this is the only module
that imports it. Nothing needs configuring:

- DRF views with :class:`~django_idempotency.drf.IdempotencyMixin` are found by
  :class:`IdempotencyViewExtension`, which hands the schema generator a stand-in of the view
  whose schema is an :class:`IdempotencyAutoSchema`;
- ``@api_view`` functions under ``@idempotent`` carry an :class:`IdempotentViewSchema`, which
  DRF's ``@api_view`` copies onto the view class it makes.

A protected operation (``POST`` and ``PATCH`` by default, else the view's methods) gets the key
header parameter (required as the view or the ``REQUIRED`` setting says), the ``400``, ``409``,
``422`` and ``503`` ``application/problem+json`` answers of this package (and the ``500``
``idempotency_outcome_unknown`` under the ``"fail"`` recovery policy), and the
``Idempotent-Replayed`` header on every response that can be replayed.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

from drf_spectacular.extensions import OpenApiViewExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import ComponentRegistry, ResolvedComponent, get_class, get_doc
from drf_spectacular.settings import spectacular_settings
from rest_framework.schemas.inspectors import DefaultSchema, ViewInspector
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from django_idempotency import _apidocs, _options
from django_idempotency._apidocs import (
    CODE_COMPONENT,
    KEY_PATTERN,
    PROBLEM_COMPONENT,
    code_schema,
    problem_schema,
)
from django_idempotency.drf import IdempotencyMixin

__all__ = [
    "CODE_COMPONENT",
    "KEY_PATTERN",
    "PROBLEM_COMPONENT",
    "IdempotencyAutoSchema",
    "IdempotencyViewExtension",
    "IdempotentViewSchema",
    "document_operation",
]


def document_operation(
    operation: dict[str, Any], options: _options.Options, registry: ComponentRegistry
) -> None:
    """Add the key header, the problem answers and the replay header to ``operation``, the
    problem schema as a component of the schema being generated."""
    code_ref = _schema_component(registry, CODE_COMPONENT, code_schema())
    problem_ref = _schema_component(registry, PROBLEM_COMPONENT, problem_schema(code_ref))
    _apidocs.document_operation(operation, options, problem_ref)


def _schema_component(
    registry: ComponentRegistry, name: str, schema: dict[str, Any]
) -> dict[str, str]:
    # Registered once per schema generation; the reference to it.
    component = ResolvedComponent(  # type: ignore[no-untyped-call]
        name=name, type=ResolvedComponent.SCHEMA, schema=schema, object=name
    )
    registry.register_on_missing(component)
    ref: dict[str, str] = component.ref
    return ref


def view_options(view: Any) -> _options.Options | None:
    """The idempotency options of a view instance, ``None`` if it is not protected at all."""
    if isinstance(view, IdempotencyMixin):
        return view._idempotency_options()
    slot = inspect.getattr_static(type(view), "schema", None)
    if isinstance(slot, IdempotentViewSchema):
        return slot.options
    return None


class IdempotencyAutoSchema(AutoSchema):
    """drf-spectacular's ``AutoSchema``, plus the idempotency parts of protected operations.

    It can serve as ``DEFAULT_SCHEMA_CLASS`` itself, but need not: the extension and
    ``@idempotent`` put it in front of whatever schema class a view already has.
    """

    def get_operation(
        self,
        path: str,
        path_regex: str,
        path_prefix: str,
        method: str,
        registry: ComponentRegistry,
    ) -> dict[str, Any] | None:
        """The operation as drf-spectacular builds it, documented when the method is protected."""
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        options = view_options(self.view)
        if operation is not None and options is not None and options.protects(method):
            document_operation(operation, options, registry)
        return operation

    # drf-spectacular's AutoSchema overrides DRF's get_description(path, method) the same way.
    def get_description(self) -> str:  # type: ignore[override]
        """The view's description, never the docstring of :class:`IdempotencyMixin`.

        drf-spectacular falls back on the first docstring in the view's bases, and the mixin
        comes first in them: an undocumented view would be described by the mixin.
        """
        description = super().get_description()
        if isinstance(self.view, IdempotencyMixin) and description == get_doc(IdempotencyMixin):
            return _doc_without_mixin(type(self.view))
        return description

    def __set__(self, instance: Any, other: ViewInspector | None) -> None:
        # For an action with its own @extend_schema, drf-spectacular sets that action's schema
        # on the view instance, built on the view's original schema class, not on ours: put
        # ours in front of it, keeping the object (it arrives as a weakref proxy).
        _keep_documented(other)
        super().__set__(instance, other)


def _doc_without_mixin(view_class: type) -> str:
    # drf-spectacular's get_doc(), skipping the mixin: the first docstring among the view's
    # classes up to the first library class (DRF's views and viewsets).
    mro = view_class.__mro__
    barrier = min(
        (mro.index(c) for c in spectacular_settings.GET_LIB_DOC_EXCLUDES() if c in mro),
        default=len(mro),
    )
    for cls in mro[:barrier]:
        if cls is not IdempotencyMixin and cls.__doc__:
            return get_doc(cls)
    return ""


def idempotency_schema_class(base: type[AutoSchema]) -> type[IdempotencyAutoSchema]:
    """``base`` with :class:`IdempotencyAutoSchema` in front of it."""
    if issubclass(base, IdempotencyAutoSchema):
        return base
    if base is AutoSchema:
        return IdempotencyAutoSchema
    return type(f"Idempotency{base.__name__}", (IdempotencyAutoSchema, base), {})


def _keep_documented(schema: ViewInspector | None) -> None:
    if isinstance(schema, AutoSchema) and not isinstance(schema, IdempotencyAutoSchema):
        schema.__class__ = idempotency_schema_class(schema.__class__)


class IdempotentViewSchema(DefaultSchema):
    """The ``schema`` that ``@idempotent`` puts on a view function.

    DRF's ``@api_view`` copies it onto the view class it makes. Like DRF's own default, it
    stands for ``DEFAULT_SCHEMA_CLASS``, read when the schema is generated; when that is a
    drf-spectacular ``AutoSchema``, :class:`IdempotencyAutoSchema` goes in front of it, so
    DRF's own schema generation and custom schema classes keep working.
    """

    def __init__(self, options: _options.Options) -> None:
        super().__init__()
        self.options = options

    def __get__(self, instance: Any, owner: Any) -> ViewInspector:
        if instance in self.instance_schemas:
            assigned = self.instance_schemas[instance]
            assert assigned is not None
            return assigned
        # DRF has imported the class by now; its stubs have typed the setting as the dotted
        # path (before 3.18.2) and as the class.
        inspector_class: type[ViewInspector] = cast(Any, api_settings.DEFAULT_SCHEMA_CLASS)
        if issubclass(inspector_class, AutoSchema):
            inspector_class = idempotency_schema_class(inspector_class)
        inspector = inspector_class()
        inspector.view = instance
        return inspector

    def __set__(self, instance: Any, other: ViewInspector | None) -> None:
        _keep_documented(other)
        super().__set__(instance, other)


class IdempotencyViewExtension(OpenApiViewExtension):  # type: ignore[no-untyped-call]
    """Documents the protected methods of every view with :class:`IdempotencyMixin`."""

    target_class = "django_idempotency.drf.IdempotencyMixin"
    match_subclasses = True

    def view_replacement(self) -> type[APIView]:
        """The view, with :class:`IdempotencyAutoSchema` in front of its schema class."""
        view: type[APIView] = self.target
        schema_class = get_class(view.schema)
        if not issubclass(schema_class, AutoSchema) or issubclass(
            schema_class, IdempotencyAutoSchema
        ):
            return view
        attrs = {
            "schema": idempotency_schema_class(schema_class)(),
            "__module__": view.__module__,
            "__qualname__": view.__qualname__,
            "__doc__": view.__doc__,
        }
        return type(view.__name__, (view,), attrs)
