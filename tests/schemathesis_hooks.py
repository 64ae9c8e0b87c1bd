"""schemathesis hooks for ``tests/schemathesis_run.sh`` (loaded through ``SCHEMATHESIS_HOOKS``).

Every generated request that carries a well-formed ``Idempotency-Key`` gets a fresh one, so a
request is never taken for a retry of an earlier one with another body (that would be a
``422``, documented but uninteresting to fuzz). A malformed or missing key, generated to test
the API's refusals, is sent as it was generated: the API must answer ``400``.
"""

from __future__ import annotations

import uuid
from typing import Any

import schemathesis

from django_idempotency.keys import InvalidKey, parse_key

HEADER = "Idempotency-Key"


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """Give a well-formed key a fresh value; leave malformed and missing keys alone."""
    headers = case.headers
    if not headers or HEADER not in headers:
        return
    try:
        parse_key(str(headers[HEADER]))
    except InvalidKey:
        return
    headers[HEADER] = str(uuid.uuid4())
