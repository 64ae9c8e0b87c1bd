"""The HTTP side of the engine: one protected request, from its key to its answer.

The decorator calls :func:`handle`; the DRF mixin and the ninja decorator, which decide
once per request whether the method is protected, call :func:`protected` with their answer.
Each adapter only says how to call the view and what the operation is called. The claim, the fenced
execution and the recovery rule are the framework-neutral ones (:mod:`._claims`,
:mod:`._execution`, :mod:`._recovery`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
from collections.abc import Callable, Container
from typing import Any, TypeVar, cast

from asgiref.sync import sync_to_async
from django import db
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase

from django_idempotency import (
    _autonomous,
    _problems,
    _recovery,
    _routes,
    _store,
    _threads,
    conf,
    signals,
)
from django_idempotency._atomic_requests import atomic_requests, marks_of, with_atomic_requests
from django_idempotency._claims import Claim, LeaseLost, claim, retry_after, wait_for
from django_idempotency._context import IdempotencyContext, Operation, current, running
from django_idempotency._execution import run_owned
from django_idempotency._options import Options, Terms
from django_idempotency._outcomes import (
    REPLAYED_HEADER,
    outcome_of,
    refuse_unreadable,
    rendered,
    replay_response,
    response_of,
)
from django_idempotency._recovery import recovery_name, resolve_recovery
from django_idempotency._storable import remembered_names, storable_name
from django_idempotency._validation import FINGERPRINT_LENGTH, describe, fingerprint_text
from django_idempotency.conf import app_settings
from django_idempotency.crypto import Unreadable
from django_idempotency.exceptions import OutcomeTooLarge, RecordUnreadable, StoreUnavailable
from django_idempotency.keys import (
    BARE_KEY,
    InvalidKey,
    header_meta_name,
    parse_key,
    validate_key,
)
from django_idempotency.models import IdempotencyRecord
from django_idempotency.states import IN_PROGRESS

T = TypeVar("T")

logger = logging.getLogger("django_idempotency")


__all__ = [
    "handle",
    "protected",
    "route_operation",
    "run_to_the_end",
    "unprotected",
]


def _key_of(request: Any, inner: HttpRequest, options: Options) -> str | HttpResponse | None:
    """The request's key; ``None`` when it carries none; a problem answer when it is bad."""
    if options.key is None:
        header = app_settings.HEADER
        # META first: request.headers builds a mapping of every header on first use. Test
        # clients that build META themselves (ninja's) need not spell the WSGI name of the
        # header, so a miss asks request.headers.
        raw = inner.META.get(_meta_name(header))
        if raw is None:
            raw = inner.headers.get(header)
            if raw is None:
                return None
        if BARE_KEY.fullmatch(raw):
            return raw  # nearly every client's key: one match, no call of parse_key
        try:
            return parse_key(raw)
        except InvalidKey as exc:
            return _problems.KEY_INVALID.response(f"The {header} header is invalid: {exc}.")
    try:
        value = conf.resolve_callable(options.key)(request)
        return None if value is None else validate_key(value)
    except InvalidKey as exc:
        return _problems.KEY_INVALID.response(f"The request's idempotency key is invalid: {exc}.")


@functools.lru_cache(maxsize=8)
def _meta_name(header: str) -> str:
    return header_meta_name(header)


def handle(
    request: Any,
    call_view: Callable[[], HttpResponseBase],
    options: Options,
    default_operation: Callable[[], str],
    marks: Container[str] | None = None,
) -> HttpResponseBase:
    """Run ``call_view`` at most once per ``(account, operation, key)`` and replay its outcome.

    ``request`` is a Django ``HttpRequest`` or a DRF ``Request``; ``call_view`` runs the view
    and returns its (possibly unrendered) response. ``marks``: the view's
    ``_non_atomic_requests``, which a request the view does not protect keeps (those of the
    view function Django resolved the request to, where there is one).
    """
    terms = terms_of(options)
    inner = getattr(request, "_request", request)  # a DRF Request's HttpRequest
    method = inner.method  # Terms.protects, inline: no call on every request's path
    if method not in terms.methods and (method or "").upper() not in terms.methods:
        inner.idempotency = None
        return with_atomic_requests(terms.database, call_view, marks_of(inner, marks))
    return protected(request, call_view, options, terms, default_operation, marks)


