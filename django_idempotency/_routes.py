"""Routes as Django joins them, and the one spelling an endpoint's operation is named by.

DRF's ``format_suffix_patterns`` (and a router's format suffixes) add, right after a
pattern, a twin with the same view that also takes a ``.json``-like suffix: ``transfers/``
and ``transfers.<drf_format_suffix:format>`` are one endpoint. Its default operation is the
plain pattern's route, whichever spelling a request took, so one key never runs it twice.
The audit lists such a twin once, through the same table.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from django.urls import URLPattern, URLResolver, get_resolver

__all__ = ["SUFFIXES", "canonical_route", "join", "suffix_twins"]

# How DRF spells a format suffix after the plain pattern's text: a path converter of its own
# (``<drf_format_suffix:format>``, ``<drf_format_suffix_json_html:format>``) or a regex
# group (``\.(?P<format>[a-z0-9]+)/?$``).
SUFFIXES = ("<drf_format_suffix", r"\.(?P<")

# Per resolver (a new one after clear_url_caches(), e.g. override_settings(ROOT_URLCONF)).
_TWINS: weakref.WeakKeyDictionary[URLResolver, dict[str, str]] = weakref.WeakKeyDictionary()


def join(levels: tuple[Any, ...]) -> str:
    """The route as ``ResolverMatch.route`` has it: each level's pattern joined, without the
    leading ``^`` of a regex below a level with text of its own (below an empty prefix,
    ``path("", include(...))``, Django keeps the ``^``)."""
    route = ""
    for level in reversed(levels):
        text = str(level)
        if text:
            route = text + route.removeprefix("^")
    return route


def canonical_route(route: str, urlconf: Any = None) -> str:
    """The route that names ``route``'s endpoint: the plain pattern's for DRF's format
    suffix twin of a pattern, else ``route`` itself."""
    if not any(marker in route for marker in SUFFIXES):
        return route  # most requests: no table to read
    return suffix_twins(urlconf).get(route, route)


def suffix_twins(urlconf: Any = None) -> dict[str, str]:
    """Every format-suffix twin's full route, mapped to its plain pattern's full route."""
    resolver = get_resolver(urlconf)
    twins = _TWINS.get(resolver)
    if twins is None:
        twins = dict(_walk(resolver, ()))
        _TWINS[resolver] = twins
    return twins


def _walk(resolver: URLResolver, levels: tuple[Any, ...]) -> Iterator[tuple[str, str]]:
    plain: list[URLPattern] = []  # this level's patterns so far
    for pattern in resolver.url_patterns:
        if isinstance(pattern, URLResolver):
            yield from _walk(pattern, (*levels, pattern.pattern))
            continue
        twin = next((p for p in reversed(plain) if _is_twin(pattern, p)), None)
        if twin is not None:
            yield join((*levels, pattern.pattern)), join((*levels, twin.pattern))
        plain.append(pattern)


def _is_twin(pattern: URLPattern, plain: URLPattern) -> bool:
    """Whether ``pattern`` is ``plain`` with DRF's format suffix: the same view, and
    ``plain``'s text (without its ``/`` and ``$``) followed by the suffix."""
    if pattern.callback is not plain.callback:
        return False
    stem = str(plain.pattern).rstrip("$").rstrip("/")
    text = str(pattern.pattern)
    return text.startswith(stem) and text[len(stem) :].startswith(SUFFIXES)
