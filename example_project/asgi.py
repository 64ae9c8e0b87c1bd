"""ASGI entry point of the example project: the Django site, and the MCP server of
``example_project/mcp_tools.py`` mounted beside it at ``/mcp``.

    uvicorn example_project.asgi:application

``/mcp`` (and the OAuth protected-resource metadata under ``/.well-known/``) go to the MCP
server's streamable-HTTP app, every other path to Django. The lifespan goes to the MCP app:
its session manager runs there (Django's handler takes no lifespan events).
"""

from __future__ import annotations

import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

django_application = get_asgi_application()  # sets Django up: the tools import models

from example_project.mcp_tools import shop  # noqa: E402

#: Stateless: any server process may take any call, as behind a load balancer. The claim in
#: the database, not a session, is what makes a retry safe.
mcp_application = shop.streamable_http_app(streamable_http_path="/mcp", stateless_http=True)

MCP_PATHS = ("/mcp", "/.well-known/oauth-protected-resource")


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan" or str(scope.get("path", "")).startswith(MCP_PATHS):
        await mcp_application(scope, receive, send)
    else:
        await django_application(scope, receive, send)
