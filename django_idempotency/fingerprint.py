"""The request fingerprint: a SHA-256 over a canonical form of what the client asked for.

Two requests that mean the same thing get the same fingerprint: JSON is compared after
parsing (sorted keys, no insignificant whitespace), forms as sorted pairs, uploaded files by
the hash of their content, the query string as sorted pairs. Transport metadata
(``User-Agent``, ``Date``, tracing headers, the multipart boundary) is left out.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
from collections.abc import Callable, Iterable
from typing import Any

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.http import HttpRequest, QueryDict
from django.http.multipartparser import MultiPartParserError
from django.http.request import RawPostDataException
from django.utils.datastructures import MultiValueDict

DEFAULT_VERSION = "v1"

# Where the parsed JSON body is kept on the request, so that a key source and the
# fingerprint parse it once between them.
_JSON_BODY = "_idempotency_json_body"
# The same for the form of a multipart request that is not a POST (Django parses POST's).
_MULTIPART_FORM = "_idempotency_multipart_form"


class NotJSON(ValueError):
    """The request's body is not a JSON document."""


def django_request(request: Any) -> HttpRequest:
    """The Django ``HttpRequest`` behind a DRF ``Request`` (or the request itself)."""
    inner = getattr(request, "_request", request)
    assert isinstance(inner, HttpRequest)
    return inner


def json_body(request: HttpRequest) -> Any:
    """The request's body parsed as JSON, parsed once per request; :class:`NotJSON` when it
    is not JSON (whatever its ``Content-Type`` says)."""
    cached = request.__dict__.get(_JSON_BODY)
    if cached is None:
        try:
            cached = (True, _parsed(request.body))
        except (ValueError, RecursionError) as exc:
            cached = (False, str(exc))
        request.__dict__[_JSON_BODY] = cached
    parsed, value = cached
    if not parsed:
        raise NotJSON(value)
    return value


def _parsed(body: bytes) -> Any:
    # json.loads on bytes first works out their encoding (UTF-16 and UTF-32 documents, a
    # BOM); one that opens with "{" or "[" and then a byte that is not NUL is UTF-8 to it:
    # decoded here as json.loads would, without the guess.
    if len(body) > 1 and body[0] in (0x7B, 0x5B) and body[1]:
        return json.loads(body.decode("utf-8", "surrogatepass"))
    return json.loads(body)


@functools.lru_cache(maxsize=16)
def _decodes_text(encoding: str) -> bool:
    try:
        bytes(range(256)).decode(encoding, "replace")
    except (LookupError, UnicodeError):
        return False
    return True


def form_charset_reads_text(request: HttpRequest) -> bool:
    """Whether Django's form parsers can decode text in the request's charset.

    Django takes any charset Python has a codec for: ``rot13`` or ``base64``, which decode
    no text, and ``idna``, ``punycode`` or ``undefined``, which cannot replace what they
    fail to decode, make its form parsers raise (``LookupError``, ``UnicodeError``). No
    charset, the most common case, is Django's default, which reads text.
    """
    encoding = request.encoding
    return encoding is None or _decodes_text(encoding)


def multipart_form(request: HttpRequest) -> tuple[QueryDict, MultiValueDict[str, Any]]:
    """The fields and files of a ``multipart/form-data`` request.

    ``request.POST`` and ``request.FILES`` for a POST; Django parses no other method's
    form, so it is parsed here, once per request (a key source and the fingerprint share
    it): from the body, which stays readable; from the stream, as Django parses a POST's,
    when the body is larger than Django holds in memory (``DATA_UPLOAD_MAX_MEMORY_SIZE``),
    the form then left as ``request.POST`` and ``request.FILES``, where DRF's parsers find
    it. A form something parsed from the stream before (DRF's parsers, django-ninja's
    ``fix_request_files_middleware``) is read where it left it. Raises what Django's parser
    raises (``MultiPartParserError`` for a broken body), and ``RawPostDataException`` when
    the stream was read and no form kept.
    """
    if request.method == "POST":
        return request.POST, request.FILES
    parsed = request.__dict__.get(_MULTIPART_FORM)
    if parsed is None:
        if getattr(request, "_read_started", False) and not hasattr(request, "_body"):
            if "_files" not in request.__dict__:
                raise RawPostDataException(
                    "the request's stream was read before its form could be parsed"
                )
            parsed = (request.POST, request.FILES)  # parsed from the stream, and kept
        elif _held_in_memory(request):
            parsed = request.parse_file_upload(request.META, io.BytesIO(request.body))
        else:
            parsed = request.parse_file_upload(request.META, request)
            request._post, request._files = parsed  # type: ignore[attr-defined]
        request.__dict__[_MULTIPART_FORM] = parsed
    return parsed


