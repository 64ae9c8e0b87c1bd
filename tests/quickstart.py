"""The README's installation and quickstarts, read as the steps of a new project.

From ``## Installation`` to the section after the quickstarts, each Python block starts with
the file it goes into, relative to a project made by ``django-admin startproject mysite .``:
``# orders/models.py`` writes that file (replacing what ``startproject`` or ``startapp``
put there), ``# mysite/settings.py, at the end`` appends to it. Each shell line
``python manage.py ...`` is a command run there, in order; the ``pip install`` line names
the extras, and the ``curl`` line is the first request. ``tests/test_quickstart.py`` does all
of it with the built wheel; ``tests/test_docs.py`` checks the blocks without running them.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FIRST, AFTER = "## Installation\n", "## Beyond a view\n"
LABEL = re.compile(r"^# (?P<path>[\w/]+\.py)(?P<append>, at the end)?$")
BLOCK = re.compile(r"^```(?P<lang>\w+)\n(?P<text>.*?)^```\n", re.S | re.M)
# What the quickstarts may import: Django, DRF, this package, the standard library, and the
# project's own modules.
ALLOWED_IMPORTS = {"django", "rest_framework", "django_idempotency", "orders", "mysite"}


@dataclass(frozen=True)
class Paste:
    """A Python block: its code, verbatim, for ``path``, written or appended."""

    path: str
    append: bool
    code: str


@dataclass(frozen=True)
class Command:
    """A shell line of a quickstart: its words."""

    words: list[str]


Step = Paste | Command


def region() -> str:
    text = README.read_text()
    start = text.index(FIRST)
    return text[start : text.index(AFTER, start)]


def steps() -> Iterator[Step]:
    """The blocks of the installation and the quickstarts, in the order of the README."""
    for match in BLOCK.finditer(region()):
        lang, text = match["lang"], match["text"]
        if lang == "python":
            first = text.splitlines()[0]
            label = LABEL.match(first)
            if label is None:
                raise ValueError(f"a quickstart block that names no file: {first!r}")
            yield Paste(label["path"], bool(label["append"]), text)
        elif lang == "sh":
            joined = text.replace("\\\n", " ")
            for line in joined.splitlines():
                words = shlex.split(line, comments=True)
                if words:
                    yield Command(words)
        else:
            raise ValueError(f"a quickstart block of another kind: {lang}")


def pastes() -> list[Paste]:
    return [step for step in steps() if isinstance(step, Paste)]


def commands(program: str) -> list[list[str]]:
    return [s.words for s in steps() if isinstance(s, Command) and s.words[0] == program]


def install_lines() -> list[list[str]]:
    """The README's lines that install from a clone: ``git clone``, then ``pip`` and
    ``python -m pip`` lines that name the clone by its absolute path (``$HOME/...``)."""
    lines = [s.words for s in steps() if isinstance(s, Command)]
    start = next(n for n, words in enumerate(lines) if words[:2] == ["git", "clone"])
    return [words for words in lines[start:] if words[0] in ("git", "pip", "python")][:4]


def extras() -> str:
    """The extras of the README's ``pip install "django-idempotency[...]"`` line."""
    (words,) = [w for w in commands("pip") if w[2].startswith("django-idempotency[")]
    return words[2].partition("[")[2].rstrip("]")


def first_request() -> list[str]:
    """The quickstart's ``curl`` line, as words."""
    (words,) = commands("curl")
    return words


def imported_modules(code: str) -> set[str]:
    """The top-level names of what ``code`` imports (``.models`` counts as the project's)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def apply(paste: Paste, project: Path) -> None:
    """Paste one block into ``project``: appended to the end of its file, or as the file."""
    target = project / paste.path
    if paste.append:
        if not target.is_file():
            raise FileNotFoundError(f"{paste.path} must exist before a block is added at its end")
        with target.open("a") as file:
            file.write("\n\n" + paste.code)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(paste.code)
