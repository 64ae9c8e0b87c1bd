"""Where a key (or an account) comes from when it is not the ``Idempotency-Key`` header.

Senders of webhooks put a stable id of their own in the delivery and keep it across retries:
GitHub in ``X-GitHub-Delivery``, Standard Webhooks in ``webhook-id``, Shopify in
``X-Shopify-Event-Id``, Stripe as the event's ``id`` in the JSON body. Each helper here makes
a callable ``request -> str | None`` for ``@idempotent(key=...)`` or the mixin's
``idempotency_key``::

    @idempotent(
        key=sources.json("id"),
        account=sources.fixed("webhook:stripe"),
        fingerprint=sources.same_delivery,
    )
    def stripe_webhook(request): ...

A source answers ``None`` when the request carries no id (treated like a missing header:
``400`` when a key is required), and raises ``django_idempotency.keys.InvalidKey`` when
what it found cannot be a key (``400`` with code ``idempotency_key_invalid``). The engine
validates every key a source gives like a header key: 1 to 255 printable ASCII characters.

Each source takes a Django ``HttpRequest`` or a DRF ``Request``. Beside the sources,
``same_delivery`` is the fingerprint of a webhook (``fingerprint=sources.same_delivery``):
every delivery of one event id is the same request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.exceptions import BadRequest, ImproperlyConfigured
from django.http import QueryDict
from django.http.multipartparser import MultiPartParserError
from django.http.request import RawPostDataException

from django_idempotency import _validation
from django_idempotency.fingerprint import (
    NotJSON,
    django_request,
    form_charset_reads_text,
    json_body,
    multipart_form,
)
from django_idempotency.keys import InvalidKey, parse_key

__all__ = [
    "Fixed",
    "FormField",
    "Header",
    "JSONField",
    "fixed",
    "form",
    "header",
    "json",
    "same_delivery",
]

KeySource = Callable[[Any], "str | None"]

_FORMS = frozenset({"application/x-www-form-urlencoded", "multipart/form-data"})


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ImproperlyConfigured(f"{what} must be a non-empty string, not {value!r}")
    return value


class Header:
    """The key is a request header's value, read like the ``Idempotency-Key`` header (bare or
    as a structured-field string; a header sent twice, joined with ``,``, is refused)."""

    def __init__(self, name: str) -> None:
        self.name = _name(name, "sources.header()'s header name")
        try:
            _validation.header_name(name)
        except _validation.Invalid as exc:
            # A name no header can have (a space, a colon): the key would never be found.
            raise ImproperlyConfigured(f"sources.header()'s header name {exc}") from None
        #: How the engine and the OpenAPI schema describe where the key is.
        self.description = f"{self.name} header"

    def __call__(self, request: Any) -> str | None:
        raw = django_request(request).headers.get(self.name)
        return None if raw is None else parse_key(raw)

    def __repr__(self) -> str:
        return f"sources.header({self.name!r})"


class JSONField:
    """The key is a member of the JSON body, found by a dotted path (``"data.object.id"``).

    A JSON string is the key as it is, a JSON integer its decimal string. A path that is not
    there (a member missing, or something other than an object on the way) is no key; any
    other JSON value at the path, or a body that is not JSON, is an invalid key.
    """

    def __init__(self, path: str) -> None:
        self.path = _name(path, "sources.json()'s path")
        self.parts = tuple(self.path.split("."))
        if not all(self.parts):
            raise ImproperlyConfigured(
                f"sources.json()'s path {path!r} has an empty member name; "
                "write members separated by single dots, e.g. 'data.object.id'"
            )
        self.description = f"{self.path} member of the JSON body"

    def __call__(self, request: Any) -> str | None:
        value: Any = self._body(request)
        for part in self.parts:
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        kind = "null" if value is None else type(value).__name__
        raise InvalidKey(f"{self.path} in the JSON body is a {kind}, not a string or an integer")

    @staticmethod
    def _body(request: Any) -> Any:
        inner = django_request(request)
        try:
            return json_body(inner)
        except NotJSON:
            raise InvalidKey("the request's body is not JSON") from None
        except RawPostDataException:
            # DRF parsed the body before us (an authentication or permission class read
            # request.data): what it parsed is the body.
            data = getattr(request, "data", None)
            if isinstance(data, (dict, list)) and not isinstance(data, QueryDict):
                return data
            raise InvalidKey("the request's body is not JSON") from None

    def __repr__(self) -> str:
        return f"sources.json({self.path!r})"


class FormField:
    """The key is a field of a submitted form (``application/x-www-form-urlencoded`` or
    ``multipart/form-data``, whatever the method), e.g. a hidden input filled when the form
    is rendered: a form submitted twice runs once. A field sent more than once, or a form
    that cannot be read (a broken multipart body, a charset that reads no text), is an
    invalid key; a body of another content type carries no key."""

    def __init__(self, field: str) -> None:
        self.field = _name(field, "sources.form()'s field name")
        self.description = f"{self.field} form field"

    def __call__(self, request: Any) -> str | None:
        inner = django_request(request)
        content_type = (inner.content_type or "").lower()
        if content_type not in _FORMS:
            return None
        if not form_charset_reads_text(inner):
            raise InvalidKey(
                f"the form could not be read (its charset {inner.encoding!r} reads no text)"
            )
        try:
            if content_type == "multipart/form-data":
                data = multipart_form(inner)[0]
            elif inner.method == "POST":
                data = inner.POST
            else:  # Django parses forms for POST only
                data = _unposted_form(inner)
        except (MultiPartParserError, BadRequest, RawPostDataException) as exc:
            # A broken multipart body; Django refusing an urlencoded POST not in UTF-8; a
            # stream read by something that kept no form.
            raise InvalidKey(f"the form could not be read ({exc})") from None
        values = data.getlist(self.field)
        if not values:
            return None
        if len(values) > 1:
            raise InvalidKey(f"the form field {self.field} was sent {len(values)} times")
        value: str = values[0]
        return value

    def __repr__(self) -> str:
        return f"sources.form({self.field!r})"


def _unposted_form(request: Any) -> QueryDict:
    """The urlencoded form of a request other than a POST, which Django does not parse:
    from its body; or, when something read the stream before the key (DRF's parsers,
    from a permission reading ``request.data``), the form it kept as ``request.POST``."""
    try:
        return QueryDict(request.body, encoding=request.encoding)
    except RawPostDataException:
        if "_post" not in request.__dict__:
            raise
        form: QueryDict = request.POST
        return form


class Fixed:
    """A resolver that always answers the same string: the account of a sender that has no
    user (``account=sources.fixed("webhook:stripe")``)."""

    def __init__(self, value: str) -> None:
        self.value = _name(value, "sources.fixed()'s value")

    def __call__(self, request: Any) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"sources.fixed({self.value!r})"


def header(name: str) -> Header:
    """The key is the value of the request header ``name`` (e.g. ``"X-GitHub-Delivery"``);
    no key when the header is absent."""
    return Header(name)


def json(path: str) -> JSONField:
    """The key is the JSON body's member at the dotted ``path`` (e.g. ``"id"`` or
    ``"data.object.id"``): a string as it is, an integer as its decimal string; no key when
    the path is not there; an invalid key for any other JSON value or a body that is not
    JSON."""
    return JSONField(path)


def form(field: str) -> FormField:
    """The key is the submitted form's ``field`` (e.g. a hidden ``idempotency_key`` input);
    no key when the field is absent."""
    return FormField(field)


def fixed(value: str) -> Fixed:
    """A resolver that always answers ``value``: use it as ``account=`` for a sender without
    users, so the sender is the account (``"webhook:stripe"``)."""
    return Fixed(value)


def same_delivery(request: Any) -> str:
    """A fingerprint for webhooks: every delivery with one sender's id is the same request.

    Use it as ``fingerprint=sources.same_delivery`` beside a key taken from the delivery
    (``key=sources.json("id")``, ``sources.header("webhook-id")``) and a verified signature.
    The signature proves who sent the delivery and the sender keeps the id of one event
    across its retries, while bookkeeping in the body (Stripe's ``pending_webhooks``, for
    one) may change between them: the default fingerprint, a hash of the body, would answer
    such a redelivery ``422`` and the sender would keep retrying. This one answers the same
    constant for every request, so a redelivery is always replayed.

    Only for a key the sender chose and signed: with a key a client chooses, the same key
    with another body must stay a ``422``.
    """
    return "sender-id"


same_delivery.fingerprint_version = "sender-id"  # type: ignore[attr-defined]
