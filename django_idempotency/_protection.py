"""What a URL pattern's view protects: for each HTTP method, the options of the
``@idempotent``, ninja ``@idempotent`` or ``IdempotencyMixin`` that protects it.

Found by reading the view as Django resolves it (the function, its class, the DRF viewset's
actions, the ninja operations behind a path), never by calling it. The audit
(:mod:`._endpoints`) and the ``ATOMIC_REQUESTS`` marking (:mod:`._atomic_requests`) both read it.
"""

from __future__ import annotations

import importlib.util
import inspect
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeGuard

from django.urls import URLPattern, URLResolver, get_resolver

from django_idempotency import _options

#: In :func:`protected_methods`: every method of a function view reaches its decorator.
EVERY_METHOD = "*"


def protected_methods(callback: Callable[..., Any]) -> dict[str, _options.Options]:
    """The methods a pattern's view handles through an adapter of this package, each with
    the options that protect it (``EVERY_METHOD`` for a decorated function view): what
    ``ATOMIC_REQUESTS`` must leave to the engine (:mod:`django_idempotency._atomic_requests`).
    Empty when the view protects none."""
    cls = getattr(callback, "cls", None)
    if cls is not None and is_drf_view(cls):
        if any(
            base.__module__ == "django_idempotency.drf" and base.__name__ == "IdempotencyMixin"
            for base in cls.__mro__
        ):  # named, not imported: drf imports this module
            return {}  # its dispatch carries the mark already, into as_view()'s function
        return handlers(cls, callback)
    path_view = ninja_path_view(callback)
    if path_view is not None:
        table: dict[str, _options.Options] = {}
        for operation in path_view.operations:
            found = getattr(operation, "idempotency_options", None)
            if isinstance(found, _options.Options):
                table.update(dict.fromkeys((m.upper() for m in operation.methods), found))
        return table
    view_class = getattr(callback, "view_class", None)
    if isinstance(view_class, type):
        return handlers(view_class, callback)
    # Only through decorators that say what they wrap (functools.wraps): a function that
    # merely calls a protected view from inside is no protected view itself.
    found = options_of(callback, closures=False)
    return {EVERY_METHOD: found} if found is not None else {}


def served_methods(callback: Callable[..., Any]) -> set[str] | None:
    """Every method a pattern's view has a handler for (``None``: any method, a function
    view)."""
    path_view = ninja_path_view(callback)
    if path_view is not None:
        return {m.upper() for operation in path_view.operations for m in operation.methods}
    view_class = getattr(callback, "cls", None) or getattr(callback, "view_class", None)
    if isinstance(view_class, type):
        return set(class_methods(view_class, callback))
    return None


def handlers(view_class: type, callback: Callable[..., Any]) -> dict[str, _options.Options]:
    table: dict[str, _options.Options] = {}
    for method in class_methods(view_class, callback):
        found = options_of(getattr(view_class, method.lower())) or marker(callback)
        if found is not None:
            table[method] = found
    return table


def is_admin_site(resolver: URLResolver) -> bool:
    """Whether ``resolver`` is an admin site's URLconf (``admin.site.urls``): not its
    application namespace alone, which a project's own URLconf may take too, but the views
    an ``AdminSite`` wraps (each one carries the site; its index is always there)."""
    return resolver.app_name == "admin" and any(
        isinstance(pattern, URLPattern) and hasattr(pattern.callback, "admin_site")
        for pattern in resolver.url_patterns
    )


def callbacks(urlconf: str | None = None) -> Iterator[Callable[..., Any]]:
    """Every pattern's view of ``urlconf`` (default: ``ROOT_URLCONF``), the admin site's
    left out."""

    def walk(resolver: URLResolver) -> Iterator[Callable[..., Any]]:
        for pattern in resolver.url_patterns:
            if isinstance(pattern, URLResolver):
                if not is_admin_site(pattern):
                    yield from walk(pattern)
            else:
                yield pattern.callback

    yield from walk(get_resolver(urlconf))


def marker(func: Any) -> _options.Options | None:
    found = getattr(func, "__dict__", {}).get("idempotency_options")
    return found if isinstance(found, _options.Options) else None


