"""ASGI entry point of the example project: the Django site, and beside it the refund tools
served twice, by the SDK's ``MCPServer`` (``example_project/mcp_tools.py``, at ``/mcp``) and by
FastMCP (``example_project/fastmcp_tools.py``, at ``/fastmcp``).

    uvicorn example_project.asgi:application

``/mcp`` (and the OAuth protected-resource metadata under ``/.well-known/``) go to the SDK's
streamable-HTTP app, ``/fastmcp`` to FastMCP's, every other path to Django. The lifespan
runs both MCP apps' session managers (Django's handler takes no lifespan events).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

django_application = get_asgi_application()  # sets Django up: the tools import models

# --8<-- [start:mount]
from starlette.applications import Starlette  # noqa: E402

from example_project import fastmcp_tools, mcp_tools  # noqa: E402

#: Stateless: any server process may take any call, as behind a load balancer. The claim in
#: the database, not a session, is what makes a retry safe.
mcp_application = mcp_tools.shop.streamable_http_app(
    streamable_http_path="/mcp", stateless_http=True
)
fastmcp_application = fastmcp_tools.shop.http_app(path="/fastmcp", stateless_http=True)

MCP_PATHS = ("/mcp", "/.well-known/oauth-protected-resource")
FASTMCP_PATHS = ("/fastmcp",)


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with (
        mcp_application.router.lifespan_context(app),
        fastmcp_application.lifespan(app),
    ):
        yield


lifespans = Starlette(lifespan=lifespan)


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    path = str(scope.get("path", ""))
    if scope["type"] == "lifespan":
        await lifespans(scope, receive, send)
    elif path.startswith(FASTMCP_PATHS):
        await fastmcp_application(scope, receive, send)
    elif path.startswith(MCP_PATHS):
        await mcp_application(scope, receive, send)
    else:
        await django_application(scope, receive, send)
    # --8<-- [end:mount]
