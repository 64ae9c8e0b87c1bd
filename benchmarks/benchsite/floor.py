"""The floor: the create endpoint with the claim and the completion written by hand.

The yardstick of ``make bench``: the fewest statements and the least Python the design
allows, with no library around them. One claim statement in autocommit (the engine's shape:
``INSERT … SELECT … WHERE NOT EXISTS … ON CONFLICT DO NOTHING``, the row in the way handed
back by a ``UNION ALL``, the claim's commit not waiting for its WAL flush), then ``BEGIN``,
the view, one fenced ``UPDATE``, ``COMMIT``. It hashes the raw body, answers ``400`` for a
missing or malformed key, ``409`` while the key is in flight, ``422`` for another body under
a used key, replays the stored status, body and ``Content-Type``, and releases the claim on a
5xx or an exception. It does nothing else: no settings, no recovery of a stale lease, no
signals, no canonical fingerprint, no caller's transaction, no other database.

PostgreSQL only, like the benchmarks.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from django.db import connection, transaction
from django.http import HttpResponse
from django.http.response import HttpResponseBase
from rest_framework.request import Request

_TABLE = "benchsite_floorrecord"
_IDENTITY = "account = %(account)s AND operation = %(operation)s AND key = %(key)s"
CLAIM = (
    f"WITH claim AS (INSERT INTO {_TABLE}"
    " (account, operation, key, request_hash, status, lease_token, lease_expires_at,"
    " expires_at, content_type)"
    " SELECT %(account)s, %(operation)s, %(key)s, %(hash)s, 'in_progress', %(token)s::uuid,"
    " now() + interval '60 seconds', now() + interval '24 hours', ''"
    f" WHERE NOT EXISTS (SELECT 1 FROM {_TABLE} WHERE {_IDENTITY})"
    " ON CONFLICT (account, operation, key) DO NOTHING RETURNING id)"
    " SELECT id, true, NULL, NULL, NULL, NULL, NULL,"
    " set_config('synchronous_commit', 'off', true) FROM claim"
    " UNION ALL SELECT id, false, status, request_hash, response_status, content_type,"
    f" response_body, NULL FROM {_TABLE} WHERE {_IDENTITY} AND NOT EXISTS (SELECT 1 FROM claim)"
)
COMPLETE = (
    f"UPDATE {_TABLE} SET status = 'completed', response_status = %s, content_type = %s,"
    " response_body = %s, lease_token = NULL, lease_expires_at = NULL"
    " WHERE id = %s AND lease_token = %s AND status = 'in_progress'"
)
RELEASE = f"DELETE FROM {_TABLE} WHERE id = %s AND lease_token = %s AND status = 'in_progress'"


def _problem(status: int, code: str, **headers: str) -> HttpResponse:
    body = json.dumps({"type": "about:blank", "status": status, "code": code})
    response = HttpResponse(body, status=status, content_type="application/problem+json")
    for name, value in headers.items():
        response[name] = value
    return response


def _valid(key: str | None) -> bool:
    return bool(key) and len(key) <= 255 and all("!" <= c <= "~" for c in key)  # type: ignore[arg-type]


class _Release(Exception):
    pass


class _LeaseLost(Exception):
    pass


class FloorMixin:
    """The claim and the completion around a DRF viewset's ``create``, by hand."""

    def create(self, request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
        key = request.META.get("HTTP_IDEMPOTENCY_KEY")
        if not _valid(key):
            return _problem(400, "idempotency_key_invalid")
        params = {
            "account": str(request.user.pk),
            "operation": "charge.create",
            "key": key,
            "hash": hashlib.sha256(request.body).hexdigest(),
            "token": str(uuid.uuid4()),
        }
        with connection.cursor() as cursor:
            cursor.execute(CLAIM, params)
            row = cursor.fetchone()
        if row is None:  # a racing claim committed after this statement's snapshot
            return _problem(409, "idempotency_key_in_use", **{"Retry-After": "1"})
        record_id, claimed = row[0], row[1]
        if not claimed:
            if row[3] != params["hash"]:
                return _problem(422, "idempotency_key_reused")
            if row[2] == "in_progress":
                return _problem(409, "idempotency_key_in_use", **{"Retry-After": "1"})
            replay = HttpResponse(bytes(row[6]), status=row[4], content_type=row[5])
            replay["Idempotent-Replayed"] = "true"
            return replay
        view: Any = self
        try:
            with transaction.atomic():
                try:
                    response = super().create(request, *args, **kwargs)  # type: ignore[misc]
                except Exception as exc:
                    response = view.handle_exception(exc)
                response = view.finalize_response(request, response, *args, **kwargs)
                response.render()
                if response.status_code >= 500:
                    raise _Release
                with connection.cursor() as cursor:
                    cursor.execute(
                        COMPLETE,
                        [
                            response.status_code,
                            response.get("Content-Type", ""),
                            response.content,
                            record_id,
                            params["token"],
                        ],
                    )
                    if cursor.rowcount != 1:  # the lease was taken over: roll back
                        raise _LeaseLost
        except _LeaseLost:
            return _problem(409, "idempotency_lease_lost", **{"Retry-After": "1"})
        except _Release:
            with connection.cursor() as cursor:
                cursor.execute(RELEASE, [record_id, params["token"]])
            return response
        except BaseException:
            with connection.cursor() as cursor:
                cursor.execute(RELEASE, [record_id, params["token"]])
            raise
        result: HttpResponseBase = response
        return result