def unprotected(request: Any) -> None:
    """Say that ``request`` reaches its view unprotected by this layer: its
    ``request.idempotency`` is ``None``, as :func:`handle` leaves it for a method the view
    does not protect, unless an outer layer of this package protects it (its context stays).
    For the DRF mixin and the ninja decorator, which decide that outside :func:`handle`."""
    inner = getattr(request, "_request", request)  # a DRF Request's HttpRequest
    if "idempotency" not in inner.__dict__:
        inner.idempotency = None


def failed_before_the_claim(request: Any, options: Options, error: db.Error) -> HttpResponse:
    """The answer to a request of a protected method whose framework (DRF's or django-ninja's
    authentication, permissions, throttles) failed on the database before the claim: the
    store's ``503``, saying nothing ran, as when naming the account fails (:func:`protected`).
    A request without a key where keys are optional would have run unprotected: its error is
    the framework's own, raised again."""
    inner = getattr(request, "_request", request)
    if _key_of(request, inner, options) is None and not (
        app_settings.REQUIRED if options.required is None else options.required
    ):
        raise error
    logger.error(
        "idempotency store unavailable while the framework checked a protected request",
        exc_info=error,
    )
    return _store_unavailable(ran=False)


def terms_of(options: Options) -> Terms:
    """The view's terms as ``Options.terms()`` last worked them out, while the settings are
    the same (as the DRF mixin reads them): no call per request."""
    cached = options.cached_terms
    if cached is not None and cached[0] is app_settings.loaded():
        return cached[1]
    return options.terms()


def passes_by(request: HttpRequest, options: Options, marks: Container[str] | None) -> bool:
    """Whether an ``async def`` view's ``request`` is one :func:`handle` would only hand to
    the view: a method the view does not protect, with no ``ATOMIC_REQUESTS`` transaction
    to open for it (``marks``: the view's ``_non_atomic_requests``). Its ``idempotency`` is
    then ``None``, and the caller awaits the view on the event loop as it stands, with no
    hop into the engine's thread and back."""
    terms = terms_of(options)
    if terms.protects(request.method):
        return False
    if atomic_requests(terms.database, marks_of(request, marks)):
        return False  # the engine opens that transaction, in its thread (handle)
    request.idempotency = None  # type: ignore[attr-defined]
    return True


def protected(
    request: Any,
    call_view: Callable[[], HttpResponseBase],
    options: Options,
    terms: Terms,
    operation: str | Callable[[], str],
    marks: Container[str] | None = None,
) -> HttpResponseBase:
    """:func:`handle` for a request whose method its caller found protected (under
    ``terms``, the view's options with the settings filled in): the DRF mixin decides that
    once per request, before DRF's authentication, and a ninja operation before ninja's.
    ``operation``: the operation's name, or what names it when the view's options do not.
    ``marks``: as for :func:`handle`, kept by a request without a key where keys are
    optional (no claim: the view runs as undecorated)."""
    inner = getattr(request, "_request", request)
    # An outer layer of this package already protecting this request (the mixin with the
    # decorator on its handler, the decorator on dispatch and on the handler): its context.
    outer = inner.__dict__.get("idempotency")
    inner.idempotency = None
    key = _key_of(request, inner, options)
    if key is None:
        if app_settings.REQUIRED if options.required is None else options.required:
            where = (
                app_settings.HEADER
                if options.key is None
                else getattr(options.key, "description", "idempotency key")
            )
            return _problems.KEY_MISSING.response(f"{inner.method} requests need the {where}.")
        return with_atomic_requests(terms.database, call_view, marks_of(inner, marks))
    if isinstance(key, HttpResponse):
        return key
    try:
        account = terms.account(request)
    except db.Error:
        # Naming the caller read the database (the default resolver loads the session's
        # user from it): it failed as the claim would have. Nothing ran.
        logger.exception("idempotency store unavailable while naming the caller's account")
        return _store_unavailable(ran=False)
    if account is None or account == "":
        return _problems.ACCOUNT_MISSING.response(
            "This request carries an idempotency key but no authenticated caller to scope it to."
        )
    if not isinstance(account, str):
        # Never coerced: str() of an object could name another caller's account.
        logger.error("the account resolver answered %s, not a string", type(account).__name__)
        return _problems.ACCOUNT_INVALID.response(
            "The server could not name the caller this key belongs to; nothing was run."
        )
    name = options.operation or (operation if isinstance(operation, str) else operation())
    stored_account, stored_operation, legacy = remembered_names(account, name)
    if (
        isinstance(outer, IdempotencyContext)
        and outer is current()
        and (outer.key, outer.operation, outer.account) == (key, stored_operation, stored_account)
    ):
        # The outer layer holds this very record for this request and runs this call inside
        # its claim and transaction: claiming it again would meet that claim (409 on every
        # request). The call is protected already.
        inner.idempotency = outer
        return call_view()
    if legacy is None and options.operation is None:
        legacy = _route_spelling(inner, stored_account, stored_operation)
    context = IdempotencyContext(key=key, operation=stored_operation, account=stored_account)
    inner.idempotency = context
    try:
        guarded = _Protected.of(request, context, terms, legacy)
    except _Unfingerprinted as exc:
        logger.error("%s: %s", stored_operation, exc)
        return _problems.FINGERPRINT_INVALID.response(
            "The server could not fingerprint this request; nothing was run."
        )
    return guarded.answer(call_view)


