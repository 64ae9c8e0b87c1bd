"""The project's endpoints that take unsafe methods, and how each one is protected: what
``manage.py idempotency_audit`` lists.

The URL resolver is walked as Django resolves a request: included URLconfs, DRF routers
(each viewset action its own row), ninja APIs and routers, class-based views, function
views, DRF's ``@api_view``. A row is one pattern and one method: ``POST`` and ``PATCH``,
the ``METHODS`` setting's methods, and whatever a view protects besides. How each adapter
is recognised:

- ``@idempotent`` (a function view, ``method_decorator`` on a class-based view, beneath
  ``@api_view``): the ``idempotency_options`` it leaves on the view function, found through
  decorators above it (``functools.wraps`` copies it, ``__wrapped__`` and closures lead to
  it);
- ``IdempotencyMixin``: a DRF view class that has it among its bases;
- ninja's ``@idempotent``: the ``idempotency_options`` of the ninja operation.

A function view accepts every method unless Django's ``require_http_methods`` (or
``require_POST``...) says otherwise. Left out: the admin's own views (forms for staff in a
browser, not an API that clients retry) and django-ninja's schema and docs pages.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.urls import URLPattern, URLResolver, get_resolver
from django.urls.resolvers import RegexPattern

from django_idempotency import _options, _recovery, _routes, _validation, conf
from django_idempotency._protection import (
    class_methods,
    in_order,
    is_admin_site,
    is_drf_view,
    marker,
    method_names,
    ninja_path_view,
    options_of,
    required_methods,
)
from django_idempotency.conf import app_settings

__all__ = ["Audit", "Endpoint", "audit", "duration", "url_prefix"]

#: Methods listed whether or not the project's settings protect them.
UNSAFE = ("POST", "PATCH")


@dataclass(frozen=True)
class Endpoint:
    """One URL pattern and one method, and how that request is protected."""

    method: str
    #: The pattern as a path, e.g. ``/api/charges/<pk>/``.
    url: str
    #: The pattern as Django's ``ResolverMatch.route`` spells it.
    route: str
    #: The pattern's name, with its namespaces (``payments-ninja:ninja-charge-detail``).
    name: str | None
    #: The view's dotted name.
    view: str
    protected: bool
    #: ``"mixin"``, ``"decorator"``, ``"@api_view"`` or ``"ninja"``; ``None`` unprotected.
    by: str | None = None
    operation: str | None = None
    recovery: str | None = None
    ttl: timedelta | None = None
    #: Where the key comes from, e.g. ``Idempotency-Key header``.
    key: str | None = None
    #: Whether the operation is derived (a route, a basename and action, a ninja
    #: ``operation_id``, a viewset's ``idempotency_operation`` for each of its actions), not
    #: given to one endpoint by the project: two endpoints deriving one name share its
    #: records (:attr:`Audit.shared`).
    derived: bool = field(default=False, compare=False)
    #: Whether the view carries the package's decorator, which does not reach this route
    #: (ninja's ``@idempotent`` above another route decorator): check E062.
    unreached: bool = field(default=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """The row as JSON: the TTL in seconds."""
        ttl = self.ttl.total_seconds() if self.ttl is not None else None
        return {
            "method": self.method,
            "url": self.url,
            "route": self.route,
            "name": self.name,
            "view": self.view,
            "protected": self.protected,
            "by": self.by,
            "operation": self.operation,
            "recovery": self.recovery,
            "ttl_seconds": int(ttl) if ttl is not None and ttl.is_integer() else ttl,
            "key": self.key,
        }


@dataclass(frozen=True)
class Audit:
    """Every endpoint found, in the order Django tries the patterns."""

    endpoints: list[Endpoint]
    #: Patterns left out by ``exclude``.
    excluded: int = 0
    #: What was left out besides, e.g. ``"the admin's own views"``.
    left_out: tuple[str, ...] = ()

    @property
    def unprotected(self) -> list[Endpoint]:
        """The endpoints no adapter protects."""
        return [e for e in self.endpoints if not e.protected]

    @property
    def shared(self) -> dict[str, list[Endpoint]]:
        """Each operation name that endpoints of several routes derive (one basename under
        two routers), with those endpoints: a key sent to one replays another's outcome,
        and its own view never runs. The spellings of one endpoint (DRF's format suffixes)
        are listed once, so they never count twice."""
        derived: dict[str, list[Endpoint]] = {}
        for endpoint in self.endpoints:
            if endpoint.protected and endpoint.derived and endpoint.operation:
                derived.setdefault(endpoint.operation, []).append(endpoint)
        return {
            operation: endpoints
            for operation, endpoints in derived.items()
            if len({e.route for e in endpoints}) > 1
        }


@dataclass(frozen=True)
class _Protection:
    by: str
    options: _options.Options
    #: The operation when the options name none: ``{method}`` stands for the method.
    operation: str
    #: Whether that operation is derived from the route or the viewset (not the project's).
    derived: bool = True
    #: Whether the options' own operation is one name for every action of a viewset (its
    #: ``idempotency_operation``): its actions share it as derived names would.
    spread: bool = False
    #: Whether the options reach the endpoint; not where the view was built before the
    #: decorator was applied (ninja's ``@idempotent`` above another route decorator).
    reaches: bool = True


@dataclass
class _Walk:
    exclude: Sequence[str]
    endpoints: list[Endpoint] = field(default_factory=list)
    excluded: int = 0
    left_out: list[str] = field(default_factory=list)
    #: DRF's format-suffix twins: each twin's route, mapped to its plain pattern's.
    twins: dict[str, str] = field(default_factory=dict)
    # How many patterns of each ninja path view came by at each route: the n-th is its n-th
    # operation (an API's urls included under two prefixes bring the same path views twice).
    ninja_seen: dict[tuple[int, str], int] = field(default_factory=dict)

    def leave_out(self, what: str) -> None:
        if what not in self.left_out:
            self.left_out.append(what)


ADMIN = "the admin's own views"
NINJA_PAGES = "django-ninja's schema and docs pages"


def url_prefix(text: str) -> str:
    """A URL prefix to leave out (``"/api-auth/"``), as the walk compares it: without its
    leading ``/``. ``ValueError`` when nothing is left: ``--exclude "$PREFIX"`` with the
    variable unset names no prefix, and the empty one would begin every URL, leaving every
    pattern out (and ``--fail-on-unprotected`` with nothing to fail on)."""
    prefix = text.lstrip("/")
    if not prefix:
        raise ValueError(
            f"exclude {text!r} names no URL prefix: it would leave out every pattern; "
            "give one such as api-auth/"
        )
    return prefix


def audit(urlconf: str | None = None, exclude: Sequence[str] = ()) -> Audit:
    """Walk ``urlconf`` (default: ``ROOT_URLCONF``) and list its endpoints.

    ``exclude``: URL prefixes (``"api-auth/"``) whose patterns are left out; an empty one
    (or ``"/"``) is a ``ValueError`` (see :func:`url_prefix`).
    """
    walk = _Walk(exclude=[url_prefix(prefix) for prefix in exclude], twins=_routes.twins(urlconf))
    for pattern, levels, names in _patterns(get_resolver(urlconf), (), (), walk):
        _visit(walk, pattern, levels, names)
    return Audit(walk.endpoints, walk.excluded, tuple(walk.left_out))


def _patterns(
    resolver: URLResolver, levels: tuple[Any, ...], names: tuple[str, ...], walk: _Walk
) -> Iterator[tuple[URLPattern, tuple[Any, ...], tuple[str, ...]]]:
    for pattern in resolver.url_patterns:
        if isinstance(pattern, URLResolver):
            if is_admin_site(pattern):
                walk.leave_out(ADMIN)
                continue
            namespace = (pattern.namespace,) if pattern.namespace else ()
            yield from _patterns(pattern, (*levels, pattern.pattern), names + namespace, walk)
        else:
            yield pattern, (*levels, pattern.pattern), names


def _visit(
    walk: _Walk, pattern: URLPattern, levels: tuple[Any, ...], names: tuple[str, ...]
) -> None:
    route = _routes.join(levels)
    callback = pattern.callback
    # DRF's format-suffix twin of a pattern (``charges.json``) is the same endpoint again,
    # under the same operation.
    if route in walk.twins:
        return
    if _is_ninja_page(callback):
        walk.leave_out(NINJA_PAGES)
        return
    url = "/" + "".join(_readable(level) for level in levels)
    if any(url.lstrip("/").startswith(prefix) for prefix in walk.exclude):
        walk.excluded += 1
        return
    name = ":".join((*names, pattern.name)) if pattern.name else None
    for method, view, protection in _methods(walk, callback, route):
        walk.endpoints.append(_endpoint(method, url, route, name, view, protection))


def _endpoint(
    method: str, url: str, route: str, name: str | None, view: str, protection: _Protection | None
) -> Endpoint:
    if protection is None or not protection.options.protects(method):
        return Endpoint(method, url, route, name, view, protected=False)
    if not protection.reaches:
        return Endpoint(method, url, route, name, view, protected=False, unreached=True)
    options = protection.options
    operation = options.operation or protection.operation.format(method=method, route=route)
    derived = protection.derived if options.operation is None else protection.spread
    return Endpoint(
        method,
        url,
        route,
        name,
        view,
        protected=True,
        by=protection.by,
        operation=operation,
        recovery=_recovery.recovery_name(options.recovery or app_settings.RECOVERY),
        ttl=conf.as_timedelta(options.ttl) if options.ttl is not None else app_settings.TTL,
        key=_key_source(options),
        derived=derived,
    )


def _wanted(method: str, protection: _Protection | None) -> bool:
    """Whether a method a view accepts gets a row: an unsafe one, or one it protects."""
    method = method.upper()
    if method in UNSAFE or method in app_settings.METHODS:
        return True
    return protection is not None and protection.options.protects(method)


Row = tuple[str, str, "_Protection | None"]


def _methods(walk: _Walk, callback: Callable[..., Any], route: str) -> list[Row]:
    """``(method, view name, protection)`` for each listed method of a pattern's view."""
    cls = getattr(callback, "cls", None)
    if cls is not None and is_drf_view(cls):
        return _drf_rows(callback, cls)
    path_view = ninja_path_view(callback)
    if path_view is not None:
        return _ninja_rows(walk, path_view, route)
    view_class = getattr(callback, "view_class", None)
    if isinstance(view_class, type):
        return _class_rows(callback, view_class)
    found = options_of(callback)
    protection = _Protection("decorator", found, _ROUTE_OPERATION) if found else None
    accepted = required_methods(callback)
    if accepted is None:  # every method: the ones that could get a row
        accepted = [*UNSAFE, *app_settings.METHODS, *(found.methods or () if found else ())]
    name = _validation.name_of(callback)
    return [(m, name, protection) for m in in_order(accepted) if _wanted(m, protection)]


#: The default operation of a view that is not a viewset: the method and the route.
_ROUTE_OPERATION = "{method} {route}"


def _class_name(view_class: type) -> str:
    # DRF's @api_view names its class after the function (__name__ only).
    return f"{view_class.__module__}.{view_class.__name__}"


def _class_rows(callback: Callable[..., Any], view_class: type) -> list[Row]:
    """A Django class-based view: ``method_decorator(idempotent)`` on ``dispatch`` (copied
    onto the view function by ``as_view``) or on the method itself."""
    rows: list[Row] = []
    for method in class_methods(view_class, callback):
        # The decorator on dispatch (or around the view function) runs first: where the
        # handler is decorated too, the outer layer's claim is the one that protects.
        found = marker(callback) or options_of(getattr(view_class, method.lower()))
        protection = _Protection("decorator", found, _ROUTE_OPERATION) if found else None
        if _wanted(method, protection):
            rows.append((method, _class_name(view_class), protection))
    return rows


# -- DRF -----------------------------------------------------------------------------------


def _drf_rows(callback: Callable[..., Any], cls: type) -> list[Row]:
    """A DRF view: a viewset's action per method (a router's pattern), else its handlers."""
    from django_idempotency.drf import IdempotencyMixin

    initkwargs = dict(getattr(callback, "initkwargs", {}))
    allowed = {m.upper() for m in method_names(cls, callback)}
    actions: dict[str, str] | None = getattr(callback, "actions", None)
    methods = (
        in_order([m for m in actions if m.upper() in allowed])
        if actions is not None
        else class_methods(cls, callback)
    )
    rows: list[Row] = []
    for method in methods:
        protection: _Protection | None
        if issubclass(cls, IdempotencyMixin):
            action = actions[method.lower()] if actions is not None else None
            protection = _mixin_protection(cls, initkwargs, action)
        else:
            # A viewset's action (a router's pattern) or the view's handler of the method.
            name = actions[method.lower()] if actions is not None else method.lower()
            handler = getattr(cls, name, None)
            # Not the view function's mark: the decorator on a DRF view's dispatch is
            # refused (it would claim before DRF's authentication), never a protection.
            found = options_of(handler) if handler is not None else None
            by = (
                "@api_view"
                if getattr(handler, "__module__", "") == "rest_framework.decorators"
                else "decorator"
            )
            protection = _Protection(by, found, _ROUTE_OPERATION) if found else None
        if _wanted(method, protection):
            rows.append((method, _class_name(cls), protection))
    return rows


def _mixin_protection(cls: Any, initkwargs: dict[str, Any], action: str | None) -> _Protection:
    from django_idempotency.drf import IdempotencyMixin

    # A view instance as DRF makes one per request: its attributes are validated (a wrong
    # one raises ImproperlyConfigured, as on the view's first request).
    view: IdempotencyMixin = cls(**initkwargs)
    options = view._idempotency_options()
    basename = initkwargs.get("basename")
    if cls.get_idempotency_operation is not IdempotencyMixin.get_idempotency_operation:
        # The project's own method names it: not ours to call derived.
        name = f"{cls.__name__}.get_idempotency_operation()"
        return _Protection("mixin", options, name, derived=False)
    operation = f"{basename}.{action}" if basename and action else _ROUTE_OPERATION
    # A viewset's idempotency_operation names each of its actions (and each router's copy):
    # not one endpoint's own name.
    return _Protection("mixin", options, operation, spread=action is not None)


# -- django-ninja ----------------------------------------------------------------------------


def _is_ninja_page(callback: Any) -> bool:
    """ninja's own views (its OpenAPI schema, its docs, its root): ``functools.partial``s of
    its functions, bound to the API."""
    func = getattr(callback, "func", callback)
    return str(getattr(func, "__module__", "")).split(".")[0] == "ninja" and (
        ninja_path_view(callback) is None
    )


def _ninja_rows(walk: _Walk, path_view: Any, route: str) -> list[Row]:
    # ninja makes one pattern per operation of a path, each with that operation's name; the
    # first one resolves every method of the path.
    seen = (id(path_view), route)
    index = walk.ninja_seen.get(seen, 0)
    walk.ninja_seen[seen] = index + 1
    if index >= len(path_view.operations):
        return []
    from django_idempotency.ninja import intended

    operation = path_view.operations[index]
    found = getattr(operation, "idempotency_options", None)
    reaches = isinstance(found, _options.Options)
    if not reaches:
        # Built before the function's @idempotent was applied: it does not reach this route.
        found = intended(operation.view_func)
    protection = (
        _Protection(
            "ninja",
            found,
            operation.operation_id or _ROUTE_OPERATION,
            # An operation_id names the operation in its API's OpenAPI document, as a
            # basename names a viewset in its router: two APIs (v1, v2) may each give one,
            # and their routes would share its records (E060) unless @idempotent names one.
            reaches=reaches,
        )
        if isinstance(found, _options.Options)
        else None
    )
    name = _validation.name_of(operation.view_func)
    return [(m, name, protection) for m in in_order(operation.methods) if _wanted(m, protection)]


# -- what ATOMIC_REQUESTS must leave out -----------------------------------------------------


# -- finding the decorator's options ---------------------------------------------------------


# -- how it reads ----------------------------------------------------------------------------


def _key_source(options: _options.Options) -> str:
    source = options.key
    if source is None:
        text = f"{app_settings.HEADER} header"
    elif isinstance(source, str):
        text = source
    else:
        text = getattr(source, "description", None) or _validation.name_of(source)
    required = app_settings.REQUIRED if options.required is None else options.required
    return text if required else f"{text}, optional"


#: Flags written at the start of a regex (``(?i)``): no part of the URL.
_INLINE_FLAGS = re.compile(r"^\(\?[aiLmsux]+\)")


def _readable(level: Any) -> str:
    """A level of a pattern as a path: a regex's groups as ``<name>``, anchors dropped."""
    text = str(level)
    if not isinstance(level, RegexPattern):
        return text
    text = _INLINE_FLAGS.sub("", text, count=1)
    text = text.removeprefix("^").removesuffix("$").removesuffix(r"\Z")
    out, i = [], 0
    while i < len(text):
        if text.startswith("(?P<", i):
            end = text.index(">", i)
            out.append(f"<{text[i + 4 : end]}>")
            i = _group_end(text, i)
        elif text[i] == "(" and not text.startswith("(?", i):
            # An unnamed group: a positional argument, named as Django's admindocs does.
            out.append("<var>")
            i = _group_end(text, i)
        elif text[i] == "\\" and i + 1 < len(text):
            # An escaped character is itself (``\.``); a class (``\d``) stays a class.
            escaped = text[i + 1]
            out.append(f"\\{escaped}" if escaped.isalpha() else escaped)
            i += 2
        elif text.startswith("/?", i):
            out.append("/")
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _group_end(text: str, start: int) -> int:
    """The index after the group that opens at ``start`` (nested groups and escapes kept)."""
    depth, i = 0, start
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(text)


def duration(value: timedelta) -> str:
    """A duration in the audit's words: ``4d``, ``1h30m``, ``90s``."""
    seconds = value.total_seconds()
    if not seconds.is_integer():
        return f"{seconds:g}s"
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    return "".join(f"{n}{unit}" for n, unit in parts if n) or "0s"
