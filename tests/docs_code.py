"""The Python blocks of the docs pages are copies of tested files, kept in sync from here.

The pages are read on GitHub as much as on the site, so each block holds its code as it is,
under a comment (which neither shows) naming the file, or the section of it, it copies:

    <!-- code: example_project/docs_examples/views.py:function-views -->
    ```python
    ...the lines between ``# --8<-- [start:function-views]`` and ``[end:...]``...
    ```

A section is the lines between its markers, dedented; a whole file is shown without the
markers of its sections. The tests import and run those files and mypy checks them;
``tests/test_docs.py`` fails on a block that is no longer its source, and
``python -m tests.docs_code`` (``make docs-code``) writes every block anew from its source.
"""

from __future__ import annotations

import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# Files whose code the docs may show: the tests import and run them, mypy checks them.
TESTED_SOURCES = (
    "example_project/docs_examples/",
    "example_project/payments/",
    "example_project/client.py",
    # The example project's Celery app, and the lines of its __init__.py that load it.
    "example_project/celery.py",
    "example_project/__init__.py",
    "example_project/recipes/",
    # The ASGI app that mounts the MCP servers beside the site: tests/test_mcp_e2e.py serves
    # it under uvicorn and calls through it.
    "example_project/asgi.py",
    # The endpoint audit's reports, which tests/test_audit.py compares with its output.
    "tests/audit/",
    # The apps of schemas per tenant, which make test-tenants runs with.
    "tests/tenants/settings.py",
)
SOURCE_COMMENT = re.compile(r"^<!-- code: ([^\s:]+)(?::([\w-]+))? -->\n", re.M)
MARKER = re.compile(r"^[ \t]*# --8<-- \[(?:start|end):[\w-]+\]\n", re.M)


@dataclass(frozen=True)
class ShownCode:
    """One block of a page that copies a tested file: where it is and what it should be."""

    page: Path
    line: int
    source: str  # "path" or "path:section"
    shown: str
    expected: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def section(path: str, name: str | None) -> str:
    """The code of ``path`` (a whole file, less its section markers) or of its section ``name``."""
    text = (ROOT / path).read_text()
    if name is None:
        return MARKER.sub("", text)
    match = re.search(
        rf"^[ \t]*# --8<-- \[start:{name}\]\n(.*?)^[ \t]*# --8<-- \[end:{name}\]\n",
        text,
        re.S | re.M,
    )
    if match is None:
        raise LookupError(f"{path} has no section {name!r}")
    return textwrap.dedent(match.group(1))


def pages() -> list[Path]:
    # The README shows one tested section too: the Celery app with its beat schedule.
    return [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]


_OPENING = re.compile(r"```[\w-]*\n")


def _fence_after(text: str, start: int) -> tuple[int, int]:
    """Where the body of the fenced block (```python, ```text...) right after ``start``
    begins and ends."""
    opening = _OPENING.match(text, start)
    if opening is None:
        line = text.count("\n", 0, start) + 1
        raise ValueError(f"line {line}: a code comment not followed by a fenced block")
    body = opening.end()
    end = text.find("\n```\n", body - 1)
    if end == -1:
        raise ValueError(f"line {text.count(chr(10), 0, start) + 1}: an unclosed block")
    return body, end + 1


def shown_code(page: Path) -> list[ShownCode]:
    """Every block of ``page`` that names its source, with what that source says now."""
    text = page.read_text()
    found = []
    for match in SOURCE_COMMENT.finditer(text):
        path, name = match.groups()
        if not path.startswith(TESTED_SOURCES) or not (ROOT / path).is_file():
            raise ValueError(f"{page.name}: {path} is not a tested file ({TESTED_SOURCES})")
        body, end = _fence_after(text, match.end())
        found.append(
            ShownCode(
                page=page,
                line=text.count("\n", 0, body),
                source=path if name is None else f"{path}:{name}",
                shown=text[body:end],
                expected=section(path, name),
            )
        )
    return found


def out_of_sync() -> list[ShownCode]:
    """The blocks of the docs whose code is no longer that of their source."""
    return [code for page in pages() for code in shown_code(page) if code.shown != code.expected]


def write(page: Path) -> bool:
    """Write every block of ``page`` anew from its source; whether anything changed."""
    text = page.read_text()
    parts, done = [], 0
    for match in SOURCE_COMMENT.finditer(text):
        body, end = _fence_after(text, match.end())
        parts += [text[done:body], section(*match.groups())]
        done = end
    new = "".join([*parts, text[done:]])
    if new != text:
        page.write_text(new)
    return new != text


def main() -> int:
    changed = [page for page in pages() if write(page)]
    for page in changed:
        print(f"wrote the code blocks of {page.relative_to(ROOT)}")
    if not changed:
        print("every code block of the docs is its source's code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
