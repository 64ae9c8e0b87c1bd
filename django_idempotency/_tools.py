"""Agents' tool calls, whatever framework serves the tool: the one adapter contract.

An MCP framework (the SDK's ``MCPServer``, FastMCP, the next one) differs from another in
a few places only: how the call's ``Context`` and ``_meta`` reach the tool, who the
authenticated caller is, how a return value becomes the framework's result, and how that
result is stored and built again. A framework's module says those in a :class:`Framework`;
everything else lives here, once: where the key comes from, the account, the fingerprint,
the refusals and their codes, the replay flag, the bridge for ``async def`` tools, the
order check's message and the warning about a lease shorter than a call.

A new framework is one small module: a ``Framework`` (named ``FRAMEWORK`` there) and its
``idempotent_tool``, which calls :func:`protector`; and its line in :data:`ADAPTERS`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import copy
import decimal
import functools
import importlib
import inspect
import itertools
import json
import logging
import math
import sys
import time
import types
import typing
import uuid
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Annotated, Any, Generic, TypeVar, cast

from asgiref.sync import async_to_sync
from django import db
from django.core.exceptions import ImproperlyConfigured

from django_idempotency import _autonomous, _http, _options, _problems, _threads, _validation
from django_idempotency._once import LeaseTakenOver, call_once, stored_result
from django_idempotency._outcomes import Outcome
from django_idempotency.conf import app_settings
from django_idempotency.exceptions import (
    InProgress,
    KeyReused,
    OutcomeTooLarge,
    OutcomeUnknown,
    RecordUnreadable,
    StoreUnavailable,
)
from django_idempotency.keys import InvalidKey

__all__ = [
    "ADAPTERS",
    "KEY_ARGUMENT",
    "KEY_DESCRIPTION",
    "META_KEY",
    "REPLAYED_META",
    "Framework",
    "canonical",
    "other_frameworks",
    "principal_of",
    "protector",
]

logger = logging.getLogger("django_idempotency")

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")
D = TypeVar("D", bound=Callable[..., Any])

#: The tool argument that carries the key, when the tool declares it.
KEY_ARGUMENT = "idempotency_key"
#: How that argument is described in the tool's input schema (unless the tool says more).
KEY_DESCRIPTION = "The same value on every retry of this action"
#: Where a host puts the key in the call's ``_meta`` when the tool has no key argument.
META_KEY = "idempotencyKey"
#: The ``_meta`` flag of a replayed result.
REPLAYED_META = "idempotentReplayed"


class _Unnamed:
    """An account callable's answer that names no account (not a string): the project's
    defect, refused as ``idempotency_account_invalid``."""


_UNNAMED = _Unnamed()


class Framework(Generic[R]):
    """What the adapter needs of one tool framework; ``R`` is its result type.

    Each member is the checklist of a new framework: the defaults here are for a framework
    that hands the adapter nothing of its own (no context, no token, no ``_meta``). Every
    tool gets a shallow copy of the object its decorator was made with, so a member may keep
    what it learns of its tool (``signature``, ``bind``) on ``self``.
    """

    #: How the framework is named in messages ("MCPServer", "FastMCP").
    name = "the tool framework"

    def refuse_registered(self, func: Callable[..., Any], where: str, own: bool = True) -> None:
        """Raise ``ImproperlyConfigured`` (with :func:`misplaced`'s words) when ``func`` is
        registered with a server already: the decorator is above the server's. ``own``:
        ``False`` when the decorator is another framework's adapter, which asks this one
        whether a server of its holds ``func`` (see :data:`ADAPTERS`), and nothing else."""

    def signature(
        self, func: Callable[..., Any], signature: inspect.Signature
    ) -> inspect.Signature:
        """The signature the framework reads, from the tool's own (key described): a
        parameter the framework fills with the call's context can be added here."""
        return signature

    def bind(self, tool: Callable[..., Any]) -> None:
        """The protected tool, as the framework will register it (beneath its decorator)."""

    def tool_name(self, context: Any) -> str | None:
        """The name the tool was registered under, where the framework tells it (a
        ``name=`` given to its decorator): the default operation is ``tool:<that name>``, so
        that two tools made of one function (a factory) are two operations."""
        return None

    def split(self, arguments: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The call's context, and the arguments the tool's body takes."""
        return None, arguments

    def injected(self, func: Callable[..., Any]) -> frozenset[str]:
        """The parameters of ``func`` the framework fills itself (its context, its
        dependencies): the tool gets them, the fingerprint leaves them out, for they are
        not the caller's arguments (a fresh object on every call would make every retry
        another call)."""
        return frozenset()

    def meta(self, context: Any) -> Mapping[str, Any] | None:
        """The call's ``_meta``."""
        return None

    def principal(self, context: Any) -> str | None:
        """The default account: the call's authenticated principal (see
        :func:`principal_of`)."""
        return None

    def converter(self, func: Callable[..., Any]) -> Callable[[Any, Any], R]:
        """How the framework turns ``func``'s return value into its result: called with the
        call's context (the registration the call reached may decide) and the value."""
        raise NotImplementedError

    def sent(self, result: R) -> Any:
        """``result`` as the MCP ``CallToolResult`` the framework sends for it."""
        raise NotImplementedError

    def received(self, result: Any) -> R:
        """An MCP ``CallToolResult`` as the framework's result."""
        raise NotImplementedError

    def asks(self, value: Any) -> bool:
        """Whether the tool's return value asks the client for input, and is no outcome of
        the call: MCP's multi-round flow (protocol 2026-07-28), where a body answers a round
        with an ``InputRequiredResult`` and the client calls again with its answers; that
        round, under the same key, is the one that acts. The value goes to the framework
        as the body gave it (each makes its own answer of it), and nothing is stored."""
        from mcp_types import InputRequiredResult

        return isinstance(value, InputRequiredResult)

    # Made of the two above: every MCP framework's result is a pydantic model with the
    # protocol's fields and ``meta``.

    def dump(self, result: R) -> dict[str, Any]:
        """The result as the ``CallToolResult`` JSON that is stored."""
        return cast(
            "dict[str, Any]",
            self.sent(result).model_dump(mode="json", by_alias=True, exclude_none=True),
        )

    def load(self, stored: dict[str, Any]) -> R:
        """A stored ``CallToolResult`` JSON as the framework's result (``ValueError`` when
        it is not one)."""
        from mcp_types import CallToolResult
        from pydantic import ValidationError

        try:
            return self.received(CallToolResult.model_validate(stored))
        except ValidationError as exc:
            raise ValueError(f"the stored tool result is not one: {exc}") from None

    def refusal(self, text: str, structured: dict[str, Any]) -> R:
        """An error result (``isError``) with that text and structured content."""
        from mcp_types import CallToolResult, TextContent

        return self.received(
            CallToolResult(
                content=[TextContent(type="text", text=text)],
                structured_content=structured,
                is_error=True,
            )
        )

    def with_meta(self, result: R, meta: dict[str, Any]) -> R:
        """``result`` with its ``_meta`` replaced."""
        return cast(R, result.model_copy(update={"meta": meta}))  # type: ignore[attr-defined]

    def meta_of(self, result: R) -> Mapping[str, Any] | None:
        """``result``'s ``_meta``."""
        return cast("Mapping[str, Any] | None", result.meta)  # type: ignore[attr-defined]

    def answer(self, context: Any, result: R) -> Any:
        """What the protected tool returns for ``result`` in a call with ``context``."""
        return result


def principal_of(token: Any) -> str | None:
    """The account an access token names: its subject qualified by its issuer (the ``iss``
    claim) where it has one, ``mcp:sub:["<issuer>","<subject>"]``; a token without a subject
    names its OAuth client, ``mcp:client:<client_id>``; no token, or neither, no account.
    The same token names the same account whichever framework serves the tool."""
    if token is None:
        return None
    if token.subject:
        issuer = (token.claims or {}).get("iss")
        named = json.dumps([None if issuer is None else str(issuer), token.subject])
        return f"mcp:sub:{named}"
    return f"mcp:client:{token.client_id}" if token.client_id else None


def misplaced(
    where: str, server: str, func: Callable[..., Any], beneath: str
) -> ImproperlyConfigured:
    """The order check's refusal: ``@idempotent_tool`` above the server's registration
    ``server``; ``beneath`` is where it goes."""
    return ImproperlyConfigured(
        f"@idempotent_tool at {where} is above {server}, which registered "
        f"{func.__name__} unprotected: put @idempotent_tool beneath {beneath}"
    )


#: The adapter module of each framework, by the module its servers come from; a new
#: framework adds its line. The order check asks every framework loaded in the process
#: whether one of its servers holds the function already, whichever adapter decorates it:
#: the SDK's adapter above FastMCP's ``@server.tool`` leaves FastMCP the bare function as
#: surely as FastMCP's own adapter there would. Each adapter module names its
#: :class:`Framework` ``FRAMEWORK``.
ADAPTERS = {
    "mcp.server.mcpserver": "django_idempotency.mcp",
    "fastmcp": "django_idempotency.fastmcp",
}


def other_frameworks(framework: Framework[Any]) -> list[tuple[str, Framework[Any]]]:
    """The adapter module and a :class:`Framework` of every framework loaded in the process
    but ``framework``'s, for the order check."""
    found: list[tuple[str, Framework[Any]]] = []
    for served, adapter in ADAPTERS.items():
        if served not in sys.modules:
            continue  # not loaded: it serves nothing
        try:
            module = importlib.import_module(adapter)
        except ImportError:  # a release of the framework its adapter does not support
            continue
        kind = getattr(module, "FRAMEWORK", None)
        if isinstance(kind, type) and not isinstance(framework, kind):
            found.append((adapter, kind()))
    return found


#: How many items of a list, tuple or set the order check looks at for a server.
_ITEMS_SEARCHED = 100

S = TypeVar("S")


def servers_in_sight(func: Callable[..., Any], kind: type[S]) -> list[S]:
    """The servers of type ``kind`` that the order check of ``@idempotent_tool`` applied to
    ``func`` sees: among the globals of ``func``'s module and the locals of the scope the
    decorator is applied in, and one step into each: an attribute of an object, of a module
    or of a class (``@registry.server.tool()``, ``@servers.shop.tool()``,
    ``@Servers.shop.tool()``), a value of a ``dict`` (``@SERVERS["shop"].tool()``) or one of
    the first items of a list, tuple or set (``@SERVERS[0].tool()``). Called from a
    framework's ``refuse_registered``, beneath :func:`protector`'s ``decorate``."""
    module = inspect.getmodule(func)
    values = list(vars(module).values()) if module is not None else []
    frame = inspect.currentframe()
    applying = frame
    for _ in range(3):  # refuse_registered, protector's decorate, the scope applying it
        applying = applying.f_back if applying is not None else None
    if applying is not None:
        values += list(applying.f_locals.values())
    del frame, applying
    found = []
    for value in values:
        if isinstance(value, kind):
            found.append(value)
            continue
        if isinstance(value, dict):
            inside = list(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            # A registry of servers is short: a long list of data is not searched to its end.
            inside = list(itertools.islice(value, _ITEMS_SEARCHED))
        elif isinstance(value, type):
            inside = list(vars(value).values())
        else:
            attributes = getattr(value, "__dict__", None)
            inside = list(attributes.values()) if isinstance(attributes, dict) else []
        found += [v for v in inside if isinstance(v, kind)]
    return found


#: What ``idempotent_tool`` is given positionally when it is written with its parentheses.
NOTHING: Any = object()


def keyword_options_only(decorator: D) -> D:
    """``decorator`` (an adapter's ``idempotent_tool``) shown as the design writes it,
    ``(*, account=None, ...)``: its positional parameter only catches the decorator
    written without its parentheses (:func:`protector`), and is no option to pass."""
    signature = inspect.signature(decorator)
    decorator.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[
            parameter
            for parameter in signature.parameters.values()
            if parameter.kind is not inspect.Parameter.POSITIONAL_ONLY
        ]
    )
    return decorator


def protector(
    framework: Framework[Any],
    options: Mapping[str, Any],
    where: str,
    accepted: frozenset[str],
    misplaced: object = NOTHING,
) -> Callable[[F], F]:
    """The decorator ``@idempotent_tool(**options)`` of ``framework``, its options checked
    here (``ImproperlyConfigured`` at ``where``, before any call). Each tool it decorates
    gets a shallow copy of ``framework``, which may keep that tool's state on itself.
    ``misplaced``: what ``idempotent_tool`` was given positionally (its options are
    keywords): the tool's function itself, when it is written without its parentheses."""
    if misplaced is not NOTHING:
        name = getattr(misplaced, "__qualname__", None)
        given = f"{name}" if callable(misplaced) and name else _validation.describe(misplaced)
        raise ImproperlyConfigured(
            f"@idempotent_tool needs its parentheses: write @idempotent_tool() at {where} "
            f"(it was given {given} as an option), beneath the server's @tool"
        )
    checked = _options.validated(
        f"@idempotent_tool(...) at {where}",
        options,
        accepted=accepted,
        rules={**_options.RULES, "account": _account_option},
    )

    def decorate(func: F) -> F:
        # Written above @staticmethod or @classmethod: the function they hold is the
        # tool's, and the class gets the same kind of method around the protected one.
        holder = type(func) if isinstance(func, (staticmethod, classmethod)) else None
        if holder is not None:
            func = func.__func__  # type: ignore[attr-defined]
        if not callable(func) or isinstance(func, type):
            raise ImproperlyConfigured(
                f"@idempotent_tool at {where} decorates {_validation.describe(func)}: put "
                "it, with its parentheses, on the tool's function, beneath the server's @tool"
            )
        # One framework object per tool: its members keep what they learn of the tool they
        # serve (its Context argument, its registration), and one decorator kept and put on
        # several tools must not let the last one speak for all of them.
        protected = _protected_by(func)
        if protected is not None:
            raise ImproperlyConfigured(
                f"@idempotent_tool at {where} protects {func.__name__} more than once: "
                f"{protected}'s @idempotent_tool protects it already. Keep one, beneath the "
                "server's @tool"
            )
        typed = _key_annotation(func)
        if typed is not None and not _text_or_uuid(typed):
            raise ImproperlyConfigured(
                f"@idempotent_tool at {where}: {func.__name__}'s {KEY_ARGUMENT} is typed "
                f"{typed!r}, and a key is text: type it str or UUID (or either | None)"
            )
        own = copy.copy(framework)
        own.refuse_registered(func, where)
        for adapter, other in other_frameworks(own):
            try:
                other.refuse_registered(func, where, own=False)
            except ImproperlyConfigured as exc:
                raise ImproperlyConfigured(
                    f"{exc}, and protect a tool of {other.name} with {adapter}.idempotent_tool"
                ) from None
        tool = _Tool(own, func, checked).wrapper()
        return cast(F, tool if holder is None else holder(tool))

    return decorate


class _Tool:
    """One protected tool: its signature for the framework, and how a call goes through the
    engine."""

    def __init__(
        self, framework: Framework[Any], func: Callable[..., Any], checked: dict[str, Any]
    ) -> None:
        self.framework = framework
        self.func = func
        self.account: str | Callable[[Any], Any] | None = checked["account"]
        self.operation: str = checked["operation"] or f"tool:{func.__name__}"
        self.named = checked["operation"] is not None  # else the registered name decides
        self.checked = checked
        self.wait: timedelta | None = checked["wait"]
        self.required = checked["required"] is not False
        self.signature = framework.signature(func, _described_key(func))
        self.has_key_argument = KEY_ARGUMENT in self.signature.parameters
        converter = framework.converter(func)
        self.convert: Callable[[Any, Any], Any] = lambda context, value: (
            value if framework.asks(value) else converter(context, value)
        )
        self.unsent = framework.injected(func) | {KEY_ARGUMENT}
        self.owner = _owner(func)

    def wrapper(self) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(self.func) or inspect.isasyncgenfunction(self.func):
            coroutine = async_to_sync(_threads.watched(_awaiting(self.func)))

            @functools.wraps(self.func)
            async def async_tool(*receiver: Any, **arguments: Any) -> Any:
                # The engine is synchronous; the tool's coroutine runs back on the event
                # loop from the engine's thread, and its ORM calls come back to that thread,
                # inside the record's transaction. A caller that goes away does not cut the
                # attempt short.
                body = self.bound(coroutine, receiver)
                context, arguments = self.framework.split(arguments)
                return await _http.run_to_the_end(
                    lambda: self.call(body, context, arguments), own_thread=True
                )

            tool: Callable[..., Any] = async_tool
        else:

            @functools.wraps(self.func)
            def sync_tool(*receiver: Any, **arguments: Any) -> Any:
                body = self.bound(self.func, receiver)
                context, arguments = self.framework.split(arguments)
                if _on_an_event_loop():
                    # Registered to run on the event loop (FastMCP's run_in_thread=False),
                    # where Django refuses the engine's queries: the call runs on a thread
                    # of its own, and the loop waits for it as it would for the tool.
                    with concurrent.futures.ThreadPoolExecutor(1) as thread:
                        running = contextvars.copy_context().run
                        return thread.submit(running, self.call, body, context, arguments).result()
                return self.call(body, context, arguments)

            tool = sync_tool
        tool.__signature__ = self.signature  # type: ignore[attr-defined]
        tool.__annotations__ = {
            name: parameter.annotation
            for name, parameter in self.signature.parameters.items()
            if parameter.annotation is not inspect.Parameter.empty
        } | (
            {"return": self.signature.return_annotation}
            if self.signature.return_annotation is not inspect.Signature.empty
            else {}
        )
        tool.__dict__["idempotency_options"] = self.checked
        tool.__dict__[_PROTECTED] = self.framework.name
        self.framework.bind(tool)
        return tool

    def bound(self, body: Callable[..., Any], receiver: tuple[Any, ...]) -> Callable[..., Any]:
        """``body`` with the instance (or class) a method tool is bound to, which comes first,
        positionally, and is no argument of the call (not in its fingerprint). Frameworks
        pass a call's arguments by name: anything else positional is refused, as a function
        taking its arguments by name refuses it."""
        if not receiver:
            return body
        if len(receiver) == 1 and _belongs(receiver[0], self.owner):
            return functools.partial(body, receiver[0])
        raise TypeError(
            f"{self.func.__qualname__}() takes its arguments by name, as a tool is called"
        )

    def call(self, body: Callable[..., Any], context: Any, arguments: dict[str, Any]) -> Any:
        """One call of the tool: through the engine, or refused; then, as Django does at the
        end of a request, the connections this worker thread opened are closed where
        ``CONN_MAX_AGE`` says so (frameworks run tools in threads that outlive the call)."""
        try:
            result = self._call(body, context, arguments)
            return result if self.framework.asks(result) else self.framework.answer(context, result)
        finally:
            _autonomous.close_unused_connections()

    def operation_for(self, context: Any) -> str:
        """The call's operation: ``operation=``, else ``tool:<registered name>``."""
        if self.named:
            return self.operation
        name = self.framework.tool_name(context)
        return f"tool:{name}" if name else self.operation

    def _call(self, body: Callable[..., Any], context: Any, arguments: dict[str, Any]) -> Any:
        operation = self.operation_for(context)
        key = arguments.get(KEY_ARGUMENT) if self.has_key_argument else None
        if isinstance(key, uuid.UUID):  # an argument typed UUID: its canonical text
            key = str(key)
        if key is None:
            meta = self.framework.meta(context)
            key = meta.get(META_KEY) if meta else None
        if key is None:
            if self.required:
                where = (
                    f"pass the same {KEY_ARGUMENT} on every retry of this action"
                    if self.has_key_argument
                    else f'the host sets _meta["{META_KEY}"] on the call, the same on every retry'
                )
                return self.refused(
                    _problems.KEY_MISSING, f"{operation} needs an idempotency key: {where}"
                )
            return self.convert(context, _finished(body(**arguments)))
        try:
            account = self.account_of(context)
        except db.Error:
            # Naming the caller read the database (a Django user's account): it failed as
            # the claim would have. Nothing ran; the error's text is for the log only.
            logger.exception(
                "idempotency store unavailable while naming the account of %s", operation
            )
            return self.refused(
                _problems.STORE_UNAVAILABLE, _problems.store_unavailable_detail(False)
            )
        if account is None:
            return self.refused(
                _problems.ACCOUNT_MISSING,
                f"{operation} needs an authenticated caller to scope its key",
            )
        if isinstance(account, _Unnamed):
            return self.refused(
                _problems.ACCOUNT_INVALID,
                f"the server could not name the caller's account for {operation}; nothing ran",
            )
        fingerprint = canonical({n: v for n, v in arguments.items() if n not in self.unsent})
        started = time.monotonic()
        try:
            once = call_once(
                lambda: self.convert(context, _finished(body(**arguments))),
                (),
                {},
                account=account,
                operation=operation,
                key=cast(str, key),  # validated by the engine: InvalidKey
                ttl=self.checked["ttl"],
                lease=self.checked["lease"],
                recovery=self.checked["recovery"],
                fingerprint=fingerprint,
                wait=self.wait,
                encode=self.stored,
                decode=self.loaded,
            )
        except InvalidKey as exc:
            return self.refused(_problems.KEY_INVALID, f"The idempotency key is not usable: {exc}")
        except KeyReused as exc:
            return self.refused(_problems.KEY_REUSED, str(exc))
        except LeaseTakenOver as exc:
            self.outlived(operation, time.monotonic() - started)
            return self.refused(_problems.LEASE_LOST, str(exc), retry_after=exc.retry_after)
        except InProgress as exc:
            return self.refused(_problems.KEY_IN_USE, str(exc), retry_after=exc.retry_after)
        except OutcomeUnknown as exc:
            return self.refused(_problems.OUTCOME_UNKNOWN, str(exc))
        except OutcomeTooLarge as exc:  # the server's limit is in the log, not for the agent
            logger.error("%s: %s", operation, exc)
            return self.refused(
                _problems.RESPONSE_NOT_STORABLE,
                "The result could not be kept for replay (larger than the server keeps), "
                "so the call was rolled back.",
            )
        except RecordUnreadable:  # why (a key id, a setting) is in the log, not for the agent
            return self.refused(_problems.RECORD_UNREADABLE, _problems.UNREADABLE)
        except StoreUnavailable as exc:  # the database's error text is in the log
            return self.refused(
                _problems.STORE_UNAVAILABLE, _problems.store_unavailable_detail(exc.ran)
            )
        if not once.replayed:
            self.outlived(operation, time.monotonic() - started)
            return once.value
        meta = dict(self.framework.meta_of(once.value) or {})
        meta[REPLAYED_META] = True
        return self.framework.with_meta(once.value, meta)

    def account_of(self, context: Any) -> str | _Unnamed | None:
        """The call's account; ``None`` (refused as ``idempotency_account_missing``) where
        there is none: no principal, or a callable answering ``None`` or ``""``. A callable
        answering anything but a string is a defect of the project's: logged, and
        ``_UNNAMED`` (refused as ``idempotency_account_invalid``, the HTTP side's code for
        an account resolver's wrong answer), so that the caller gets a code and nothing
        runs."""
        if isinstance(self.account, str):
            return self.account
        if self.account is None:
            return self.framework.principal(context)
        named = self.account(context)
        if named is None or named == "":
            return None
        if not isinstance(named, str):
            logger.error(
                "the account callable of %s answered %r: a string or None; the call was "
                "refused (idempotency_account_invalid)",
                self.operation,
                type(named).__name__,
            )
            return _UNNAMED
        return named

    def outlived(self, operation: str, took: float) -> None:
        """Warn when a call ran longer than its lease: another attempt may take it over
        meanwhile (a retry, or a duplicate that ``wait``ed) and run the tool again."""
        lease = self.checked["lease"] or app_settings.LEASE
        if took > lease.total_seconds():
            logger.warning(
                "%s ran for %.1f s, longer than its lease (%.1f s): a retry or a waiting "
                "duplicate may have taken it over and run it again. Give the tool a lease "
                "longer than its slowest call: @idempotent_tool(lease=...)",
                operation,
                took,
                lease.total_seconds(),
            )

    def refused(
        self, problem: _problems.Problem, detail: str, retry_after: int | None = None
    ) -> Any:
        structured: dict[str, Any] = {"code": problem.code, "detail": detail}
        if retry_after is not None:
            structured["retry_after"] = max(1, int(retry_after))
        return self.framework.refusal(f"{problem.title}: {detail}", structured)

    def stored(self, value: Any) -> Outcome | None:
        # A round that asks for input is not kept: its writes roll back, the claim is
        # released, and the round that answers claims the key again.
        if self.framework.asks(value):
            return None
        return stored_result(self.framework.dump(value))

    def loaded(self, body: bytes) -> Any:
        return self.framework.load(json.loads(body))


#: What a protected tool carries: the name of the framework whose decorator made it.
_PROTECTED = "idempotent_tool"


def _protected_by(func: Any) -> str | None:
    """The framework whose ``@idempotent_tool`` made ``func``, or any function it wraps (a
    project's own decorator between two), or ``None``."""
    seen = set()
    while func is not None and id(func) not in seen:
        seen.add(id(func))
        found = getattr(func, "__dict__", {}).get(_PROTECTED)
        if found is not None:
            return str(found)
        func = getattr(func, "__wrapped__", None)
    return None


def _owner(func: Callable[..., Any]) -> tuple[str, str] | None:
    """The module and qualified name of the class whose body ``func`` was written in, when it
    was (a method), else ``None``."""
    *outer, _ = getattr(func, "__qualname__", "").split(".")
    if not outer or outer[-1] == "<locals>":
        return None
    return getattr(func, "__module__", None) or "", ".".join(outer)


def _belongs(receiver: Any, owner: tuple[str, str] | None) -> bool:
    """Whether ``receiver`` is what a method of ``owner`` is bound to: an instance of that
    class (or of a subclass), or the class itself (a ``classmethod``)."""
    if owner is None:
        return False
    cls = receiver if isinstance(receiver, type) else type(receiver)
    return any((c.__module__, c.__qualname__) == owner for c in cls.__mro__)


def _awaiting(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` (an ``async def`` or an async generator function) as a coroutine function
    whose value is the answer read to its end (see :func:`_settled`)."""

    @functools.wraps(func)
    async def awaiting(*args: Any, **kwargs: Any) -> Any:
        return await _settled(func(*args, **kwargs))

    return awaiting


async def _settled(value: Any) -> Any:
    """``value`` awaited, and an async generator collected into a list, as FastMCP does."""
    if inspect.isawaitable(value):
        value = await value
    if inspect.isasyncgen(value):
        return [item async for item in value]
    return value


def _finished(value: Any) -> Any:
    """What a tool's body handed back, read to its end before it is converted and stored, as
    FastMCP reads it: an awaitable awaited (a plain ``def`` handing back its async body's
    coroutine, as a project's own decorator does), a generator and an async generator
    collected into a list. Their code runs only then: stored unread, a record would complete
    for a body that never ran, and replay the generator's name. The engine's thread waits;
    the code's ORM calls come back to it, inside the record's transaction."""
    if inspect.isawaitable(value) or inspect.isasyncgen(value):
        value = async_to_sync(_settled)(value)
    if inspect.isgenerator(value):
        return list(value)
    return value


def _on_an_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _account_option(value: Any) -> str | Callable[[Any], str | None]:
    if callable(value) or (isinstance(value, str) and value):
        return value  # type: ignore[no-any-return]
    raise _validation.Invalid("a non-empty string or a callable Context -> str | None", value)


def _described_key(func: Callable[..., Any]) -> inspect.Signature:
    """The tool's signature with its annotations resolved and the key argument described."""
    signature = inspect.signature(func)
    hints = typing.get_type_hints(func, include_extras=True)
    parameters = []
    for parameter in signature.parameters.values():
        annotation = hints.get(parameter.name, parameter.annotation)
        if parameter.name == KEY_ARGUMENT and not _described(annotation):
            from pydantic import Field  # every MCP framework stands on pydantic

            annotation = Annotated[annotation, Field(description=KEY_DESCRIPTION)]
        parameters.append(parameter.replace(annotation=annotation))
    returns = signature.return_annotation
    if returns is not None:
        # ``-> None`` stays ``None``: resolved, it would be ``NoneType``, which FastMCP
        # reads as a result to wrap (an output schema the tool's results do not carry).
        returns = hints.get("return", returns)
    return signature.replace(parameters=parameters, return_annotation=returns)


def _key_annotation(func: Callable[..., Any]) -> Any:
    """The annotation of ``func``'s key argument, resolved; ``None`` when it has no key
    argument or leaves it unannotated."""
    if KEY_ARGUMENT not in inspect.signature(func).parameters:
        return None
    return typing.get_type_hints(func, include_extras=True).get(KEY_ARGUMENT)


def _text_or_uuid(annotation: Any) -> bool:
    """Whether every value the framework may hand a key argument so annotated is text or a
    ``UUID`` (or ``None``): a key argument of another type could never be a key, and every
    call would be refused."""
    origin = typing.get_origin(annotation)
    arguments = typing.get_args(annotation)
    if origin is Annotated:
        return _text_or_uuid(arguments[0])
    if origin in (typing.Union, types.UnionType):
        return all(_text_or_uuid(member) for member in arguments)
    if origin is typing.Literal:
        return all(isinstance(value, str) for value in arguments)
    if isinstance(annotation, typing.NewType):
        return _text_or_uuid(annotation.__supertype__)
    if annotation is Any or annotation is type(None):
        return True
    return isinstance(annotation, type) and issubclass(annotation, (str, uuid.UUID))


def _described(annotation: Any) -> bool:
    return typing.get_origin(annotation) is Annotated and any(
        getattr(extra, "description", None) for extra in typing.get_args(annotation)[1:]
    )


def canonical(value: Any) -> Any:
    """The arguments as the fingerprint reads them: the same call gives the same JSON in
    every process and for every spelling of one number. A set's items in the order of their
    canonical JSON (its own order follows the process's hash seed); a whole number, float
    or ``Decimal``, as the integer it equals (an agent may send ``1`` or ``1.0`` for the
    same amount); any other ``Decimal`` as its normalised digits (``"1.50"`` is ``"1.5"``);
    a float or ``Decimal`` no JSON holds (``inf``, ``nan``) as its name."""
    if isinstance(value, (set, frozenset)):
        items = [canonical(item) for item in value]
        return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))
    if isinstance(value, dict):
        return {str(key): canonical(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(item) for item in value]
    if isinstance(value, float):
        if not math.isfinite(value):
            return f"float:{value}"
        return int(value) if value.is_integer() else value
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            return f"decimal:{value}"
        if value == value.to_integral_value():
            return int(value)
        return f"decimal:{value.normalize():f}"
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    # Models, dataclasses, dates, UUIDs, enums...: their JSON form, then the same rules.
    from pydantic_core import to_jsonable_python

    return canonical(to_jsonable_python(value, fallback=repr))
