"""Agents' tool calls: ``@idempotent_tool()`` for the official MCP Python SDK.

An agent that retries a tool call after a timeout repeats a real-world action, and the
model mints a new tool-call id every turn, so the id cannot be the key. The key comes from
the tool's own ``idempotency_key`` argument (which the model is told to reuse on a retry)
or from the host, in the call's ``_meta["idempotencyKey"]``; the engine then gives the
tool what it gives a protected view: one run per ``(account, operation, key)``, the stored
result replayed to every retry, leases with fencing, recovery policies and steps.

::

    from mcp.server.mcpserver import MCPServer
    from django_idempotency.mcp import idempotent_tool

    shop = MCPServer("shop")

    @shop.tool()
    @idempotent_tool(recovery="fail")
    def refund(order_id: int, amount: int, idempotency_key: str) -> dict:
        ...

A thin adapter over the engine that ``run_once`` uses (``_once.call_once``): the tool's
result is stored as the ``CallToolResult`` the SDK would have sent, and a refusal is a tool
result with ``isError`` and a ``structuredContent`` of ``{"code", "detail"}`` carrying the
HTTP side's problem codes. Needs the ``mcp`` extra.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import typing
from collections.abc import Callable
from datetime import timedelta
from typing import Annotated, Any, TypeVar, cast

from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.utilities.context_injection import find_context_parameter
from mcp.server.mcpserver.utilities.func_metadata import func_metadata
from mcp_types import CallToolResult, TextContent
from pydantic import Field, ValidationError
from pydantic_core import to_jsonable_python

from django_idempotency import _autonomous, _http, _options, _problems, _validation
from django_idempotency._once import LeaseTakenOver, call_once, stored_result
from django_idempotency._options import ToolOptions
from django_idempotency._outcomes import Outcome
from django_idempotency.exceptions import (
    InProgress,
    KeyReused,
    OutcomeUnknown,
    RecordUnreadable,
    StoreUnavailable,
)
from django_idempotency.keys import InvalidKey

if typing.TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "KEY_ARGUMENT",
    "KEY_DESCRIPTION",
    "META_KEY",
    "REPLAYED_META",
    "ToolOptions",
    "idempotent_tool",
    "principal_account",
]

F = TypeVar("F", bound=Callable[..., Any])

#: The tool argument that carries the key, when the tool declares it.
KEY_ARGUMENT = "idempotency_key"
#: How that argument is described in the tool's input schema (unless the tool says more).
KEY_DESCRIPTION = "The same value on every retry of this action"
#: Where a host puts the key in the call's ``_meta`` when the tool has no key argument.
META_KEY = "idempotencyKey"
#: The ``_meta`` flag of a replayed result.
REPLAYED_META = "idempotentReplayed"

# The name under which the adapter receives the call's Context when the tool asks for none.
_CONTEXT_ARGUMENT = "idempotency_context"


def principal_account(context: Any = None) -> str | None:
    """The default account: the authenticated MCP principal of the call, or ``None``.

    The access token's subject, qualified by its issuer (``iss`` claim) where it has one,
    is ``mcp:sub:["<issuer>","<subject>"]``; a token without a subject names its OAuth
    client, ``mcp:client:<client_id>``. Without an access token there is no account.
    """
    token = get_access_token()
    if token is None:
        return None
    if token.subject:
        issuer = (token.claims or {}).get("iss")
        named = json.dumps([None if issuer is None else str(issuer), token.subject])
        return f"mcp:sub:{named}"
    return f"mcp:client:{token.client_id}" if token.client_id else None


def idempotent_tool(**options: Unpack[ToolOptions]) -> Callable[[F], F]:
    """Run an MCP tool at most once per ``(account, operation, key)``; replay its result.

    Put it beneath ``@server.tool()``, with parentheses. The tool keeps its signature and
    input schema; a ``def`` tool and an ``async def`` tool are both served.

    - ``account``: a string, or ``Context -> str | None``; by default the access token's
      principal (``principal_account``). No account: the call is refused.
    - ``operation``: default ``tool:<function name>``.
    - ``ttl``, ``lease``, ``recovery``: as for ``run_once`` (the settings by default).
    - ``wait``: how long a duplicate of a call in flight waits for its outcome (bounded,
      holding no lock or connection) rather than being refused as in use.
    - ``required``: without a key the call is refused (``True``, the default) or runs
      unprotected (``False``).

    A wrong option raises ``ImproperlyConfigured`` here, when the tool is decorated.
    """
    where = _validation.caller()
    checked = _options.validated(
        f"@idempotent_tool(...) at {where}",
        options,
        accepted=ToolOptions.__optional_keys__,
        rules={**_options.RULES, "account": _account_option},
    )
    wait: timedelta | None = checked["wait"]
    required = checked["required"] is not False

    where = _validation.caller()

    def decorate(func: F) -> F:
        _refuse_registered(func, where)
        if _CONTEXT_ARGUMENT in inspect.signature(func).parameters:
            raise ImproperlyConfigured(
                f"@idempotent_tool at {where}: {func.__name__} has an argument named "
                f"{_CONTEXT_ARGUMENT!r}, the name the adapter passes the call's Context by; "
                "rename it"
            )
        adapter = _Adapter(func, checked["account"], checked, wait, required)
        return cast(F, adapter.wrapper())

    return decorate


class _Adapter:
    """One protected tool: its signature for the SDK, and how a call goes through the
    engine."""

    def __init__(
        self,
        func: Callable[..., Any],
        account: str | Callable[[Any], str | None] | None,
        checked: dict[str, Any],
        wait: timedelta | None,
        required: bool,
    ) -> None:
        self.func = func
        self.account = account
        self.operation: str = checked["operation"] or f"tool:{func.__name__}"
        self.checked = checked
        self.wait = wait
        self.required = required
        self.own_context = find_context_parameter(func)
        self.context_argument = self.own_context or _CONTEXT_ARGUMENT
        self.signature = _signature(func, self.own_context is None)
        # How the SDK turns the tool's return value into a result, computed as the SDK
        # does, so that the stored result is the one a first call answers.
        skip = [self.context_argument]
        self.convert = func_metadata(func, skip_names=skip).convert_result
        self.is_async = inspect.iscoroutinefunction(func)

    def wrapper(self) -> Callable[..., Any]:
        if self.is_async:
            body = async_to_sync(self.func)

            @functools.wraps(self.func)
            async def async_tool(**arguments: Any) -> CallToolResult:
                # The engine is synchronous; the tool's coroutine runs back on an event loop
                # from the engine's thread, and its ORM calls come back to that thread,
                # inside the record's transaction. A caller that goes away does not cut
                # the attempt short.
                return await _http.run_to_the_end(
                    lambda: self.call(body, arguments), thread_sensitive=False
                )

            tool: Callable[..., Any] = async_tool
        else:

            @functools.wraps(self.func)
            def sync_tool(**arguments: Any) -> CallToolResult:
                return self.call(self.func, arguments)

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
        return tool

    def call(self, body: Callable[..., Any], arguments: dict[str, Any]) -> CallToolResult:
        """One call of the tool: through the engine, or refused; then, as Django does at the
        end of a request, the connections this worker thread opened are closed where
        ``CONN_MAX_AGE`` says so (the SDK runs tools in threads that outlive the call)."""
        try:
            return self._call(body, arguments)
        finally:
            _autonomous.close_unused_connections()

    def _call(self, body: Callable[..., Any], arguments: dict[str, Any]) -> CallToolResult:
        context = arguments.get(self.context_argument)
        if self.own_context is None:
            arguments = {n: v for n, v in arguments.items() if n != _CONTEXT_ARGUMENT}
        key = arguments.get(KEY_ARGUMENT) if KEY_ARGUMENT in self.signature.parameters else None
        if key is None:
            key = _meta_key(context)
        if key is None:
            if self.required:
                where = (
                    f"pass the same {KEY_ARGUMENT} on every retry of this action"
                    if KEY_ARGUMENT in self.signature.parameters
                    else f'the host sets _meta["{META_KEY}"] on the call, the same on every retry'
                )
                return _refusal(
                    _problems.KEY_MISSING, f"{self.operation} needs an idempotency key: {where}"
                )
            return self.result(body(**arguments))
        account = self.account_of(context)
        if account is None:
            return _refusal(
                _problems.ACCOUNT_MISSING,
                f"{self.operation} needs an authenticated caller to scope its key",
            )
        fingerprint = _canonical(
            {
                name: value
                for name, value in arguments.items()
                if name not in (KEY_ARGUMENT, self.context_argument)
            }
        )
        try:
            once = call_once(
                lambda: self.result(body(**arguments)),
                (),
                {},
                account=account,
                operation=self.operation,
                key=cast(str, key),  # validated by the engine: InvalidKey
                ttl=self.checked["ttl"],
                lease=self.checked["lease"],
                recovery=self.checked["recovery"],
                fingerprint=fingerprint,
                wait=self.wait,
                encode=self.stored,
                decode=_loaded,
            )
        except InvalidKey as exc:
            return _refusal(_problems.KEY_INVALID, f"The idempotency key is not usable: {exc}")
        except KeyReused as exc:
            return _refusal(_problems.KEY_REUSED, str(exc))
        except LeaseTakenOver as exc:
            return _refusal(_problems.LEASE_LOST, str(exc), retry_after=exc.retry_after)
        except InProgress as exc:
            return _refusal(_problems.KEY_IN_USE, str(exc), retry_after=exc.retry_after)
        except OutcomeUnknown as exc:
            return _refusal(_problems.OUTCOME_UNKNOWN, str(exc))
        except RecordUnreadable:  # why (a key id, a setting) is in the log, not for the agent
            return _refusal(_problems.RECORD_UNREADABLE, _problems.UNREADABLE)
        except StoreUnavailable as exc:  # the database's error text is in the log
            return _refusal(
                _problems.STORE_UNAVAILABLE, _problems.store_unavailable_detail(exc.ran)
            )
        if not once.replayed:
            return once.value
        meta = dict(once.value.meta or {})
        meta[REPLAYED_META] = True
        return once.value.model_copy(update={"meta": meta})

    def account_of(self, context: Any) -> str | None:
        if isinstance(self.account, str):
            return self.account
        if self.account is None:
            return principal_account(context)
        named = self.account(context)
        if named is not None and (not isinstance(named, str) or not named):
            raise TypeError(
                f"the account callable of {self.operation} answered {named!r}: a non-empty "
                "string or None"
            )
        return named

    def result(self, value: Any) -> CallToolResult:
        """The result the SDK sends for the tool's return value."""
        converted = self.convert(value)
        if not isinstance(converted, CallToolResult):
            raise TypeError(
                f"{self.operation} answered {type(converted).__name__}, which cannot be "
                "stored and replayed"
            )
        return converted

    def stored(self, value: Any) -> Outcome:
        result = value if isinstance(value, CallToolResult) else self.result(value)
        return stored_result(result.model_dump(mode="json", by_alias=True, exclude_none=True))


