"""The rules that settings and per-view arguments must satisfy, written once.

Each parser takes a value as a user wrote it and returns it in the form the app uses, or
raises :class:`Invalid` saying what was expected. They never coerce a wrong type: a string is
not a list of one method, ``1`` is not ``True``, ``None`` is not "the default". The system
checks (:mod:`django_idempotency.checks`), the settings object
(:data:`django_idempotency.conf.app_settings`) and every adapter's per-view arguments
(:func:`._options.validated`) use these same functions, so the rules cannot drift apart.
"""

from __future__ import annotations

import base64
import functools
import math
import re
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.utils.module_loading import import_string

from django_idempotency._policies import RECOVERY_POLICIES
from django_idempotency._storable import text_problem

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# An RFC 9110 token: what a header or a method name may consist of.
# Matched whole (fullmatch): "$" would let a trailing newline through ("POST\n").
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Sequences: the concrete collection types only, so a str, bytes, a dict or a generator
# is never taken apart into its characters, keys or items.
_COLLECTIONS = (list, tuple, set, frozenset)
_COLLECTION = "a list, tuple or set"
# Far enough for any retention; near enough that ``now + duration`` stays a valid datetime.
MAX_DURATION = timedelta(days=36525)
# Fits a signed 32-bit integer: every database's LIMIT takes it.
MAX_INT = 2**31 - 1


class Invalid(ValueError):
    """A value that breaks its rule; ``expected`` says what the rule admits."""

    def __init__(self, expected: str, value: Any, detail: str | None = None) -> None:
        self.expected = expected
        self.value = value
        self.detail = detail
        reason = detail if detail is not None else f"got {describe(value)}"
        super().__init__(f"must be {expected}; {reason}")


def describe(value: Any) -> str:
    """A short account of a wrong value for an error message: its repr and its type."""
    if value is None or isinstance(value, bool):
        return repr(value)
    try:
        text = repr(value)
    except Exception:  # a repr that raises must not turn a report into a crash
        text = "<unprintable>"
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


@functools.lru_cache(maxsize=128)
def import_cached(path: str) -> Any:
    """``import_string``, remembered: dotted paths are resolved on hot paths."""
    return import_string(path)


def flag(value: Any) -> bool:
    """``True`` or ``False``, nothing that merely looks like one."""
    if not isinstance(value, bool):
        raise Invalid("True or False", value)
    return value


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _counted(value: Any, expected: str) -> int:
    if not _whole(value) or not 1 <= value <= MAX_INT:
        raise Invalid(expected, value)
    result: int = value
    return result


def positive_int(value: Any) -> int:
    """A whole number from 1 to ``MAX_INT``."""
    return _counted(value, f"a whole number from 1 to {MAX_INT}")


def counted_argument(name: str, value: Any) -> int | None:
    """A count given to a maintenance function (``batch_size``, ``max_batches``, ``limit``):
    ``None`` (its default), or what its setting and its command admit, a whole number from 1
    to ``MAX_INT``; ``ValueError`` naming ``name`` for anything else."""
    if value is None:
        return None
    try:
        return positive_int(value)
    except Invalid as exc:
        raise ValueError(f"{name} {exc}") from None


def optional_positive_int(value: Any) -> int | None:
    """A whole number from 1 to ``MAX_INT``, or ``None``."""
    if value is None:
        return None
    return _counted(value, f"a whole number from 1 to {MAX_INT}, or None")


def _duration(value: Any, allow_zero: bool) -> timedelta:
    floor = "zero or more" if allow_zero else "more than zero"
    expected = f"a timedelta or a number of seconds, {floor} and at most {MAX_DURATION.days} days"
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise Invalid(expected, value)
    if isinstance(value, float) and not math.isfinite(value):
        raise Invalid(expected, value)
    try:
        result = value if isinstance(value, timedelta) else timedelta(seconds=value)
    except OverflowError:
        raise Invalid(expected, value) from None
    if result < timedelta(0) or result > MAX_DURATION or (not allow_zero and not result):
        raise Invalid(expected, value)
    return result


def duration(value: Any) -> timedelta:
    """A positive ``timedelta``, or a positive number of seconds made into one."""
    return _duration(value, allow_zero=False)


def duration_or_zero(value: Any) -> timedelta:
    """Like :func:`duration`, and zero is admitted."""
    return _duration(value, allow_zero=True)