def _held_in_memory(request: HttpRequest) -> bool:
    """Whether Django reads the request's body into memory (``request.body``): not when its
    ``Content-Length`` is over ``DATA_UPLOAD_MAX_MEMORY_SIZE``, which ``request.body``
    refuses (``RequestDataTooBig``)."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    if limit is None:
        return True
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return True  # request.body says what is wrong with it
    return length <= limit


def _body_in_hand(request: HttpRequest) -> bool:
    """Whether the request's bytes are in memory and not empty: read whole for any
    method's multipart form but a POST's, which Django parses from the stream unless
    something read the body before, and one parsed from the stream (too large to hold, or
    parsed before: :func:`multipart_form`)."""
    if not hasattr(request, "_body") and (
        request.method == "POST" or getattr(request, "_read_started", False)
    ):
        return False
    return bool(request.body)


def _raw(request: HttpRequest, content_type: str) -> dict[str, str]:
    return {"raw": hashlib.sha256(request.body).hexdigest(), "type": content_type}


def _sorted_pairs(data: QueryDict) -> list[list[str]]:
    return sorted([key, value] for key, values in data.lists() for value in values)


def _query(request: HttpRequest) -> list[list[str]]:
    # No query string and no GET set on the request: no pairs, without building a QueryDict
    # (most requests that carry a key). A GET a middleware assigned is read as it is.
    if "GET" not in request.__dict__ and not request.META.get("QUERY_STRING"):
        return []
    return _sorted_pairs(request.GET)


def _file_digest(upload: UploadedFile[Any]) -> str:
    digest = hashlib.sha256()
    for chunk in upload.chunks():
        digest.update(chunk)
    upload.seek(0)  # the view reads the file after us
    return digest.hexdigest()


def _files(files: Any) -> list[list[str]]:
    return sorted(
        [name, upload.name or "", _file_digest(upload)]
        for name, uploads in files.lists()
        for upload in uploads
    )


def _canonical_body(request: HttpRequest) -> Any:
    content_type = (request.content_type or "").lower()
    if content_type == "multipart/form-data" and form_charset_reads_text(request):
        try:
            post, files = multipart_form(request)
        except MultiPartParserError:
            if request.method == "POST":
                raise  # Django's answer: 400, before the claim
            return {"raw": hashlib.sha256(request.body).hexdigest()}
        if not post and not files and _body_in_hand(request):
            # No part in it (the boundary never appears: JSON under a wrong content type):
            # every such body parses to one empty form, so its bytes tell them apart.
            return _raw(request, content_type)
        return {"form": _sorted_pairs(post), "files": _files(files)}
    if content_type == "application/x-www-form-urlencoded" and form_charset_reads_text(request):
        encoding = request.encoding or "utf-8"
        return {"form": _sorted_pairs(QueryDict(request.body, encoding=encoding))}
    if content_type == "application/json" or content_type.endswith("+json"):
        try:
            return {"json": json_body(request)}
        except NotJSON:
            pass  # the view answers this one; compare the raw bytes
    # Anything else, and a form in a charset that reads no text: its bytes.
    return _raw(request, content_type)


def _body_of(request: Any, inner: HttpRequest) -> Any:
    try:
        return _canonical_body(inner)
    except RawPostDataException:
        # A DRF permission or authentication class parsed the stream before us: the body is
        # gone, but DRF kept what it parsed, which is the same on every retry of this view.
        parsed = getattr(request, "data", None)
        return {"parsed": json.loads(json.dumps(parsed, sort_keys=True, default=_parsed_value))}


def _parsed_value(value: Any) -> Any:
    """What DRF parsed that JSON does not hold: an uploaded file by its name and the hash of
    its content (as a form's files are), anything else by its text."""
    if isinstance(value, UploadedFile):
        return [value.name or "", _file_digest(value)]
    return str(value)


# Sorted keys, no insignificant whitespace, text as it is: made once, used per request.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _canonical_encoder() -> Callable[[Any], str]:
    """``_CANONICAL_JSON.encode``, with its C encoder made once instead of per call.

    ``JSONEncoder.encode`` builds a C encoder on every call; the same one (the same
    options, so the same text) serves every request here. Without circular-reference
    markers, which it would have to empty again after an error: what is encoded is parsed
    JSON and the request's strings, never circular (a custom fingerprint's circular part
    fails with RecursionError instead of ValueError). Where the interpreter has no C encoder
    (``json.encoder.c_make_encoder`` is None), ``encode`` itself.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    options = _CANONICAL_JSON
    try:
        encoder = make(  # type: ignore[misc]
            None,  # no markers: see above
            options.default,
            json.encoder.encode_basestring,  # ensure_ascii=False
            None,  # indent
            options.key_separator,
            options.item_separator,
            options.sort_keys,
            options.skipkeys,
            options.allow_nan,
        )
    except TypeError:  # None, or another interpreter's signature
        return options.encode

    def encode(value: Any) -> str:
        return "".join(encoder(value, 0))

    # The same text as JSONEncoder.encode, or that one is used.
    sample = {"b": [1, 2.5, None, True], "a": {"é": '\ud800"\\'}}
    return encode if encode(sample) == options.encode(sample) else options.encode


_encode = _canonical_encoder()


def canonical_request(request: Any, parts: Iterable[tuple[str, Any]] = ()) -> bytes:
    """The canonical bytes the default fingerprint hashes, for tests and custom fingerprints."""
    inner = django_request(request)
    context = getattr(inner, "idempotency", None)
    match = inner.resolver_match
    kwargs = match.kwargs if match else None
    form: dict[str, Any] = {
        "method": inner.method,
        "operation": getattr(context, "operation", None),
        "url_kwargs": {k: str(v) for k, v in kwargs.items()} if kwargs else {},
        "query": _query(inner),
        "body": _body_of(request, inner),
    }
    form.update(parts)
    try:
        text = _encode(form)
    except RecursionError:
        # A JSON body a key source parsed higher up the stack, nested too deep to encode
        # down here: its bytes, as for a body too deep to parse.
        form["body"] = _raw(inner, (inner.content_type or "").lower())
        text = _encode(form)
    # A JSON body may escape a lone surrogate ("\ud800"); "surrogatepass" encodes it, and
    # every valid string exactly as before, so no stored fingerprint changes.
    return text.encode("utf-8", "surrogatepass")


def default_fingerprint(request: Any) -> str:
    """SHA-256 (hex) of :func:`canonical_request`."""
    return hashlib.sha256(canonical_request(request)).hexdigest()


default_fingerprint.fingerprint_version = DEFAULT_VERSION  # type: ignore[attr-defined]


def fingerprint_version(function: Any) -> str:
    """The version stored beside a hash: the function's ``fingerprint_version`` or its path.

    An object without a path of its own (an instance of a class with ``__call__``) is named
    by its class's path, a ``functools.partial`` by its function's: two such objects of one
    module are two versions, never the module's name alone. A path longer than the column
    (64 characters) is kept as its first 47 characters, a ``~`` and 16 hex digits of its
    SHA-256: two paths alike in their first 64 characters (``..._v1`` and ``..._v2``) are
    two versions, never one."""
    version = getattr(function, "fingerprint_version", None)
    if version:
        return str(version)
    named = function
    while isinstance(named, functools.partial):
        named = named.func
    if not hasattr(named, "__qualname__"):
        named = type(named)
    path = f"{getattr(named, '__module__', '')}.{getattr(named, '__qualname__', '')}"
    if len(path) <= _VERSION_LENGTH:
        return path
    digest = hashlib.sha256(path.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{path[: _VERSION_LENGTH - 17]}~{digest}"


# The record's column for the version (_validation.FINGERPRINT_LENGTH).
_VERSION_LENGTH = 64