def _refuse_registered(func: Callable[..., Any], where: str) -> None:
    """``@idempotent_tool`` above ``@server.tool()`` protects nothing: the server has the
    bare function already. Refused where a server in sight shows it: one of the decorating
    module's, or of the scope the decorator is applied in."""
    module = inspect.getmodule(func)
    frame = inspect.currentframe()
    applying = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    seen = list(vars(module).values()) if module is not None else []
    if applying is not None:
        seen += list(applying.f_locals.values())
    del frame, applying
    for value in seen:
        if not isinstance(value, MCPServer):
            continue
        # The SDK keeps a server's tools in its tool manager (no public list is synchronous).
        tools = getattr(getattr(value, "_tool_manager", None), "list_tools", None)
        if callable(tools) and any(tool.fn is func for tool in tools()):
            raise ImproperlyConfigured(
                f"@idempotent_tool at {where} is above @{value.name}.tool(), which registered "
                f"{func.__name__} unprotected: put @idempotent_tool beneath @server.tool()"
            )


def _account_option(value: Any) -> str | Callable[[Any], str | None]:
    if callable(value) or (isinstance(value, str) and value):
        return value  # type: ignore[no-any-return]
    raise _validation.Invalid("a non-empty string or a callable Context -> str | None", value)


def _signature(func: Callable[..., Any], add_context: bool) -> inspect.Signature:
    """The tool's signature as the SDK reads it: its annotations resolved, the key argument
    described, and a ``Context`` argument for the adapter where the tool has none."""
    signature = inspect.signature(func)
    hints = typing.get_type_hints(func, include_extras=True)
    parameters = []
    for parameter in signature.parameters.values():
        annotation = hints.get(parameter.name, parameter.annotation)
        if parameter.name == KEY_ARGUMENT and not _described(annotation):
            annotation = Annotated[annotation, Field(description=KEY_DESCRIPTION)]
        parameters.append(parameter.replace(annotation=annotation))
    if add_context:
        parameters.append(
            inspect.Parameter(
                _CONTEXT_ARGUMENT, inspect.Parameter.KEYWORD_ONLY, annotation=Context, default=None
            )
        )
    return signature.replace(
        parameters=parameters, return_annotation=hints.get("return", signature.return_annotation)
    )


