"""The example's FastMCP tools served on their own, without the Django site around them
(docs/mcp.md): ``python -m example_project.docs_examples.agent_server``. Django is set up
first, since the tools use its ORM. ``tests/test_mcp_e2e.py`` runs it and refunds through it.
"""

# --8<-- [start:serve-alone]
import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")
django.setup()  # before the tools are imported: they use the project's models

from example_project.fastmcp_tools import shop

if __name__ == "__main__":
    port = int(os.environ.get("MCP_PORT", "8001"))
    shop.run(transport="http", host="127.0.0.1", port=port, path="/mcp", stateless_http=True)
    # --8<-- [end:serve-alone]