def _store_unavailable(ran: bool) -> HttpResponse:
    """``503 idempotency_store_unavailable``, saying whether the view ran."""
    return _problems.STORE_UNAVAILABLE.response(
        _problems.store_unavailable_detail(ran), retry_after=app_settings.RETRY_AFTER
    )


class _Unfingerprinted(Exception):
    """The fingerprint answered what a record cannot hold: nothing ran, and nothing was
    claimed (stored as text, a number would compare unequal to itself on every retry)."""


def _hash_of(request: Any, terms: Terms) -> str:
    """The request's fingerprint, as the record stores it: text of at most 64 characters
    (a SHA-256's hex digits), without a NUL or a lone surrogate."""
    answer = terms.fingerprint(request)
    if (
        answer.__class__ is str
        and len(answer) <= FINGERPRINT_LENGTH
        and answer.isascii()
        and "\x00" not in answer
    ):
        return answer  # the usual answer, a hex digest: checked here, on every request
    request_hash = fingerprint_text(answer)
    if request_hash is None:
        raise _Unfingerprinted(
            f"the fingerprint {terms.fingerprint_version} answered {describe(answer)}, not "
            f"text of at most {FINGERPRINT_LENGTH} characters without a NUL or a lone "
            "surrogate (IDEMPOTENCY['FINGERPRINT'] or the view's fingerprint=)"
        )
    return request_hash


