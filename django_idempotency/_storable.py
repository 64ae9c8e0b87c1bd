"""What every supported database stores and gives back unchanged, and reading back what it holds.

The same value must be storable everywhere (PostgreSQL's ``jsonb``, MariaDB's and MySQL's
JSON, SQLite's JSON text) or refused everywhere, before any SQL runs: a statement the
database refuses would abort the caller's transaction on PostgreSQL. The limits:

- no NUL character (``jsonb`` and PostgreSQL's text columns refuse it) and no lone surrogate
  (neither ``jsonb`` nor MariaDB's JSON validation takes one), in any string or key;
- integers from ``-2**63`` to ``2**64 - 1`` (MySQL's JSON turns larger ones into floats);
- no ``NaN`` or infinity (not JSON);
- at most :data:`MAX_DEPTH` levels of nesting (MariaDB refuses a 32nd level);
- what PostgreSQL's ``jsonb`` holds (:func:`jsonb_problem`): at most
  :data:`MAX_JSONB_BYTES` in one string, or in one list or object with its members, at most
  :data:`MAX_JSONB_ITEMS` items in a list and :data:`MAX_JSONB_MEMBERS` members in an
  object.

Stored JSON is read back with :func:`read_json`, which never raises anything but
``ValueError``: another program may have written what this package would refuse.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any

# MariaDB's JSON columns refuse a document nested 32 levels deep; the list of a message's
# arguments (or the dict of its keyword arguments) is the first level.
MAX_DEPTH = 31
# The integers MySQL's JSON keeps as integers: signed and unsigned 64-bit.
MIN_JSON_INT = -(2**63)
MAX_JSON_INT = 2**64 - 1

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# PostgreSQL's jsonb: a string, or a list or object with its members, takes at most this
# many bytes (JENTRY_OFFLENMASK); it builds a list's items (an object's members) in one
# allocation of at most 1 GB, which holds this many of them; and it reads the JSON text
# in one allocation too. Past any of them the server refuses the value and aborts the
# caller's transaction.
MAX_JSONB_BYTES = 0x0FFFFFFF
MAX_JSONB_ITEMS = 2**24
MAX_JSONB_MEMBERS = 2**23
MAX_JSONB_TEXT = 2**30 - 2**20
# jsonb takes fewer bytes than this for each character of JSON text (one digit and its
# separator, ", ", take at most fifteen: an entry, a numeric and its padding): shorter
# text is within every limit above, and is not walked.
_JSONB_GROWTH = 8
# The most bytes a float takes in jsonb (17 significant digits, an exponent), padding in.
_JSONB_FLOAT = 25


def text_problem(text: str) -> str | None:
    """Why no database column can hold ``text``, or ``None`` when every one can."""
    if "\x00" in text:
        return "holds a NUL character"
    if _LONE_SURROGATE.search(text):
        return "holds a lone surrogate (half of a UTF-16 pair)"
    return None


def storable_text(text: str) -> str:
    """``text`` with its NUL characters and lone surrogates written as escapes (``\\x00``,
    ``\\ud800``): fit for any text column and for an HTML page, readable by a person."""
    text = text.replace("\x00", "\\x00")
    return _LONE_SURROGATE.sub(lambda found: f"\\u{ord(found.group()):04x}", text)


def json_value(value: Any, what: str) -> Any:
    """``value`` as every database stores it and JSON gives it back (tuples become lists,
    keys become strings), checked against the limits of this module.

    Raises ``TypeError`` naming ``what`` when it is not JSON or not storable everywhere;
    never touches the database.
    """
    return json_checked(value, what)[0]


def json_checked(value: Any, what: str) -> tuple[Any, str]:
    """:func:`json_value`, and its JSON text as a JSON column is sent it."""
    try:
        text = json.dumps(value, allow_nan=False)
        decoded = json.loads(text)
    except RecursionError:
        raise TypeError(
            f"{what} are nested too deeply for a JSON column (at most {MAX_DEPTH} levels)"
        ) from None
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be JSON: {exc}") from exc
    problem = _unstorable(decoded) or jsonb_problem(decoded, text)
    if problem is not None:
        raise TypeError(f"{what} cannot be stored in a JSON column: {problem}")
    return decoded, text


class _TooLarge(Exception):
    pass


def jsonb_problem(value: Any, text: str) -> str | None:
    """Why PostgreSQL's ``jsonb`` would refuse ``value`` (whose JSON text is ``text``), or
    ``None``. Its sizes are counted at most what ``jsonb`` takes (each number and nested
    list or object with the padding that may precede it), so the limits hold however the
    server lays the value out."""
    if len(text) * _JSONB_GROWTH <= MAX_JSONB_BYTES:
        return None
    if len(text) > MAX_JSONB_TEXT:
        return f"its JSON text ({len(text)} characters) is longer than {MAX_JSONB_TEXT}"
    try:
        _jsonb_size(value)
    except _TooLarge as exc:
        return str(exc)
    return None


def _jsonb_size(item: Any) -> int:
    # Recursive: MAX_DEPTH was checked before, so the stack stays short.
    if isinstance(item, str):
        size = len(item.encode("utf-8"))
        if size > MAX_JSONB_BYTES:
            raise _TooLarge(f"a string of {size} bytes is longer than {MAX_JSONB_BYTES}")
        return size
    if isinstance(item, bool) or item is None:
        return 0
    if isinstance(item, int):
        return 3 + 6 + 2 * -(-len(str(abs(item))) // 4)  # padding, headers, base-10000 digits
    if isinstance(item, float):
        return _JSONB_FLOAT
    if isinstance(item, dict):
        if len(item) > MAX_JSONB_MEMBERS:
            raise _TooLarge(f"an object of {len(item)} members has more than {MAX_JSONB_MEMBERS}")
        parts: Any = (part for pair in item.items() for part in pair)
        what = "an object"
    else:
        if len(item) > MAX_JSONB_ITEMS:
            raise _TooLarge(f"a list of {len(item)} items has more than {MAX_JSONB_ITEMS}")
        parts, what = item, "a list"
    size = 3 + 4  # padding, header
    for part in parts:
        size += 4 + _jsonb_size(part)  # its entry, itself
        if size > MAX_JSONB_BYTES:
            raise _TooLarge(f"{what} with its members takes more than {MAX_JSONB_BYTES} bytes")
    return size


def _unstorable(value: Any) -> str | None:
    # Iterative, so that no depth of nesting can exhaust the stack here.
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            problem = text_problem(item)
            if problem is not None:
                return f"a string {problem}"
        elif isinstance(item, int) and not isinstance(item, bool):
            if not MIN_JSON_INT <= item <= MAX_JSON_INT:
                return (
                    f"an integer of {item.bit_length()} bits is outside "
                    f"{MIN_JSON_INT}..{MAX_JSON_INT} (pass it as a string)"
                )
        elif isinstance(item, list | dict):
            if depth > MAX_DEPTH:
                return f"it is nested more than {MAX_DEPTH} levels deep"
            if isinstance(item, dict):
                for key in item:
                    problem = text_problem(key)
                    if problem is not None:
                        return f"a key {problem}"
                pending.extend((child, depth + 1) for child in item.values())
            else:
                pending.extend((child, depth + 1) for child in item)
    return None


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether decoded JSON ``value`` has lists or dicts more than ``limit`` levels deep."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, list | dict):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            pending.extend((child, depth + 1) for child in children)
    return False


_BREAKS_A_HEADER = re.compile("[\r\n\x00]")


def header_pairs(headers: Any) -> bool:
    """Whether stored headers are a list of ``[name, value]`` pairs of strings that a
    response can carry (no CR, LF or NUL: Django refuses them), or empty (``None`` too: a
    raw cursor's NULL). Read on every replay: a plain loop over what ``json.loads`` made."""
    if headers is None:
        return True
    if headers.__class__ is not list:
        return False
    for pair in headers:
        if pair.__class__ is not list or len(pair) != 2:
            return False
        name, value = pair
        if name.__class__ is not str or value.__class__ is not str:
            return False
        if _BREAKS_A_HEADER.search(name) or _BREAKS_A_HEADER.search(value):
            return False
    return True


def read_json(text: str) -> Any:
    """Stored JSON text, decoded; ``ValueError`` when it cannot be (invalid, a number of more
    digits than Python converts, or nested deeper than Python's recursion limit)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to be decoded") from None


# -- the names of a record: accounts and operations ------------------------------------

_MAX_NAME = 255


#: What a name stored by its hash begins with. A name given with this beginning is itself
#: stored by its hash, so no name stored as it is can take the form of a hashed one.
HASHED = "sha256:"


def storable_name(name: str) -> str:
    """An account or operation as stored: itself, or ``sha256:<hex>`` of it.

    Stored as it is when every supported database keeps it apart from every other name: at
    most 255 characters, no NUL, no lone surrogate, no whitespace at its end (MariaDB's
    collations compare ``'t1'`` and ``'t1 '`` as equal), and not beginning with ``sha256:``.
    Any other name is stored by its hash: ``sha256:`` and 64 hex digits, which no name
    stored as it is can spell. Deterministic, so every retry maps to the same record, and
    two different names never share one (short of a SHA-256 collision).
    """
    if len(name) <= _MAX_NAME and _plain(name):
        return name
    return HASHED + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()


def stored_names(account: str, operation: str) -> tuple[str, str, tuple[str, str] | None]:
    """``account`` and ``operation`` as stored (:func:`storable_name`), and how release
    0.1.4 stored the pair where that differs (:func:`legacy_names`)."""
    return storable_name(account), storable_name(operation), legacy_names(account, operation)


#: :func:`stored_names`, remembered: the same few accounts and operations come back on every
#: request and call, and a name's stored form never changes.
remembered_names = functools.lru_cache(maxsize=4096)(stored_names)


def legacy_names(account: str, operation: str) -> tuple[str, str] | None:
    """How release 0.1.4 stored ``(account, operation)``, where that differs from
    :func:`storable_name`'s spelling; ``None`` for every other pair (nearly all of them).

    0.1.4 hashed a name only when it was longer than 255 characters or held a NUL: a name
    beginning with ``sha256:`` or ending in whitespace was stored as it is, where it is now
    stored by its hash. A record it wrote for such a name is looked up by that spelling, so
    that a retry after the upgrade finds it within its TTL (see ``_store.adopt_legacy``).
    A name holding a lone surrogate has no such spelling: no database stored it, so 0.1.4
    wrote no record for it.

    Only a pair that no name has today is looked up: at least one of the two spelled in a
    way this release never stores (ending in whitespace, or ``sha256:`` and anything but 64
    hex digits). A name spelling a hash exactly (``sha256:`` and 64 hex digits) would find
    the record of the name that hash stands for today: that spelling alone is never
    looked up (0.1.4 gave both names one record, the defect 0.2.0 fixed).
    """
    if not (_legacy_only(account) or _legacy_only(operation)):
        return None
    if _LONE_SURROGATE.search(account) or _LONE_SURROGATE.search(operation):
        return None
    return _legacy_name(account), _legacy_name(operation)


def _legacy_name(name: str) -> str:
    return name if len(name) <= _MAX_NAME and "\x00" not in name else storable_name(name)


def _legacy_only(name: str) -> bool:
    """Whether 0.1.4 spelled ``name`` in a way no name is spelled today."""
    legacy = _legacy_name(name)
    return legacy != storable_name(name) and _HASH_FORM.fullmatch(legacy) is None


_HASH_FORM = re.compile(r"sha256:[0-9a-f]{64}")


def _plain(name: str) -> bool:
    # text_problem: a NUL or a lone surrogate, which no database stores.
    if name.startswith(HASHED) or (name and name[-1].isspace()):
        return False
    return text_problem(name) is None
