"""The framework-neutral engine: claim, execute, complete or release, replay, recover.

The decorator, the DRF mixin and the Celery task decorator all call :func:`handle`. Each
adapter only says how to call the view and what the operation is called.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.utils import timezone
from django.utils.crypto import salted_hmac

from django_idempotency import conf, problems, signals, store
from django_idempotency.conf import app_settings
from django_idempotency.fingerprint import django_request, fingerprint_version
from django_idempotency.keys import InvalidKey, header_meta_name, parse_key
from django_idempotency.models import IdempotencyRecord

logger = logging.getLogger("django_idempotency")

REPLAYED_HEADER = "Idempotent-Replayed"
RETRY = "retry"
FAIL = "fail"

Recovery = str | Callable[[IdempotencyRecord], HttpResponseBase | None]
Resolver = Callable[[Any], str | None]
Fingerprint = Callable[[Any], str]


@dataclass(frozen=True)
class Options:
    """Per-view choices; ``None`` means "use the ``IDEMPOTENCY`` setting"."""

    operation: str | None = None
    required: bool | None = None
    ttl: timedelta | int | None = None
    lease: timedelta | int | None = None
    recovery: Recovery | None = None
    account: Resolver | str | None = None
    fingerprint: Fingerprint | str | None = None
    methods: tuple[str, ...] | None = None

    def protects(self, method: str | None) -> bool:
        allowed = (
            frozenset(m.upper() for m in self.methods) if self.methods else app_settings.METHODS
        )
        return (method or "").upper() in allowed


@dataclass
class IdempotencyContext:
    """``request.idempotency``: who and what this key belongs to, and whether it was replayed."""

    key: str
    operation: str
    account: str
    replayed: bool = False
    record_id: int | None = field(default=None, repr=False)

    def downstream_key(self, name: str) -> str:
        """A key for a provider call, the same on every retry, takeover and recovery run.

        A keyed hash (HMAC-SHA256 with ``SECRET_KEY``) of ``(account, operation, key, name)``:
        the client's raw key never reaches the provider, and two accounts never share one.
        """
        message = "\x1f".join((self.account, self.operation, self.key, name))
        return salted_hmac("django_idempotency.downstream", message, algorithm="sha256").hexdigest()


class _Discard(Exception):
    """Leaves the view's transaction with a rollback, carrying the response out."""

    def __init__(self, response: HttpResponseBase, keep: bool) -> None:
        self.response = response
        self.keep = keep


class _LeaseLost(Exception):
    """The fenced completion matched no row: another attempt owns the record now."""


_MAX_NAME = 255


def storable_name(name: str) -> str:
    """An account or operation as stored: itself, or ``sha256:<hex>`` when it is longer than
    the column or holds characters a database cannot store (NUL). Deterministic, so every
    retry maps to the same record."""
    if len(name) <= _MAX_NAME and "\x00" not in name:
        return name
    return "sha256:" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()


def context_of(request: Any) -> IdempotencyContext | None:
    """``request.idempotency``, typed: the context of a protected request, else ``None``.

    Works with a Django ``HttpRequest`` and a DRF ``Request`` alike.
    """
    context = getattr(django_request(request), "idempotency", None)
    return context if isinstance(context, IdempotencyContext) else None


def recovery_name(recovery: Recovery) -> str:
    """How a recovery policy is stored on the record, so the recovery job can apply it."""
    if isinstance(recovery, str):
        return recovery
    return f"{recovery.__module__}.{recovery.__qualname__}"


def resolve_recovery(recovery: Recovery) -> Recovery:
    """``"retry"``, ``"fail"``, or the callable a dotted path names."""
    if isinstance(recovery, str) and recovery not in (RETRY, FAIL):
        resolved: Recovery = conf.resolve_callable(recovery)
        return resolved
    return recovery


def _problem(problem: problems.Problem, detail: str, **extra: Any) -> HttpResponse:
    return problem.response(detail, **extra)


def _in_flight_detail(context: IdempotencyContext) -> str:
    return f"A request with key {context.key!r} for {context.operation} is still in progress."


def _with_atomic_requests(alias: str, call: Callable[[], HttpResponseBase]) -> HttpResponseBase:
    # Protected views are exempted from ATOMIC_REQUESTS so that the claim commits on its own;
    # requests that turn out not to be protected get the transaction the project asked for.
    if connections[alias].settings_dict.get("ATOMIC_REQUESTS"):
        with transaction.atomic(using=alias):
            return call()
    return call()