class _Protected:
    """One protected request: what it claims, and its answer for each state of the record."""

    __slots__ = ("context", "operation", "recovery", "request")

    def __init__(
        self, request: Any, context: IdempotencyContext, operation: Operation, recovery: Any
    ) -> None:
        self.request = request
        self.context = context
        self.operation = operation
        self.recovery = recovery

    @classmethod
    def of(
        cls,
        request: Any,
        context: IdempotencyContext,
        terms: Terms,
        legacy: tuple[str, ...] | None = None,
    ) -> _Protected:
        request_hash = _hash_of(request, terms)
        if legacy is not None and legacy[1] != context.operation:
            # The earlier release's fingerprint read its spelling of the operation.
            legacy = (*legacy, _hashed_as(request, context, legacy[1], terms))
        operation = Operation(
            terms.database,
            context.account,
            context.operation,
            context.key,
            request_hash,
            terms.fingerprint_version,
            terms.recovery_name,
            terms.lease,
            terms.ttl,
            legacy,
        )
        return cls(request, context, operation, terms.recovery)

    def send(self, signal: Any, **extra: Any) -> None:
        # Building the arguments costs more than a signal nobody listens to (a receiver for
        # another sender only: send() finds it does not apply).
        if signal.receivers:
            signal.send(
                sender=IdempotencyRecord,
                request=self.request,
                account=self.context.account,
                operation=self.context.operation,
                key=self.context.key,
                **extra,
            )

    def answer(
        self, call_view: Callable[[], HttpResponseBase], allow_wait: bool = True
    ) -> HttpResponseBase:
        """Claim, then run the view, replay, or refuse; fail closed if the claim fails."""
        try:
            result, owned = claim(self.operation)
        except db.Error:  # any error of the database's, InterfaceError included
            logger.exception("idempotency store unavailable during the claim")
            _autonomous.discard_broken(self.operation.alias)  # the next request connects afresh
            return self.store_unavailable(ran=False)
        if owned is not None:
            return _Owner(self, result, owned).run(call_view)
        return self.existing(result.state, call_view, allow_wait)

    def existing(
        self, state: _store.RecordState, call_view: Callable[[], HttpResponseBase], allow_wait: bool
    ) -> HttpResponseBase:
        """The answer when another attempt's record is in the way."""
        if (
            state.fingerprint_version == self.operation.fingerprint_version
            and state.request_hash != self.operation.request_hash
        ):
            logger.debug("payload mismatch on record %s (%s)", state.id, self.context.operation)
            self.send(signals.payload_mismatched)
            return _problems.KEY_REUSED.response(
                f"Key {self.context.key!r} was first used with a different request; "
                "use a new key for a new operation."
            )
        if state.status != IN_PROGRESS:
            return self.done(state)
        if allow_wait and app_settings.IN_PROGRESS_WAIT:
            waited = self.wait_for(state)
            if waited is not None:
                return waited
            # The record moved on: go through the claim once more, without waiting again.
            return self.answer(call_view, allow_wait=False)
        return self.conflict(state)

    def store_unavailable(self, ran: bool) -> HttpResponse:
        return _store_unavailable(ran)

    def conflict(self, state: _store.RecordState) -> HttpResponse:
        self.send(signals.request_conflicted)
        return _problems.KEY_IN_USE.response(
            f"A request with key {self.context.key!r} for {self.context.operation} is still "
            "in progress.",
            retry_after=retry_after(state.lease_expires_at),
        )

    def wait_for(self, state: _store.RecordState) -> HttpResponseBase | None:
        """Wait (``IN_PROGRESS_WAIT`` at most, see :func:`._claims.wait_for`) for the
        original to finish. ``None``: the record is gone or its lease went stale."""
        try:
            found = wait_for(self.operation, state, app_settings.IN_PROGRESS_WAIT)
        except db.Error:
            logger.exception("idempotency store unavailable while waiting for a record")
            return self.store_unavailable(ran=False)
        if found is None:
            return None
        if found.status != IN_PROGRESS:
            return self.done(found)
        return self.conflict(found)

    def done(self, state: _store.RecordState) -> HttpResponse:
        """The answer of a completed or failed record: its replay, or a refusal when its
        stored outcome cannot be read back (never a second run within its TTL)."""
        if state.unreadable is not None:
            self.context.record_id = state.id
            return self.unreadable(state.unreadable)
        return self.replay(state)

    def unreadable(self, problem: Unreadable | RecordUnreadable) -> HttpResponse:
        if not isinstance(problem, RecordUnreadable):  # one raised was logged already
            refuse_unreadable(self.context, problem, self.request)
        # Why it cannot be read (the key id, ENCRYPTION_KEYS) is for the log, the signal
        # and `check` (refuse_unreadable, check E026): the client learns what it can do.
        return _problems.RECORD_UNREADABLE.response(
            _problems.UNREADABLE, retry_after=app_settings.RETRY_AFTER
        )

    def replay(self, state: _store.RecordState) -> HttpResponse:
        logger.debug("replaying record %s (%s)", state.id, self.context.operation)
        self.context.replayed = True
        self.context.record_id = state.id
        self.send(signals.response_replayed, status=state.response_status)
        return replay_response(state)

    def lease_lost(self) -> HttpResponse:
        self.send(signals.lease_lost)
        logger.warning(
            "lease lost on record %s (%s); the attempt was rolled back",
            self.context.record_id,
            self.context.operation,
        )
        return _problems.LEASE_LOST.response(
            "This attempt took longer than its lease and a newer attempt took over; "
            "its work was rolled back.",
            retry_after=app_settings.RETRY_AFTER,
        )