def _canonical(value: Any) -> Any:
    """The arguments as the fingerprint reads them: the same call gives the same JSON in
    every process. A set's items in the order of their canonical JSON (its own order
    follows the process's hash seed), a whole float as the integer it equals (an agent
    may send ``1`` or ``1.0`` for the same amount), a float no JSON holds (``inf``,
    ``nan``) as its name."""
    if isinstance(value, (set, frozenset)):
        items = [_canonical(item) for item in value]
        return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))
    if isinstance(value, dict):
        return {str(key): _canonical(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    if isinstance(value, float):
        if not math.isfinite(value):
            return f"float:{value}"
        return int(value) if value.is_integer() else value
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    # Models, dataclasses, dates, UUIDs, enums...: their JSON form, then the same rules.
    return _canonical(to_jsonable_python(value, fallback=repr))


def _described(annotation: Any) -> bool:
    return typing.get_origin(annotation) is Annotated and any(
        getattr(extra, "description", None) for extra in typing.get_args(annotation)[1:]
    )


def _meta_key(context: Any) -> Any:
    if not isinstance(context, Context):
        return None
    try:
        meta = context.request_context.meta
    except ValueError:  # a Context outside a request
        return None
    return None if not meta else meta.get(META_KEY)


def _loaded(body: bytes) -> CallToolResult:
    try:
        return CallToolResult.model_validate(json.loads(body))
    except ValidationError as exc:
        raise ValueError(f"the stored tool result is not one: {exc}") from None


def _refusal(
    problem: _problems.Problem, detail: str, retry_after: int | None = None
) -> CallToolResult:
    structured: dict[str, Any] = {"code": problem.code, "detail": detail}
    if retry_after is not None:
        structured["retry_after"] = max(1, int(retry_after))
    return CallToolResult(
        content=[TextContent(type="text", text=f"{problem.title}: {detail}")],
        structured_content=structured,
        is_error=True,
    )