def _listed(names: list[str], one: str, many: str) -> str:
    return f"{', '.join(names)} {one if len(names) == 1 else many}"


def _collection(value: Any, expected: str) -> list[Any]:
    if not isinstance(value, _COLLECTIONS):
        raise Invalid(expected, value)
    return list(value)


def methods(value: Any) -> frozenset[str]:
    """A non-empty collection of HTTP method names with a side effect, upper-cased."""
    expected = f'a non-empty {_COLLECTION[2:]} of HTTP method names such as ["POST", "PATCH"]'
    names = _collection(value, expected)
    if not names:
        raise Invalid(expected, value)
    for name in names:
        if not isinstance(name, str) or not _TOKEN.fullmatch(name):
            raise Invalid(expected, value, f"{describe(name)} is not a method name")
    result = frozenset(name.upper() for name in names)
    safe = sorted(result & SAFE_METHODS)
    if safe:
        raise Invalid(
            expected + " and without safe methods (GET, HEAD, OPTIONS, TRACE)",
            value,
            f"{_listed(safe, 'has', 'have')} no side effect to deduplicate",
        )
    return result


def header_name(value: Any) -> str:
    """An HTTP header name (an RFC 9110 token)."""
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise Invalid('an HTTP header name such as "Idempotency-Key"', value)
    return value


def header_names(value: Any, refused: frozenset[str]) -> tuple[str, ...]:
    """A collection of header names, none of them (compared without case) in ``refused``.

    Repeats are dropped, keeping the first spelling.
    """
    expected = f'{_COLLECTION} of HTTP header names such as ["X-Request-Id"]'
    names = _collection(value, expected)
    seen: dict[str, str] = {}
    for name in names:
        if not isinstance(name, str) or not _TOKEN.fullmatch(name):
            raise Invalid(expected, value, f"{describe(name)} is not a header name")
        seen.setdefault(name.lower(), name)
    never = sorted(set(seen) & refused)
    if never:
        raise Invalid(
            expected + ", none of them a never-stored header",
            value,
            f"{_listed(never, 'is', 'are')} never stored",
        )
    return tuple(seen.values())


def client_error_statuses(value: Any) -> frozenset[int]:
    """A collection (possibly empty) of 4xx status codes."""
    expected = f"{_COLLECTION} of 4xx status codes such as [409, 429]"
    statuses = _collection(value, expected)
    for status in statuses:
        if not _whole(status) or not 400 <= status <= 499:
            raise Invalid(expected, value, f"{describe(status)} is not a 4xx status code")
    return frozenset(statuses)


def seconds(value: Any) -> int:
    """A whole number of seconds, at least 1 (a ``Retry-After`` value)."""
    return _counted(value, "a whole number of seconds, at least 1")


def optional_seconds(value: Any) -> int | None:
    """:func:`seconds`, or ``None``."""
    if value is None:
        return None
    return _counted(value, "a whole number of seconds, at least 1, or None")


_FERNET_KEYS = "a list or tuple of Fernet keys (each made by Fernet.generate_key())"


def fernet_keys(value: Any) -> tuple[str, ...]:
    """A list or tuple (possibly empty) of distinct Fernet keys, as text.

    A key is 32 bytes in URL-safe base64, as ``Fernet.generate_key()`` makes it (``str`` or
    ``bytes``). No message ever shows a key: they are secrets, and checks end up in logs.
    """
    if not isinstance(value, list | tuple):
        raise Invalid(_FERNET_KEYS, value, f"got a {type(value).__name__}")
    keys: list[str] = []
    seen: list[bytes] = []
    for number, item in enumerate(value, 1):
        raw = _fernet_key_bytes(item)
        if isinstance(raw, str):
            raise Invalid(_FERNET_KEYS, value, f"key {number} of {len(value)} {raw}")
        # One key, whatever its spelling (the last digit's spare bits): compared as bytes.
        if raw in seen:
            raise Invalid(
                _FERNET_KEYS, value, f"key {number} is the same as key {seen.index(raw) + 1}"
            )
        seen.append(raw)
        keys.append(item.decode("ascii") if isinstance(item, bytes) else item)
    return tuple(keys)


#: A Fernet key's text: URL-safe base64 only. Fernet refuses the standard alphabet's ``+``
#: and ``/`` (``openssl rand -base64 32``), which ``b64decode(altchars=...)`` would take.
_URL_SAFE_BASE64 = re.compile(r"[A-Za-z0-9_-]*={0,2}")