class _Owner:
    """The attempt that holds the lease: recovers a stale predecessor, runs the view fenced."""

    def __init__(self, protected: _Protected, result: _store.ClaimResult, owned: Claim) -> None:
        self.protected = protected
        self.state = result.state
        self.takeover = result.took_over_stale_lease
        self.claim = owned
        protected.context.record_id = self.state.id

    def run(self, call_view: Callable[[], HttpResponseBase]) -> HttpResponseBase:
        context = self.protected.context
        try:
            self.protected.send(signals.record_claimed, takeover=self.takeover)
        except BaseException:
            self.freed_unrun()
            raise
        logger.debug("claimed record %s (%s)", self.state.id, context.operation)
        if self.takeover:
            logger.info(
                "took over the stale lease of record %s (%s, attempt %d)",
                self.state.id,
                context.operation,
                self.state.recovery_attempts,
            )
            recovered = self.recover()
            if recovered is not None:
                return recovered
        return self.execute(call_view)

    def freed_unrun(self) -> None:
        """A ``record_claimed`` receiver raised: the view never ran under this claim. A new
        claim is released (the retry runs at once); a takeover's lease is given back, the
        record kept for its recovery policy, since the crashed attempt before it may have
        run. The receiver's error goes on; one freeing the claim is logged."""
        try:
            if self.takeover:
                self.claim.give_back()
            else:
                self.claim.release()
        except Exception:
            logger.exception(
                "record %s (%s): a record_claimed receiver raised, and the claim could not "
                "be freed; it waits for its lease",
                self.state.id,
                self.protected.context.operation,
            )

    def recover(self) -> HttpResponseBase | None:
        """The recovery policy's answer, or ``None`` to run the view."""
        context = self.protected.context
        claimed_under = self.state.recovery_policy
        runs_under = self.protected.operation.recovery_policy
        try:
            # The policy the crashed attempt was claimed under has its say (a deploy may
            # have changed the view's since).
            policy = _recovery.deciding(claimed_under, self.protected.recovery)
            recovered = _recovery.recover(
                self.claim,
                resolve_recovery(policy),
                account=context.account,
                key=context.key,
                operation=context.operation,
                as_outcome=outcome_of,
                runs_under=runs_under if claimed_under not in (None, runs_under) else None,
            )
        except StoreUnavailable:
            self.claim.give_back()
            return self.protected.store_unavailable(ran=False)
        except OutcomeTooLarge as refused:
            # The policy's answer, larger than the database takes in one statement: never
            # stored, and the view not run; the next retry asks the policy again.
            self.claim.give_back()
            logger.error("%s: the recovery policy's answer: %s", context.operation, refused)
            return _not_storable()
        except Exception:
            # The policy could not decide: the lease is given back, so the next retry asks
            # again at once rather than after a whole new lease.
            self.claim.give_back()
            raise
        name = recovery_name(policy)
        match recovered:
            case _recovery.Lost():
                return self.protected.lease_lost()
            case _recovery.Run():
                # Under "resume" the view runs again to resume after its recorded steps.
                _recovery.announce(context, context.record_id, name, recovered.name)
                return None
            case _recovery.Undecided(answer=answer):
                # A 5xx (or a transient or unstorable answer) is no outcome to replay
                # forever, and no decision either (the provider could not be asked): the
                # client gets it, and the lease is given back, so the next retry asks the
                # policy again, as run_once does. Released, the next retry would run the
                # view (its external call) again without asking.
                self.claim.give_back()
                undecided: HttpResponseBase = answer
                return undecided
            case _recovery.Closed(outcome=outcome, answer=answer):
                _recovery.announce(context, context.record_id, name, recovered.name)
                if answer is None:  # "fail": the outcome unknown, replayed from now on
                    response = response_of(outcome)
                    response[REPLAYED_HEADER] = "true"
                    return response
                return rendered(answer)

    def execute(self, call_view: Callable[[], HttpResponseBase]) -> HttpResponseBase:
        """The view, its rendering and the completion, in one transaction (under
        ``"resume"``: the view's steps, each in its own, then the completion)."""
        try:
            with running(self.protected.context):
                fenced = run_owned(
                    self.protected.recovery,
                    self.claim,
                    # outcome_of renders the response (in the transaction, before the
                    # completion): the view's own callable is the body, wrapped in nothing.
                    call_view,
                    outcome_of,
                    fresh=not self.takeover,
                )
        except LeaseLost:
            return self.protected.lease_lost()
        except RecordUnreadable as refusal:
            # A recorded step (or an operation the view ran) whose outcome cannot be read
            # back: nothing ran again, and the record is kept for the next attempt.
            return self.protected.unreadable(refusal)
        except StoreUnavailable as failure:
            # The completion (or a step's record) could not be written: the work was rolled
            # back, and the claim released (under "retry") or its lease given back.
            logger.error("idempotency store failed after the view was claimed: %s", failure)
            return self.protected.store_unavailable(ran=failure.ran)
        except OutcomeTooLarge as refused:
            # Larger than the database takes in one statement: rolled back and released
            # before anything was sent, as a response over MAX_RESPONSE_BYTES is.
            logger.error("%s: %s", self.protected.context.operation, refused)
            return _not_storable()
        response: HttpResponseBase = fenced.result
        if fenced.stored:
            return response
        if (
            response.status_code < 500
            and response.status_code not in app_settings.TRANSIENT_STATUSES
        ):
            return _not_storable()
        return response


def _not_storable() -> HttpResponse:
    return _problems.RESPONSE_NOT_STORABLE.response(
        "The response could not be kept for replay (streamed, larger than the server "
        "keeps, or a header it cannot store), so the request was rolled back."
    )