def closure(func: Any) -> list[Any]:
    func = getattr(func, "__func__", func)
    cells = getattr(func, "__closure__", None) or ()
    values = []
    for cell in cells:
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return values


def options_of(func: Any, depth: int = 8, closures: bool = True) -> _options.Options | None:
    """The options ``@idempotent`` left on ``func`` or on a function it wraps (found through
    ``__wrapped__``, and through closures unless ``closures`` is false)."""
    for current in wrapped_by(func, depth, closures):
        found = marker(current)
        if found is not None:
            return found
    return None


def wrapped_by(func: Any, depth: int = 8, closures: bool = True) -> Iterator[Any]:
    """``func``, then the functions it wraps, nearest first, each once: through
    ``__wrapped__`` (``functools.wraps``), and through the functions its closure holds (a
    decorator made without it) unless ``closures`` is false; ``depth`` steps at most."""
    todo, seen = [func], set()
    while todo and depth:
        depth -= 1
        following = []
        for current in todo:
            if id(current) in seen:
                continue
            seen.add(id(current))
            yield current
            wrapped = getattr(current, "__wrapped__", None)
            following += [wrapped] if wrapped is not None else []
            following += [
                c
                for c in (closure(current) if closures else ())
                if isinstance(c, (types.FunctionType, types.MethodType))
            ]
        todo = following


def required_methods(func: Any) -> list[str] | None:
    """The methods Django's ``require_http_methods`` lets through to ``func``, or ``None``
    when nothing restricts them."""
    allowed: set[str] | None = None
    current, depth = func, 8
    while current is not None and depth:
        depth -= 1
        code = getattr(current, "__code__", None)
        if code is not None and code.co_filename.endswith(_REQUIRE_METHODS):
            methods = inspect.getclosurevars(current).nonlocals.get("request_method_list")
            if methods is not None:
                upper = {str(m).upper() for m in methods}
                allowed = upper if allowed is None else allowed & upper
        current = getattr(current, "__wrapped__", None)
    return None if allowed is None else sorted(allowed)


_REQUIRE_METHODS = str(Path("django", "views", "decorators", "http.py"))


def class_methods(view_class: type, callback: Any = None) -> list[str]:
    """The methods a class-based view answers with a handler of its own: those of its
    ``http_method_names`` it has a method for. ``callback``: the pattern's view, whose
    ``as_view(http_method_names=...)`` (Django's ``view_initkwargs``, DRF's ``initkwargs``)
    is the list the view answers by, where it gives one."""
    names = method_names(view_class, callback)
    return in_order([m for m in names if hasattr(view_class, m)])


def method_names(view_class: type, callback: Any = None) -> list[str]:
    """The ``http_method_names`` a pattern's view answers by: ``as_view``'s where it gave
    them, else the class's."""
    for attribute in ("view_initkwargs", "initkwargs"):
        given = getattr(callback, attribute, None)
        if isinstance(given, dict) and "http_method_names" in given:
            return list(given["http_method_names"])
    return list(getattr(view_class, "http_method_names", ()))


def is_drf_view(cls: Any) -> TypeGuard[type]:
    if importlib.util.find_spec("rest_framework") is None:
        return False
    from rest_framework.views import APIView

    return isinstance(cls, type) and issubclass(cls, APIView)


def ninja_path_view(callback: Callable[..., Any]) -> Any:
    """The ninja ``PathView`` a pattern's view belongs to, else ``None``."""
    if importlib.util.find_spec("ninja") is None:
        return None
    from ninja.operation import PathView

    # ninja's view is a method of the path view, or a function that closes over it.
    candidates = [getattr(callback, "__self__", None), *closure(callback)]
    return next((c for c in candidates if isinstance(c, PathView)), None)


_ORDER = ("POST", "PUT", "PATCH", "DELETE")


def in_order(methods: Sequence[str]) -> list[str]:
    unique = {m.upper() for m in methods}
    return sorted(unique, key=lambda m: (_ORDER.index(m) if m in _ORDER else len(_ORDER), m))