def _fernet_key_bytes(item: Any) -> bytes | str:
    """A key's 32 bytes, or what is wrong with it."""
    if not isinstance(item, str | bytes):
        return f"is a {type(item).__name__}, not a str"
    try:
        text = item.decode("ascii") if isinstance(item, bytes) else item
        if not text.isascii() or _URL_SAFE_BASE64.fullmatch(text) is None:
            raise ValueError(text)
        raw = base64.urlsafe_b64decode(text)
    except (ValueError, TypeError):  # binascii.Error is a ValueError; so is non-ASCII text
        return "is not URL-safe base64 (A-Z, a-z, 0-9, - and _, as Fernet.generate_key() makes it)"
    if len(raw) != 32:
        return f"decodes to {len(raw)} bytes, not 32"
    return raw


_CALLABLE = "a callable or the dotted import path of one"


def callable_ref(value: Any) -> Callable[..., Any]:
    """A callable, or the dotted path of one (imported now)."""
    if callable(value):
        given: Callable[..., Any] = value
        return given
    if not isinstance(value, str) or "." not in value.strip("."):
        raise Invalid(_CALLABLE, value)
    try:
        imported = import_cached(value)
    except Exception as exc:  # an import runs the module: anything may come out of it
        raise Invalid(_CALLABLE, value, f"{value!r} cannot be imported ({exc})") from None
    if not callable(imported):
        raise Invalid(_CALLABLE, value, f"{value!r} imports {describe(imported)}")
    result: Callable[..., Any] = imported
    return result


#: The longest fingerprint, and fingerprint version, a record stores (their columns).
FINGERPRINT_LENGTH = 64


def fingerprint_text(value: Any) -> str | None:
    """``value`` as the record stores a fingerprint or its version (a plain ``str``), or
    ``None`` when it cannot: not text, longer than ``FINGERPRINT_LENGTH``, or text no
    database column holds (a NUL, which PostgreSQL refuses; a lone surrogate, which no
    database encodes)."""
    if not isinstance(value, str) or len(value) > FINGERPRINT_LENGTH or "\x00" in value:
        return None
    # A SafeString, a numpy str_: text all the same, stored as a plain str.
    text: str = value if value.__class__ is str else str.__str__(value)
    if not text.isascii() and text_problem(text) is not None:
        return None
    return text


def fingerprint(value: Any) -> Callable[..., Any]:
    """A fingerprint: :func:`callable_ref`, whose ``fingerprint_version`` (where it declares
    one) fits the record's column."""
    function = callable_ref(value)
    version = getattr(function, "fingerprint_version", None)
    if version and fingerprint_text(str(version)) is None:
        raise Invalid(
            f"a callable whose fingerprint_version has at most {FINGERPRINT_LENGTH} "
            "characters, none of them a NUL or a lone surrogate (the record stores it "
            "beside each hash)",
            value,
            f"its fingerprint_version is {describe(str(version))}",
        )
    return function


def recovery(value: Any) -> str | Callable[..., Any]:
    """A recovery policy: ``"retry"``, ``"fail"``, ``"resume"``, a callable or the dotted path
    of one.

    Returned as given (a dotted path stays a string: it is what the record stores), once
    the path is known to import a callable.
    """
    if isinstance(value, str) and value in RECOVERY_POLICIES:
        return value
    try:
        resolved = callable_ref(value)
    except Invalid as exc:
        raise Invalid(
            ", ".join(f'"{name}"' for name in RECOVERY_POLICIES)
            + ", a callable recover(record) or the dotted path of one",
            value,
            exc.detail,
        ) from None
    return value if isinstance(value, str) else resolved


def operation(value: Any) -> str:
    """An operation's name: a string that is not empty."""
    if not isinstance(value, str) or not value.strip():
        raise Invalid('a non-empty string such as "charges.create"', value)
    return value


# -- per-view arguments --------------------------------------------------------------------


def name_of(obj: Any) -> str:
    """A function's or a class's dotted name, for error messages."""
    module = getattr(obj, "__module__", None) or "?"
    return f"{module}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def caller(depth: int = 2) -> str:
    """Where a decorator was applied, for its error messages: ``module line N``."""
    frame = sys._getframe(depth)
    return f"{frame.f_globals.get('__name__', '?')} line {frame.f_lineno}"