async def run_to_the_end(run: Callable[[], T], *, own_thread: bool = False) -> T:
    """Run the (synchronous) engine for an ``async def`` view or tool, to its end whatever
    happens to its caller.

    The engine runs in the request's thread-sensitive thread: the claim, the view's
    transaction and the completion share one connection, and the async view runs back on
    the event loop from there. ``own_thread``: on a thread of its own instead, for the
    attempts no request's thread serves (an ``async def`` tool's call, an ``async def``
    task's delivery): one of the loop's engine threads (``_threads``), never one of the
    event loop's default executor. When the client disconnects, Django cancels the view's
    task; the attempt is shielded from that cancellation and goes on as a sync view would,
    so its outcome is stored and the client's retry gets it replayed. Were the attempt
    cancelled all the same (a server shutting down), the engine keeps the claim as a killed
    process would (``_claims.CRASHES``): never a silent release, and never a second run that
    the recovery policy did not choose.
    """
    if not own_thread:
        attempt = asyncio.ensure_future(sync_to_async(run)())
        return await _to_the_end(attempt)
    threads = cast(concurrent.futures.ThreadPoolExecutor, await _threads.of_the_running_loop())
    attempt = asyncio.ensure_future(sync_to_async(run, thread_sensitive=False, executor=threads)())
    return await _to_the_end(attempt)


async def _to_the_end(attempt: asyncio.Future[T]) -> T:
    try:
        return await asyncio.shield(attempt)
    except asyncio.CancelledError:
        if not attempt.done():
            logger.info(
                "the client of a protected async call went away; the attempt goes on to "
                "its end and its outcome is stored"
            )
            attempt.add_done_callback(_ended_unseen)
        raise


def _ended_unseen(attempt: asyncio.Future[Any]) -> None:
    # Nobody awaits a shielded attempt whose caller was cancelled: say how it ended.
    if not attempt.cancelled() and attempt.exception() is not None:
        logger.error(
            "a protected async call whose client went away failed",
            exc_info=attempt.exception(),
        )


def _hashed_as(request: Any, context: IdempotencyContext, operation: str, terms: Terms) -> str:
    """The request's fingerprint as a release that named its operation ``operation`` made
    it."""
    inner = getattr(request, "_request", request)  # a DRF Request's HttpRequest
    inner.idempotency = dataclasses.replace(context, operation=operation)
    try:
        return str(terms.fingerprint(request))
    finally:
        inner.idempotency = context


def _route_spelling(inner: Any, account: str, operation: str) -> tuple[str, str] | None:
    """How an earlier release named the operation of a request that took another spelling
    of its endpoint's route, where this release names it by the one spelling
    (``_routes.canonical_route``): DRF's format suffix (0.2.0: ``POST transfers<drf_format_
    suffix:format>``, now ``POST transfers/``), or a language's prefix of ``i18n_patterns``
    (``POST fr/charges/``, now ``POST en/charges/``), or a view's second spelling with or
    without its trailing slash (``POST orders``, now ``POST orders/``). The claim adopts a
    record written so (``_store.adopt_legacy``), and a retry after the upgrade finds it
    within its TTL. ``None`` for every other request."""
    match = inner.resolver_match
    route = match.route if match is not None else None
    if not route:
        return None
    canonical = _routes.canonical_route(route, getattr(inner, "urlconf", None), match.func)
    if canonical == route or operation != storable_name(f"{inner.method} {canonical}"):
        return None  # not a twin, or the operation is not the route's (a viewset's)
    return account, storable_name(f"{inner.method} {route}")


def route_operation(request: Any, fallback: Callable[..., Any]) -> str:
    """The default operation: the method and the URL pattern's route, e.g. ``POST orders/``.

    DRF's format-suffix spelling of a pattern (``orders.json``) is named by the plain
    pattern's route, a view written with and without its trailing slash by the spelling
    listed first: one endpoint, one operation. Without a resolved route (a view called
    directly) the view's dotted name stands in.
    """
    inner = getattr(request, "_request", request)  # a DRF Request's HttpRequest
    match = inner.resolver_match
    where = (
        # DRF's format suffix (``charges.json``) is the same endpoint as ``charges/``.
        _routes.canonical_route(match.route, getattr(inner, "urlconf", None), match.func)
        if match is not None and match.route
        else (f"{fallback.__module__}.{fallback.__qualname__}")
    )
    return f"{inner.method} {where}"