def handle(
    request: Any,
    call_view: Callable[[], HttpResponseBase],
    options: Options,
    default_operation: Callable[[], str],
) -> HttpResponseBase:
    """Run ``call_view`` at most once per ``(account, operation, key)`` and replay its outcome.

    ``request`` is a Django ``HttpRequest`` or a DRF ``Request``; ``call_view`` runs the view
    and returns its (possibly unrendered) response.
    """
    alias = app_settings.DATABASE
    inner = django_request(request)
    inner.idempotency = None  # type: ignore[attr-defined]
    if not options.protects(inner.method):
        return _with_atomic_requests(alias, call_view)
    header = app_settings.HEADER
    raw = inner.META.get(header_meta_name(header))
    if raw is None:
        required = app_settings.REQUIRED if options.required is None else options.required
        if required:
            return _problem(
                problems.KEY_MISSING, f"{inner.method} requests need the {header} header."
            )
        return _with_atomic_requests(alias, call_view)
    try:
        key = parse_key(raw)
    except InvalidKey as exc:
        return _problem(problems.KEY_INVALID, f"The {header} header is invalid: {exc}.")
    account = conf.resolve_callable(options.account or app_settings.ACCOUNT_RESOLVER)(request)
    if not account:
        return _problem(
            problems.ACCOUNT_MISSING,
            "This request carries an idempotency key but no authenticated caller to scope it to.",
        )
    context = IdempotencyContext(
        key=key,
        operation=storable_name(options.operation or default_operation()),
        account=storable_name(str(account)),
    )
    inner.idempotency = context  # type: ignore[attr-defined]
    return _Attempt(request, inner, context, options, alias).run(call_view)


