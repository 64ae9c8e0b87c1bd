"""Reading and validating idempotency keys: the ``Idempotency-Key`` header and key sources."""

from __future__ import annotations

import re

MAX_KEY_LENGTH = 255
# A usable key, whole: what validate_key accepts, tested at once on the request path.
_USABLE = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_LENGTH}}}")
#: A header value that is a usable bare key as it stands: no ``,`` (it might be a header sent
#: twice, which :func:`parse_key` looks at) and no leading ``"`` (a structured-field string).
#: What nearly every client sends; the request path tests it with this one match before it
#: calls :func:`parse_key`.
BARE_KEY = re.compile(rf"[\x21\x23-\x2b\x2d-\x7e][\x21-\x2b\x2d-\x7e]{{0,{MAX_KEY_LENGTH - 1}}}")


class InvalidKey(ValueError):
    """A key that cannot be used; the message says why (empty, over 255 characters, or a
    character outside printable ASCII).

    Raised by ``run_once`` (and the task and tool decorators) before anything is claimed or
    run; over HTTP the same key is answered ``400`` ``idempotency_key_invalid``. Importable
    as ``django_idempotency.InvalidKey``; a ``ValueError``.
    """


def header_meta_name(header: str) -> str:
    """``Idempotency-Key`` -> ``HTTP_IDEMPOTENCY_KEY``, the WSGI/ASGI ``META`` name."""
    return "HTTP_" + header.upper().replace("-", "_")


def _unquote_sf_string(value: str) -> str:
    # RFC 9651 sf-string: DQUOTE *( unescaped / "\" ( DQUOTE / "\" ) ) DQUOTE
    inner = value[1:-1]
    out: list[str] = []
    chars = iter(inner)
    for char in chars:
        if char == "\\":
            escaped = next(chars, None)
            if escaped not in ('"', "\\"):
                raise InvalidKey("a structured-field string may only escape '\"' and '\\'")
            out.append(escaped)
        elif char == '"':
            raise InvalidKey("an unescaped '\"' inside a structured-field string")
        else:
            out.append(char)
    return "".join(out)


def parse_key(raw: str) -> str:
    """The key a header value carries, bare (``abc``) or as a structured-field string (``"abc"``).

    A key is 1 to 255 characters of printable ASCII without space (0x21-0x7E), ``,``
    included. One key repeated and joined by ``,`` (``k,k``) is refused: that is how a header
    sent twice arrives, and it must not read as another key than ``k``.
    """
    if BARE_KEY.fullmatch(raw):
        return raw  # a bare key, as nearly every client sends it
    value = raw.strip(" \t")
    if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
        value = _unquote_sf_string(value)
    elif _repeated(value):
        # Servers and proxies join repeated header lines with ","; "k,k" is not a new key.
        raise InvalidKey("the header was sent more than once; send it once")
    return validate_key(value)


def _repeated(value: str) -> bool:
    """Whether ``value`` is one non-empty key joined to itself by ``,`` (``k,k``, ``k,k,k``)."""
    first, comma, rest = value.partition(",")
    return bool(first and comma) and all(part == first for part in rest.split(","))


def validate_key(value: object) -> str:
    """``value`` if it is a usable key: a string of 1 to 255 printable ASCII characters
    without space (0x21-0x7E); else :class:`InvalidKey` says why."""
    if isinstance(value, str) and _USABLE.fullmatch(value):
        return value
    if not isinstance(value, str):
        raise InvalidKey(f"a key must be a string, not {type(value).__name__}")
    if not value:
        raise InvalidKey("the key is empty")
    if len(value) > MAX_KEY_LENGTH:
        raise InvalidKey(f"the key is longer than {MAX_KEY_LENGTH} characters")
    if any(not 0x21 <= ord(char) <= 0x7E for char in value):
        raise InvalidKey("the key may only hold printable ASCII characters (0x21-0x7E)")
    return value
