"""MkDocs hooks of the documentation site (``hooks:`` in ``mkdocs.yml``).

Some pages of the site are files of the repository as they are (the README, the changelog,
the contributing guide, the benchmark report). On GitHub such a page shows a link to its file;
on the site the region between the two comments below is that file:

    <!-- include: CHANGELOG.md -->
    The changelog is [CHANGELOG.md](../CHANGELOG.md).
    <!-- end include -->
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

INCLUDE = re.compile(r"^<!-- include: (\S+) -->\n.*?^<!-- end include -->\n", re.S | re.M)


def include_files(markdown: str, root: Path) -> str:
    """``markdown`` with every include region replaced by the file it names."""

    def included(match: re.Match[str]) -> str:
        path = root / match.group(1)
        if not path.is_file():
            raise PluginError(f"{match.group(1)} is included but does not exist")
        return path.read_text()

    return INCLUDE.sub(included, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """The page's Markdown, with the repository's files it includes written in."""
    return include_files(markdown, Path(config["config_file_path"]).parent)