class _Attempt:
    """One protected request, from the claim to its answer."""

    def __init__(
        self,
        request: Any,
        inner: HttpRequest,
        context: IdempotencyContext,
        options: Options,
        alias: str,
    ) -> None:
        self.request = request
        self.inner = inner
        self.context = context
        self.options = options
        self.alias = alias
        fingerprint = conf.resolve_callable(options.fingerprint or app_settings.FINGERPRINT)
        self.request_hash = fingerprint(request)
        self.version = fingerprint_version(fingerprint)
        self.recovery = options.recovery or app_settings.RECOVERY
        self.ttl = conf.as_timedelta(options.ttl) if options.ttl is not None else app_settings.TTL
        self.lease = (
            conf.as_timedelta(options.lease) if options.lease is not None else app_settings.LEASE
        )

    # -- signals -----------------------------------------------------------------------

    def _send(self, signal: Any, **extra: Any) -> None:
        signal.send(
            sender=IdempotencyRecord,
            request=self.request,
            account=self.context.account,
            operation=self.context.operation,
            key=self.context.key,
            **extra,
        )

    # -- the claim ---------------------------------------------------------------------

    def _claim(self) -> store.ClaimResult:
        return store.claim(
            self.alias,
            store.ClaimRequest(
                account=self.context.account,
                operation=self.context.operation,
                key=self.context.key,
                request_hash=self.request_hash,
                fingerprint_version=self.version,
                recovery_policy=recovery_name(self.recovery),
                now=timezone.now(),
                lease=self.lease,
                ttl=self.ttl,
            ),
        )

    def run(
        self, call_view: Callable[[], HttpResponseBase], allow_wait: bool = True
    ) -> HttpResponseBase:
        """Claim, then run the view, replay, or refuse; fail closed if the claim fails."""
        try:
            result = self._claim()
        except DatabaseError:
            logger.exception("idempotency store unavailable during the claim")
            return _problem(
                problems.STORE_UNAVAILABLE,
                "The request was not run because its idempotency key could not be recorded.",
                retry_after=app_settings.RETRY_AFTER,
            )
        if result.claimed:
            return self._owned(result, call_view)
        return self._existing(result.state, call_view, allow_wait=allow_wait)

    def _existing(
        self,
        state: store.RecordState,
        call_view: Callable[[], HttpResponseBase],
        allow_wait: bool,
    ) -> HttpResponseBase:
        if state.fingerprint_version == self.version and state.request_hash != self.request_hash:
            logger.debug("payload mismatch on record %s (%s)", state.id, self.context.operation)
            self._send(signals.payload_mismatched)
            return _problem(
                problems.KEY_REUSED,
                f"Key {self.context.key!r} was first used with a different request; "
                "use a new key for a new operation.",
            )
        if state.status != store.IN_PROGRESS:
            return self._replay(state)
        if allow_wait and app_settings.IN_PROGRESS_WAIT:
            waited = self._wait_for(state)
            if waited is not None:
                return waited
            # The record moved on: go through the claim once more, without waiting again.
            return self.run(call_view, allow_wait=False)
        self._send(signals.request_conflicted)
        return _problem(
            problems.KEY_IN_USE,
            _in_flight_detail(self.context),
            retry_after=app_settings.RETRY_AFTER,
        )

    def _wait_for(self, state: store.RecordState) -> HttpResponseBase | None:
        # Polls with short autocommit reads: no lock is held while waiting, and never longer
        # than IN_PROGRESS_WAIT. ``None``: the record is gone or its lease went stale.
        deadline = time.monotonic() + app_settings.IN_PROGRESS_WAIT.total_seconds()
        pause = 0.02
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 0.25)
            current = store.fetch(
                self.alias, self.context.account, self.context.operation, self.context.key
            )
            if current is None or current.id != state.id:
                return None
            if current.status != store.IN_PROGRESS:
                return self._replay(current)
            if current.lease_expires_at and current.lease_expires_at <= timezone.now():
                return None
        self._send(signals.request_conflicted)
        return _problem(
            problems.KEY_IN_USE,
            _in_flight_detail(self.context),
            retry_after=app_settings.RETRY_AFTER,
        )

    # -- the owner's path --------------------------------------------------------------

    def _owned(
        self, result: store.ClaimResult, call_view: Callable[[], HttpResponseBase]
    ) -> HttpResponseBase:
        state = result.state
        assert state.lease_token is not None
        self.context.record_id = state.id
        takeover = result.took_over_stale_lease
        self._send(signals.record_claimed, takeover=takeover)
        logger.debug("claimed record %s (%s)", state.id, self.context.operation)
        if takeover:
            logger.info(
                "took over the stale lease of record %s (%s, attempt %d)",
                state.id,
                self.context.operation,
                state.recovery_attempts,
            )
            recovered = self._recover(state)
            if recovered is not None:
                return recovered
        return self._execute(state.id, state.lease_token, call_view)

    def _recover(self, state: store.RecordState) -> HttpResponseBase | None:
        policy = resolve_recovery(self.recovery)
        assert state.lease_token is not None
        name = recovery_name(self.recovery)
        if policy == RETRY:
            self._recovered(name, "retried")
            return None
        if policy == FAIL:
            response = outcome_unknown_response(self.context.key, self.context.operation)
            if not self._finish(state.id, state.lease_token, response, store.FAILED):
                return self._lease_lost()
            self._recovered(name, "failed")
            return self._mark_replayed(response)
        assert callable(policy)
        record = IdempotencyRecord.objects.using(self.alias).get(pk=state.id)
        answer = policy(record)
        if answer is None:
            self._recovered(name, "retried")
            return None
        answer = _rendered(answer)
        if not is_storable(answer):
            # A 5xx (or a transient or unstorable answer) is no outcome to replay forever:
            # the client gets it, the claim is released, and the next retry asks again.
            self._release(state.id, state.lease_token)
            self._recovered(name, "released")
            return answer
        if not self._finish(state.id, state.lease_token, answer, store.COMPLETED):
            return self._lease_lost()
        self._recovered(name, "completed")
        return answer

    def _recovered(self, policy: str, outcome: str) -> None:
        logger.info(
            "recovery policy %s on record %s (%s): %s",
            policy,
            self.context.record_id,
            self.context.operation,
            outcome,
        )
        signals.lease_recovered.send(
            sender=IdempotencyRecord,
            account=self.context.account,
            operation=self.context.operation,
            key=self.context.key,
            policy=policy,
            outcome=outcome,
        )

    def _execute(
        self, record_id: int, token: Any, call_view: Callable[[], HttpResponseBase]
    ) -> HttpResponseBase:
        try:
            with transaction.atomic(using=self.alias):
                response = _rendered(call_view())
                storable = is_storable(response)
                if storable and not transaction.get_rollback(using=self.alias):
                    if not self._finish(record_id, token, response, store.COMPLETED):
                        raise _LeaseLost
                    return response
                # A 5xx, a transient status, a response too big to keep, or a view that
                # marked its own transaction for rollback: its database work is undone.
                raise _Discard(response, keep=storable)
        except _LeaseLost:
            return self._lease_lost()
        except _Discard as discard:
            return self._after_rollback(record_id, token, discard)
        except BaseException:
            self._release(record_id, token)
            raise

    def _after_rollback(self, record_id: int, token: Any, discard: _Discard) -> HttpResponseBase:
        response = discard.response
        if discard.keep:
            # The view rolled its own writes back (DRF does this for handled exceptions under
            # ATOMIC_REQUESTS): its answer is still the deterministic outcome of this request.
            if not self._finish(record_id, token, response, store.COMPLETED):
                return self._lease_lost()
            return response
        self._release(record_id, token)
        if (
            response.status_code < 500
            and response.status_code not in app_settings.TRANSIENT_STATUSES
        ):
            return _problem(
                problems.RESPONSE_NOT_STORABLE,
                "The response could not be kept for replay (streamed, or larger than "
                "MAX_RESPONSE_BYTES), so the request was rolled back.",
            )
        return response

    def _finish(self, record_id: int, token: Any, response: HttpResponseBase, status: str) -> bool:
        assert isinstance(response, HttpResponse)
        return store.finish(
            self.alias,
            record_id,
            token,
            status=status,
            response_status=response.status_code,
            response_headers=stored_headers(response),
            response_body=response.content,
            now=timezone.now(),
        )

    def _release(self, record_id: int, token: Any) -> None:
        try:
            store.release(self.alias, record_id, token)
        except DatabaseError:
            # The lease runs out on its own; the recovery policy takes it from there.
            logger.exception("could not release an idempotency claim; its lease will expire")

    def _lease_lost(self) -> HttpResponse:
        self._send(signals.lease_lost)
        logger.warning(
            "lease lost on record %s (%s); the attempt was rolled back",
            self.context.record_id,
            self.context.operation,
        )
        return _problem(
            problems.LEASE_LOST,
            "This attempt took longer than its lease and a newer attempt took over; "
            "its work was rolled back.",
            retry_after=app_settings.RETRY_AFTER,
        )

    # -- replay ------------------------------------------------------------------------

    def _replay(self, state: store.RecordState) -> HttpResponse:
        logger.debug("replaying record %s (%s)", state.id, self.context.operation)
        self.context.replayed = True
        self.context.record_id = state.id
        self._send(signals.response_replayed, status=state.response_status)
        return replay_response(state)

    @staticmethod
    def _mark_replayed(response: HttpResponse) -> HttpResponse:
        response[REPLAYED_HEADER] = "true"
        return response


