"""Routes as Django joins them, and the one spelling an endpoint's operation is named by.

DRF's ``format_suffix_patterns`` (and a router's format suffixes) add, right after a
pattern, a twin with the same view that also takes a ``.json``-like suffix: ``transfers/``
and ``transfers.<drf_format_suffix:format>`` are one endpoint. Its default operation is the
plain pattern's route, whichever spelling a request took, so one key never runs it twice.
The audit lists such a twin once, through the same table.

A view written twice, with and without its trailing slash (``path("orders/", view)`` and
``path("orders", view)``, or ``re_path(r"^orders$", view)``, a class view's ``as_view()`` at
each), with the same URL arguments, is one endpoint too, at one level of the URLconf or at
two (an app's ``orders/`` included under ``api/``, ``api/orders`` at the root; two routers
of one viewset, with and without trailing slashes): its operation is the route of the
spelling listed first, through the same table; so are the format suffixes of both spellings
(``orders.<drf_format_suffix:format>`` twice, one text: the first one resolves).

``i18n_patterns`` spell one endpoint once per language (``en/charges/``, ``fr/charges/``,
and ``charges/`` for the default language where it goes unprefixed). Its operation is the
route as the default language (``LANGUAGE_CODE``) spells it, whichever language a request
took: the route the audit shows, and the name earlier releases gave the default language's
requests.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

from django.conf import settings
from django.urls import LocalePrefixPattern, URLPattern, URLResolver, get_resolver

__all__ = ["canonical_route", "join", "twins"]

# How DRF spells a format suffix after the plain pattern's text: a path converter of its own
# (``<drf_format_suffix:format>``, ``<drf_format_suffix_json_html:format>``) or a regex
# group (``\.(?P<format>[a-z0-9]+)/?$``).
SUFFIXES = ("<drf_format_suffix", r"\.(?P<")

# Per resolver (a new one after clear_url_caches(), e.g. override_settings(ROOT_URLCONF)).
_TWINS: weakref.WeakKeyDictionary[URLResolver, dict[str, str]] = weakref.WeakKeyDictionary()
# Per resolver: its i18n_patterns' prefix and the routes below it, or None without any.
_LOCALES: weakref.WeakKeyDictionary[URLResolver, _Locale | None] = weakref.WeakKeyDictionary()


def join(levels: tuple[Any, ...]) -> str:
    """The route as ``ResolverMatch.route`` has it: each level's pattern joined, without the
    leading ``^`` of a regex below a level with text of its own (below an empty prefix,
    ``path("", include(...))``, Django keeps the ``^``)."""
    route = ""
    for level in reversed(levels):
        text = _default_prefix(level) if isinstance(level, LocalePrefixPattern) else str(level)
        if text:
            route = text + route.removeprefix("^")
    return route


def _default_prefix(pattern: LocalePrefixPattern) -> str:
    """``i18n_patterns``' prefix as the default language spells it (Django's
    ``LocalePrefixPattern.language_prefix`` with ``LANGUAGE_CODE`` active)."""
    return f"{settings.LANGUAGE_CODE}/" if pattern.prefix_default_language else ""


def canonical_route(route: str, urlconf: Any = None, view: Any = None) -> str:
    """The route that names ``route``'s endpoint: the default language's spelling of a route
    of ``i18n_patterns``, the plain pattern's for DRF's format suffix twin of a pattern,
    the first spelling's for a view written with and without its trailing slash, else
    ``route`` itself. ``view``: the view the request resolved to, where known; a route
    that spells a language's prefix is that language's only when its view is the one
    ``i18n_patterns`` has there."""
    route = _in_default_language(route, urlconf, view)
    return twins(urlconf).get(route, route)


class _Locale:
    """A URLconf's ``i18n_patterns``: its prefix, and each route below it as it follows a
    language's prefix (without a regex's ``^``), mapped to its spelling after no prefix and
    the views found there (several: DRF's format suffixes may name one route twice)."""

    __slots__ = ("pattern", "routes")

    def __init__(self, pattern: LocalePrefixPattern, below: URLResolver) -> None:
        self.pattern = pattern
        self.routes: dict[str, tuple[str, list[Any]]] = {}
        for levels, leaf in _leaves(below, ()):
            route = join((*levels, leaf.pattern))
            self.routes.setdefault(route.removeprefix("^"), (route, []))[1].append(leaf.callback)


def _in_default_language(route: str, urlconf: Any, view: Any) -> str:
    """``route`` as the default language spells it, where a language's prefix of
    ``i18n_patterns`` begins it (``fr/charges/``: ``en/charges/``); else ``route``."""
    resolver = get_resolver(urlconf)
    try:
        locale = _LOCALES[resolver]
    except KeyError:
        locale = _LOCALES[resolver] = next(
            (
                _Locale(pattern.pattern, pattern)
                for pattern in resolver.url_patterns
                if isinstance(pattern, URLResolver)
                and isinstance(pattern.pattern, LocalePrefixPattern)
            ),
            None,
        )
    if locale is None:
        return route  # no i18n_patterns: most projects
    language, slash, rest = route.partition("/")
    found = locale.routes.get(rest) if slash else None
    if found is None or (view is not None and view not in found[1]):
        return route  # not below i18n_patterns, or another view at that spelling
    if language.lower() not in {code.lower() for code, _ in settings.LANGUAGES}:
        return route
    prefix = _default_prefix(locale.pattern)
    return prefix + rest if prefix else found[0]


def _leaves(
    resolver: URLResolver, levels: tuple[Any, ...]
) -> Iterator[tuple[tuple[Any, ...], URLPattern]]:
    """Every view's pattern below ``resolver`` in the order Django tries them, with the
    levels above it (``resolver``'s own left out)."""
    for pattern in resolver.url_patterns:
        if isinstance(pattern, URLResolver):
            yield from _leaves(pattern, (*levels, pattern.pattern))
        else:
            yield levels, pattern


def twins(urlconf: Any = None) -> dict[str, str]:
    """Every twin's full route (a format suffix's, the second spelling of a view with and
    without its trailing slash), mapped to the full route that names its endpoint."""
    resolver = get_resolver(urlconf)
    twins = _TWINS.get(resolver)
    if twins is None:
        twins = {}
        for twin, plain in _walk(resolver):
            # The first pattern of one text is the one that resolves (DRF's format suffix of
            # ``x/`` and of ``x`` is one text), and a twin of a twin is named as its plain
            # pattern is (``x.json`` after ``x``, itself ``x/``'s twin).
            twins.setdefault(twin, twins.get(plain, plain))
        _TWINS[resolver] = twins
    return twins


class _Leaf(NamedTuple):
    pattern: URLPattern
    #: As ``ResolverMatch.route`` spells it.
    route: str
    #: The route without the pattern's own trailing ``/`` and ``$``: what its format suffix
    #: twin's route begins with.
    stem: str
    #: The regex the URL is matched by, every level's joined, its end written ``$``.
    regex: str


def _walk(resolver: URLResolver) -> Iterator[tuple[str, str]]:
    """``(twin's route, its plain pattern's route)`` of every twin, whatever level of the
    URLconf each is at (an app's ``orders/`` included under ``api/``, ``api/orders`` at the
    root)."""
    seen: list[_Leaf] = []  # the patterns so far
    # Their positions in ``seen`` by what a twin shares with them: its route before a format
    # suffix, its regex but for a trailing slash. A pattern is compared with those only (a
    # router puts thousands of patterns at one level), the one listed last first.
    by_stem: dict[str, list[int]] = {}
    by_regex: dict[tuple[str, bool], list[int]] = {}
    for levels, pattern in _leaves(resolver, ()):
        above, text = join(levels), str(pattern.pattern)
        leaf = _Leaf(
            pattern,
            join((*levels, pattern.pattern)),
            _below(above, text.rstrip("$").rstrip("/")),
            _regex(levels, pattern),
        )
        slashless = (_unslashed(leaf.regex), leaf.regex.endswith("$"))
        near = {
            *by_regex.get(slashless, ()),
            *(i for stem in _stems(leaf.route) for i in by_stem.get(stem, ())),
        }
        twin = next((seen[i] for i in sorted(near, reverse=True) if _is_twin(leaf, seen[i])), None)
        if twin is not None:
            yield leaf.route, twin.route
        by_stem.setdefault(leaf.stem, []).append(len(seen))
        by_regex.setdefault(slashless, []).append(len(seen))
        seen.append(leaf)


def _below(above: str, text: str) -> str:
    """A pattern's ``text`` below levels joined as ``above``, as :func:`join` joins it."""
    return above + text.removeprefix("^") if above else text


def _stems(route: str) -> set[str]:
    """What ``route`` begins with before each format suffix it may have."""
    return {route[:at] for at in range(len(route)) if route.startswith(SUFFIXES, at)}


def _is_twin(leaf: _Leaf, plain: _Leaf) -> bool:
    """Whether ``leaf`` is ``plain`` with DRF's format suffix (``plain``'s route without
    its ``/`` and ``$``, followed by the suffix) or with its trailing slash added or
    removed (``path("x/")`` beside ``re_path("^x$")`` too): the same view with the same URL
    arguments either way."""
    if not _same_view(leaf.pattern.callback, plain.pattern.callback) or (
        leaf.pattern.default_args != plain.pattern.default_args
    ):
        return False
    stem = plain.stem
    if leaf.route.startswith(stem) and leaf.route[len(stem) :].startswith(SUFFIXES):
        return True
    return (
        leaf.regex != plain.regex
        and leaf.regex.endswith("$") == plain.regex.endswith("$")
        and _unslashed(leaf.regex) == _unslashed(plain.regex)
    )


def _regex(levels: tuple[Any, ...], pattern: URLPattern) -> str:
    """The regex a URL is matched by at ``pattern`` below ``levels``: each level's (a
    path()'s regex, which a re_path() may spell alike) joined, ``^`` only at its start and
    only where every level has one (a regex without matches anywhere), its end ``$``."""
    parts = [_level_regex(level) for level in (*levels, pattern.pattern)]
    anchored = all(part.startswith("^") for part in parts)
    regex = ("^" if anchored else "") + "".join(part.removeprefix("^") for part in parts)
    return regex.removesuffix(r"\Z") + "$" if regex.endswith(r"\Z") else regex


def _level_regex(level: Any) -> str:
    if isinstance(level, LocalePrefixPattern):
        return "^" + re.escape(_default_prefix(level))
    compiled = getattr(level, "regex", None)  # none on a pattern class of its own
    return compiled.pattern if isinstance(compiled, re.Pattern) else str(level)


def _unslashed(text: str) -> str:
    return text.removesuffix("$").removesuffix("/")


def _same_view(one: Any, other: Any) -> bool:
    """The same function, or ``as_view()`` of one class with the same arguments (a view
    function of its own per call: Django's ``view_class``, DRF's ``cls`` with a viewset's
    ``actions``)."""
    if one is other:
        return True
    found = [
        (
            getattr(view, "view_class", None) or getattr(view, "cls", None),
            getattr(view, "view_initkwargs", None) or getattr(view, "initkwargs", None),
            getattr(view, "actions", None),
        )
        for view in (one, other)
    ]
    return found[0][0] is not None and found[0] == found[1]