def _rendered(response: HttpResponseBase) -> HttpResponseBase:
    render = getattr(response, "render", None)
    if callable(render) and not getattr(response, "is_rendered", True):
        render()
    return response


def is_storable(response: HttpResponseBase) -> bool:
    """Whether a response is a deterministic outcome that can be kept and replayed."""
    status = response.status_code
    if status >= 500 or status in app_settings.TRANSIENT_STATUSES:
        return False
    if not isinstance(response, HttpResponse):  # streaming and file responses
        return False
    limit = app_settings.MAX_RESPONSE_BYTES
    return limit is None or len(response.content) <= limit


def stored_headers(response: HttpResponseBase) -> list[list[str]]:
    """The headers kept with a response: ``Content-Type``, ``Location`` and the allow-list."""
    return [[name, response[name]] for name in app_settings.stored_headers if name in response]


def replay_response(state: store.RecordState) -> HttpResponse:
    """The stored outcome as a response: same status, same body bytes, same stored headers."""
    assert state.response_status is not None
    response = HttpResponse(state.response_body or b"", status=state.response_status)
    del response["Content-Type"]
    for name, value in state.response_headers:
        response[name] = value
    response[REPLAYED_HEADER] = "true"
    return response


def outcome_unknown_response(key: str, operation: str) -> HttpResponse:
    """The stored answer of a record that the ``"fail"`` recovery policy closed."""
    return _problem(
        problems.OUTCOME_UNKNOWN,
        f"The request with key {key!r} for {operation} stopped before it finished; whether it "
        "took effect is unknown and needs reconciliation. It will not be run again.",
    )


def route_operation(request: Any, fallback: Callable[..., Any]) -> str:
    """The default operation: the method and the URL pattern's route, e.g. ``POST orders/``.

    Without a resolved route (a view called directly) the view's dotted name stands in.
    """
    inner = django_request(request)
    match = inner.resolver_match
    where = (
        match.route
        if match is not None and match.route
        else (f"{fallback.__module__}.{fallback.__qualname__}")
    )
    return f"{inner.method} {where}"


class IdempotencyDatabase(set[str]):
    """A view's ``_non_atomic_requests``: always holds the idempotency database alias.

    Read at request time rather than at import, so ``override_settings`` of ``DATABASE`` works.
    """

    def __contains__(self, alias: object) -> bool:
        return alias == app_settings.DATABASE or super().__contains__(alias)
