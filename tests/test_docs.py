"""The documentation tells the truth: every code block is tested code, the state diagram is
the states module, every setting and check id is documented, no page names a private name of
the package, and the Grafana dashboard queries metrics that exist.

Python blocks of the docs site are snippets (``--8<-- "path:section"``) of the modules in
``example_project/docs_examples/`` and of the example project, which the tests below import
and run; the README copies such sections byte for byte. Shell blocks name real ``make``
targets, extras, commands and options, and their ``curl`` lines run against the example
project.
"""

from __future__ import annotations

import ast
import io
import json
import logging
import logging.config
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command, get_commands, load_command_class

from django_idempotency import _check_ids, conf, states
from tests import docs_code, quickstart

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

pytestmark = pytest.mark.skipif(
    not (DOCS / "index.md").is_file(), reason="the docs are not here (tox tests the wheel)"
)

PACKAGE = ROOT / "django_idempotency"
SITE = "https://django-idempotency.readthedocs.io/en/latest/"


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    text: str


def pages() -> list[Path]:
    return [*sorted(DOCS.glob("*.md")), ROOT / "README.md", ROOT / "CONTRIBUTING.md"]


def blocks(path: Path) -> list[Block]:
    found = []
    lines = path.read_text().splitlines(keepends=True)
    i = 0
    while i < len(lines):
        opening = re.match(r"^```(\S*)\s*$", lines[i])
        if opening:
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            found.append(Block(path.name, i + 1, opening.group(1), "".join(lines[i + 1 : j])))
            i = j
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in pages() for block in blocks(path)]


def shown_sections() -> dict[str, str]:
    """The code of every file the docs may show, and of every section of those files."""
    found = {}
    for prefix in docs_code.TESTED_SOURCES:
        paths = sorted(ROOT.glob(prefix + "**/*.py")) if prefix.endswith("/") else [ROOT / prefix]
        for path in paths:
            relative = str(path.relative_to(ROOT))
            found[relative] = docs_code.section(relative, None)
            for name in re.findall(r"# --8<-- \[start:([\w-]+)\]", path.read_text()):
                found[f"{relative}:{name}"] = docs_code.section(relative, name)
    return found


# --- code blocks -------------------------------------------------------------------------------


def test_every_code_block_is_of_a_tested_kind() -> None:
    kinds = {block.lang for block in all_blocks()}
    assert kinds <= {"python", "sh", "text", "mermaid", "sql", "yaml", "ini"}, kinds
    assert all(block.lang for block in all_blocks())


def test_every_python_block_of_the_docs_copies_a_tested_file() -> None:
    """Each block names its source (a tested file or a section of one) right above it."""
    copied = {
        (code.page.name, code.line)
        for page in docs_code.pages()
        for code in docs_code.shown_code(page)
        if not code.source.startswith("tests/audit/")  # text: the audit's reports
        and code.page.parent == DOCS
    }
    on_pages = {(b.page, b.line) for b in all_blocks() if b.lang == "python"}
    python = {(page, line) for page, line in on_pages if (DOCS / page).is_file()}
    assert python == copied
    assert len(copied) >= 25


def test_the_code_shown_is_the_code_of_its_source_byte_for_byte() -> None:
    stale = [f"{code.where} ({code.source})" for code in docs_code.out_of_sync()]
    assert not stale, f"run `make docs-code`: these blocks are not their source's code: {stale}"


def test_a_changed_source_is_seen_and_written_back(tmp_path: Path) -> None:
    """The check and the writer, on a copy of a page: a block whose source moved on is
    reported, and writing it makes it that source's code again."""
    page = DOCS / "recovery.md"
    (code,) = docs_code.shown_code(page)
    copy = tmp_path / "recovery.md"
    copy.write_text(page.read_text().replace(code.expected, code.expected + "x = 1\n"))
    (stale,) = docs_code.shown_code(copy)
    assert stale.shown != stale.expected
    assert docs_code.write(copy)
    assert copy.read_text() == page.read_text()
    assert not docs_code.write(copy)


def load_hooks() -> Any:
    """``docs/hooks.py``, loaded from its file as MkDocs loads it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec
    assert spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_page_shows_an_include_line_raw() -> None:
    """GitHub shows a page as it is: no pymdownx.snippets line anywhere, and a page that is a
    file of the repository on the site links to that file."""
    hooks = load_hooks()
    included = 0
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        assert not re.search(r"^\s*--8<--", text, re.M), page.name
        for path in re.findall(r"^<!-- include: (\S+) -->$", text, re.M):
            assert f"](../{path})" in text, f"{page.name} does not link to {path} on GitHub"
            rendered = hooks.include_files(text, ROOT)
            assert (ROOT / path).read_text() in rendered
            assert f"](../{path})" not in rendered  # no link the site could not follow
            included += 1
    assert included == 4


def test_every_python_block_of_the_readme_is_a_step_of_its_quickstart() -> None:
    """The README's Python blocks are the installation and the quickstarts, each naming the
    file it goes into: test_quickstart.py pastes them, in order, into a new project."""
    copied = {code.line for code in docs_code.shown_code(ROOT / "README.md")}
    readme = [
        block
        for block in blocks(ROOT / "README.md")
        if block.lang == "python" and block.line not in copied  # the beat schedule
    ]
    pastes = quickstart.pastes()
    assert [block.text for block in readme] == [paste.code for paste in pastes]
    assert {paste.path for paste in pastes} >= {
        "mysite/settings.py",
        "mysite/urls.py",
        "orders/models.py",
        "orders/views.py",
    }


def test_the_quickstarts_import_only_django_drf_and_the_package() -> None:
    import sys

    for paste in quickstart.pastes():
        compile(paste.code, paste.path, "exec")
        others = quickstart.imported_modules(paste.code) - quickstart.ALLOWED_IMPORTS
        assert others <= sys.stdlib_module_names, f"{paste.path}: {others}"


def test_the_quickstart_names_nothing_it_does_not_import_or_define() -> None:
    """Every name a block uses is imported or defined by it, or, for a block added at the end
    of a file, a variable that file had before (startproject's settings define
    INSTALLED_APPS): a block imports every module it names itself, so that it reads, and
    pastes, without the blocks before it."""
    import builtins

    # What startproject's settings.py defines, for the blocks added at its end.
    known: dict[str, set[str]] = {"mysite/settings.py": {"INSTALLED_APPS"}}
    for paste in quickstart.pastes():
        tree = ast.parse(paste.code)
        # What an earlier block of the file assigned carries over; what it imported does not.
        assigned = known[paste.path] if paste.append else set()
        known[paste.path] = assigned
        defined = set(assigned)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
                assigned.add(node.id)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
        used = {
            node.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
        }
        missing = used - defined - set(dir(builtins))
        assert not missing, f"{paste.path}: {missing}"


def test_the_readme_webhook_line_replays_a_stripe_redelivery(db: Any) -> None:
    """The README's webhook decorator, as written, on a view that records each event: a
    redelivery whose body changed in Stripe's bookkeeping is replayed, not refused 422."""
    from django.http import JsonResponse
    from django.test import RequestFactory

    from django_idempotency import sources
    from django_idempotency.decorators import idempotent
    from example_project.recipes.models import WebhookEvent

    (line,) = re.findall(r"^- \*\*Webhooks\*\*: `(@idempotent\(.*\))`$", README(), re.M)
    # The decorator expression, as the README writes it, with the two imports it names.
    names = {"idempotent": idempotent, "sources": sources, "__builtins__": {}}
    decorate = eval(line[1:], names)

    @decorate
    def webhook(request: Any) -> Any:
        event = json.loads(request.body)
        WebhookEvent.objects.create(sender="stripe", event_id=event["id"], type=event["type"])
        return JsonResponse({"received": event["id"]})

    def deliver(pending: int) -> Any:
        event = {"id": "evt_readme", "type": "charge.succeeded", "pending_webhooks": pending}
        body = json.dumps(event)
        return webhook(RequestFactory().post("/", body, content_type="application/json"))

    first, again = deliver(2), deliver(1)
    assert (first.status_code, again.status_code) == (200, 200)
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert WebhookEvent.objects.filter(event_id="evt_readme").count() == 1


def README() -> str:
    return (ROOT / "README.md").read_text()


def make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))


def extras() -> set[str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def installable() -> set[str]:
    """What ``pip install`` may name: the package (on PyPI, or found in the wheels built into
    a clone's ``dist/``), and the clone by its absolute path."""
    return {"django-idempotency", CLONE}


REPOSITORY = "https://github.com/django-idempotency/django-idempotency.git"
#: Where the README's installation clones the repository: a path that holds from any folder.
CLONE = "$HOME/django-idempotency"


def command_options(name: str) -> set[str]:
    assert name in get_commands(), f"no management command {name!r}"
    parser = load_command_class(get_commands()[name], name).create_parser("manage.py", name)
    return {option for action in parser._actions for option in action.option_strings}


def shell_commands(text: str) -> list[list[str]]:
    joined = text.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            commands.append(words)
    return commands


def check_synopsis(words: list[str]) -> None:
    """``python manage.py NAME [--option VALUE] ...``: the command and its options exist."""
    assert words[:2] == ["python", "manage.py"], words
    options = command_options(words[2])
    for word in words[3:]:
        option = word.strip("[]").split("=")[0]
        if option.startswith("-"):
            assert option in options, f"{words[2]} has no option {option}"


def curl_lines() -> list[tuple[Block, list[str]]]:
    """The ``curl`` lines of the docs; the README's quickstart has its own project."""
    return [
        (block, words)
        for block in all_blocks()
        if block.lang == "sh" and block.page != "README.md"
        for words in shell_commands(block.text)
        if words[0] == "curl"
    ]


def test_shell_blocks_name_real_targets_extras_and_commands() -> None:
    targets, known_extras = make_targets(), extras()
    checked = 0
    for block in all_blocks():
        if block.lang != "sh":
            continue
        for words in shell_commands(block.text):
            checked += 1
            if words[0] == "make":
                assert set(words[1:]) <= targets, f"{block.page}:{block.line}: {words}"
            elif words[:2] == ["git", "clone"]:
                assert words[2:] == [REPOSITORY, CLONE], words
            elif words[:5] == ["python", "-m", "pip", "wheel", "--no-deps"]:
                assert words[5:] == ["--wheel-dir", f"{CLONE}/dist", CLONE], words
            elif words[:2] == ["pip", "install"]:
                if words[2] == "--find-links":
                    assert words[3] == f"{CLONE}/dist", words
                    words = words[:2] + words[4:]
                (spec,) = words[2:]
                name, _, rest = spec.partition("[")
                assert name in installable(), f"{block.page}:{block.line}: {name}"
                assert set(filter(None, rest.rstrip("]").split(","))) <= known_extras, spec
            elif words[0] == "python":
                check_synopsis(words)
            else:
                assert words[0] == "curl", f"{block.page}:{block.line}: {words}"
    assert checked >= 10


def test_text_blocks_are_synopses_or_the_stats_output(db: Any) -> None:
    out = io.StringIO()
    call_command("idempotency_stats", stdout=out)
    stats = out.getvalue()
    # Copies of the audit's reports, which tests/test_audit.py compares with the command's
    # output byte for byte (and the test above with the page).
    reports = {
        (code.page.name, code.line)
        for page in docs_code.pages()
        for code in docs_code.shown_code(page)
        if code.source.startswith("tests/audit/")
    }
    for block in all_blocks():
        if block.lang != "text" or (block.page, block.line) in reports:
            continue
        first = block.text.splitlines()[0]
        if first.startswith("python manage.py"):
            for words in shell_commands(block.text):
                check_synopsis(words)
            continue
        # A sample of idempotency_stats: every label it shows is one the command prints.
        for line in block.text.splitlines():
            label = re.split(r"\s{2,}", line.strip())[0]
            assert label in stats, f"{block.page}:{block.line}: {label!r} is not in the output"


def test_ini_blocks_are_pgbouncer_databases_as_the_bursts_run_them() -> None:
    """An ``ini`` block is a PgBouncer ``[databases]`` section, each entry of the form
    ``tests.poolers.PgBouncer`` writes for ``tests/test_bursts.py`` (a pool of its own per
    database name)."""
    from tests.poolers import PgBouncer

    harness = PgBouncer.__new__(PgBouncer)
    harness.upstream, harness.pool_size = ("10.0.0.5", 5432), 3
    harness.pools, harness.port, harness.root = {"shop_claims": ("shop", 8)}, 6432, ROOT
    harness.log, harness.query_wait_timeout = ROOT / "pgbouncer.log", 5
    shape = re.compile(r"^[\w.]+ = host=[\w.]+ (?:port=\d+ )?dbname=\w+ pool_size=\d+$")
    written = [line for line in harness.config().splitlines() if line.startswith("shop_claims")]
    assert written
    assert all(shape.match(line.replace(" port=5432", "")) for line in written)
    found = [block for block in all_blocks() if block.lang == "ini"]
    assert found
    for block in found:
        head, *entries = block.text.strip().splitlines()
        assert head == "[databases]", f"{block.page}:{block.line}"
        for entry in entries:
            assert shape.match(entry), f"{block.page}:{block.line}: {entry!r}"


def test_yaml_blocks_are_ci_steps_that_run_real_commands() -> None:
    yaml = pytest.importorskip("yaml")
    commands = []
    for block in all_blocks():
        if block.lang != "yaml":
            continue
        steps = yaml.safe_load(block.text)
        assert isinstance(steps, list), f"{block.page}:{block.line}: a list of steps"
        for step in steps:
            assert set(step) <= {"name", "run", "uses", "with", "env"}, step
            commands += shell_commands(step.get("run", ""))
    assert commands
    for words in commands:
        if words[:2] == ["python", "manage.py"]:
            check_synopsis(words)
        else:
            assert words[:3] == ["python", "-m", "pytest"], words
    assert any(words[2:3] == ["idempotency_audit"] for words in commands)


# --- the state diagram -------------------------------------------------------------------------


def diagram_edges() -> dict[tuple[str, str], str]:
    (diagram,) = [b for b in blocks(DOCS / "how-it-works.md") if b.lang == "mermaid"]
    lines = [line.strip() for line in diagram.text.splitlines()]
    assert lines[0] == "stateDiagram-v2"
    edges = {}
    for line in lines[1:]:
        if line.startswith("direction"):
            continue
        match = re.fullmatch(r"(\w+) --> (\w+) : (.+)", line)
        assert match, f"not a transition: {line}"
        edges[(match.group(1), match.group(2))] = match.group(3)
    return edges


def test_the_state_diagram_is_the_states_module() -> None:
    module = {(src or "absent", dst): label for (src, dst), label in states.TRANSITIONS.items()}
    assert diagram_edges() == module
    shown = {state for edge in diagram_edges() for state in edge}
    assert shown == {"absent", states.RELEASED, *states.STATUSES}


# --- settings, checks, private names -----------------------------------------------------------


def documented_settings() -> dict[str, str]:
    text = (DOCS / "settings.md").read_text()
    parts = re.split(r"^## `([A-Z_]+)`\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_setting_is_documented_with_its_type_and_default() -> None:
    documented = documented_settings()
    assert set(documented) == set(conf.DEFAULTS)
    for name, text in documented.items():
        first = text.strip().split(". ")[0]
        assert first.startswith("`"), f"{name}: no type in {first!r}"
        assert "default" in first, f"{name}: no default in {first!r}"


def check_ids() -> list[str]:
    """Every id the package's checks can emit, in order: the table of ``_check_ids``."""
    errors = [_check_ids.error(name) for name in _check_ids.ERRORS]
    return errors + [_check_ids.warning(name) for name in _check_ids.WARNINGS]


def test_every_check_is_raised_somewhere_by_its_name() -> None:
    # A name of the table is emitted by the code (a setting's Error by its entry of
    # conf.SETTINGS), so the table holds no id that nothing raises.
    source = "\n".join(path.read_text() for path in PACKAGE.glob("*.py"))
    for name in [*_check_ids.ERRORS, *_check_ids.WARNINGS]:
        assert name in conf.BY_NAME or f'"{name}"' in source, name


def test_every_check_id_is_documented_and_every_documented_id_exists() -> None:
    page = (DOCS / "checks.md").read_text()
    table = re.findall(r"^\| `(django_idempotency\.[EW]\d{3})` \|", page, re.M)
    assert table == check_ids()  # every id, once, in the order of _check_ids
    mentioned = set(re.findall(r"django_idempotency\.[EW]\d{3}", page))
    for path in (ROOT / "tests").glob("test_*.py"):
        mentioned |= set(re.findall(r"django_idempotency\.[EW]\d{3}", path.read_text()))
    assert mentioned <= set(table), mentioned - set(table)


def private_names() -> set[str]:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_the_docs_name_no_private_name_of_the_package() -> None:
    private = private_names()
    assert len(private) >= 50  # the scan sees the package
    shown = "".join(path.read_text() for path in pages())
    shown += "".join(shown_sections().values())
    named = set(re.findall(r"(?<![\w.])_[a-z]\w*", shown)) & private
    assert not named


def test_the_readme_shows_the_beat_schedule_to_copy() -> None:
    """★ Public API: the Celery tasks, "with the beat schedule to copy shown in the README":
    the tested celery.py section, byte for byte, naming each of the package's tasks."""
    shown = [block.text for block in blocks(ROOT / "README.md") if block.lang == "python"]
    schedule = docs_code.section("example_project/celery.py", "celery-app")
    assert schedule in shown
    for task in ("purge_expired", "recover_stale_leases", "relay_outbox"):
        assert f'"task": "django_idempotency.{task}"' in schedule


def readme_settings() -> dict[str, str]:
    """The README's table of settings: each row's name and default."""
    section = README().split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([A-Z_]+)` \| (.*?) \|", section, re.M)
    return dict(rows)


def test_the_readme_documents_every_setting_with_its_default() -> None:
    """★ Public API: the settings' names "are yours; document them all in the README"."""
    documented = readme_settings()
    assert set(documented) == set(conf.DEFAULTS)
    assert all(default.strip() for default in documented.values())


def test_the_deployment_page_has_the_table_of_topologies() -> None:
    """★ Beyond one database server: "the docs' deployment page has a table of topologies
    with what holds on each"."""
    text = (DOCS / "deployment.md").read_text()
    section = text.split("\n## Topologies: what holds on each\n", 1)[1].split("\n## ", 1)[0]
    assert "| topology | what holds | settings it needs | test |" in section
    for topology in ("Galera", "synchronous standby", "asynchronous standby", "per tenant"):
        assert re.search(rf"^\| [^|]*{topology}[^|]* \| [^|]+ \|", section, re.M), topology


def test_the_readme_shows_the_signature_checked_before_the_claim_for_each_sender() -> None:
    """★ Where the key comes from: the signature check runs before the claim, "the README
    shows this for Stripe, GitHub and Standard Webhooks": each recipe's tested view, its
    verifying decorator above ``@idempotent``."""
    shown = [block.text for block in blocks(ROOT / "README.md") if block.lang == "python"]
    for sender in ("stripe", "github", "standard"):
        view = docs_code.section(f"example_project/recipes/{sender}_webhooks.py", "view")
        assert view in shown, sender
        assert view.index("@verify_before_claim(") < view.index("@idempotent(")


def test_readme_links_to_the_site_name_existing_pages() -> None:
    links = re.findall(re.escape(SITE) + r"([\w-]*)/?(#[\w-]+)?", (ROOT / "README.md").read_text())
    assert len(links) >= 10
    for page, _anchor in links:
        assert page == "" or (DOCS / f"{page}.md").is_file(), page


def test_the_readme_keeps_the_two_commands_at_the_top() -> None:
    top = (ROOT / "README.md").read_text().splitlines()[:6]
    assert top[2] == "```sh"
    assert top[3].startswith("make demo   # ")
    assert top[4].startswith("make test   # ")
    assert len((ROOT / "README.md").read_text().splitlines()) <= 560


def test_the_readme_lists_the_demos_options_with_the_makefiles_defaults() -> None:
    """The table under the README's two commands: every variable of the example project's
    targets, each with the default the Makefile gives it."""
    makefile = (ROOT / "Makefile").read_text()
    defaults = dict(re.findall(r"^(STORM_PORT|DEMO_ADDR|EXAMPLE_\w+) \?= (\S+)$", makefile, re.M))
    top = README().split("\n## ", 1)[0]
    table = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", top, re.M))
    assert set(table) == {"DEMO_ADDR", "STORM_PORT", "EXAMPLE_DB", "EXAMPLE_TASKS_RECEIPTS"}
    for name, default in table.items():
        assert defaults[name] == default, name
    assert f"`EXAMPLE_PGDATABASE`, default `{defaults['EXAMPLE_PGDATABASE']}`" in top
    # The two commands still open the README, and say where the demo serves.
    assert f"then the server on {defaults['DEMO_ADDR']}" in top


# --- the Grafana dashboard ---------------------------------------------------------------------


def test_the_grafana_dashboard_queries_metrics_that_exist() -> None:
    dashboard = json.loads((DOCS / "grafana" / "django-idempotency.json").read_text())
    metrics = (PACKAGE / "metrics.py").read_text()
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"django_idempotency_\w+", target["expr"]))
    assert len(queried) >= 10
    for name in queried:
        base = re.sub(r"_(total|created)$", "", name)
        assert f'"{base}"' in metrics, f"{name} is not a metric of django_idempotency.metrics"


# --- the examples run --------------------------------------------------------------------------


@pytest.fixture
def user() -> Any:
    """A caller; the test's own ``django_db`` mark opens the database."""
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_user("docs", password="docs")


def post(user: Any, key: str) -> Any:
    from django.test import RequestFactory

    request = RequestFactory().post(
        "/orders/", data="{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )
    request.user = user
    return request


@pytest.mark.django_db(transaction=True, databases=["default", "provider"])
def test_the_function_views_shown_run_once_per_key(user: Any) -> None:
    pytest.importorskip("rest_framework")
    from example_project.docs_examples import views
    from example_project.payments.models import Charge, ProviderCall

    first = views.create_order(post(user, "k1"))
    again = views.create_order(post(user, "k1"))
    assert (first.status_code, again.status_code) == (201, 201)
    assert again["Idempotent-Replayed"] == "true"
    assert views.PayoutView.as_view()(post(user, "k2")).status_code == 201

    views.create_charge(post(user, "k3"))
    replay = views.create_charge(post(user, "k3"))
    assert replay["Idempotent-Replayed"] == "true"
    assert Charge.objects.filter(user=user).count() == 1
    assert ProviderCall.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_run_once_outbox_and_sender_examples(user: Any) -> None:
    pytest.importorskip("celery")
    from django_idempotency.models import OutboxMessage
    from django_idempotency.outbox import Undeliverable
    from example_project.docs_examples import consumers
    from example_project.payments.models import Charge

    charge = Charge.objects.create(user=user, amount=1000, currency="EUR", provider_charge_id="p")
    assert consumers.handle_delivery("event-1", charge.pk) == "(receipt sent)"
    assert consumers.handle_delivery("event-1", charge.pk) == "(receipt sent)"
    charge.refresh_from_db()
    assert charge.description == "(receipt sent)"  # the body ran once

    consumers.refund_and_notify(charge)
    (message,) = OutboxMessage.objects.all()
    assert (message.task, message.args) == ("payments.send_receipt", [charge.pk])
    consumers.send(message)
    assert consumers.producer.sent[-1][:2] == ("receipts", str(message.id))
    message.task = "unknown.task"
    with pytest.raises(Undeliverable):
        consumers.send(message)


@pytest.mark.django_db(transaction=True)
def test_the_steps_example_ships_each_line_once_across_a_crash() -> None:
    from django_idempotency.testing import crash_after, expire_lease
    from example_project.docs_examples import steps

    steps.carrier.shipped.clear()
    steps.carrier.notified.clear()
    lines = [{"id": 1, "sku": "red"}, {"id": 2, "sku": "blue"}, {"id": 3, "sku": "green"}]
    # The consumer dies inside the second line's step, after the carrier took the parcel.
    with crash_after("example_project.docs_examples.steps.Carrier.ship", on_call=2):
        steps.handle_order_message(7, lines)
    expire_lease("order:7")
    done = steps.handle_order_message(7, lines)
    assert done == {"order": 7, "parcels": ["P-7-1", "P-7-2", "P-7-3"]}
    assert steps.handle_order_message(7, lines) == done  # a redelivery: the stored result
    # The first line once; the second twice (the crash came inside its step); the third once.
    assert steps.carrier.shipped == [(7, "red"), (7, "blue"), (7, "blue"), (7, "green")]
    assert steps.carrier.notified == [7]


@pytest.mark.django_db(transaction=True)
def test_operations_examples(user: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("prometheus_client")
    from django_idempotency.signals import request_conflicted
    from example_project.docs_examples import operations

    report = operations.nightly()
    assert report["complete"] is True
    assert report["deleted"] == 0
    assert operations.backlog() == {"expired": 0, "stale": 0}
    assert operations.stuck_claims() == 0
    before = operations.conflicts["charges.create"]
    request_conflicted.send(sender=object, operation="charges.create", key="k", account="a")
    assert operations.conflicts["charges.create"] == before + 1

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    names = {metric.name for metric in operations.metrics_registry().collect()}
    assert "django_idempotency_oldest_in_progress_seconds" in names
    assert "django_idempotency_resumable_records" in names


def test_the_settings_shown_are_valid() -> None:
    from django.core import checks
    from django.test import override_settings

    from example_project.docs_examples import settings_examples as shown

    with override_settings(IDEMPOTENCY=shown.IDEMPOTENCY):
        errors = [e for e in checks.run_checks() if e.id and e.id.startswith("django_idempotency")]
    assert not errors
    assert "django_idempotency" in shown.INSTALLED_APPS

    logger = logging.getLogger("django_idempotency")
    saved = (logger.handlers[:], logger.level)
    try:
        logging.config.dictConfig(shown.LOGGING)
        assert logger.level == logging.INFO
    finally:
        logger.handlers[:], logger.level = saved[0], saved[1]

    assert {"Idempotent-Replayed", "Retry-After"} <= set(shown.CORS_EXPOSE_HEADERS)
    assert "idempotency-key" in shown.CORS_ALLOW_HEADERS


def test_the_celery_app_shown_finds_and_schedules_the_package_tasks(settings: Any) -> None:
    """The Celery page's celery.py, run as a project runs it: its configuration comes from
    Django's settings (CELERY_...), and its beat schedule names each of the package's tasks,
    with arguments the task takes."""
    pytest.importorskip("celery")
    import inspect

    from django_idempotency import tasks
    from example_project import celery, celery_app

    assert celery_app is celery.app  # the __init__.py shown loads it with Django
    settings.CELERY_TASK_DEFAULT_QUEUE = "from-django-settings"
    shown: dict[str, Any] = {}
    exec(docs_code.section("example_project/celery.py", "celery-app"), shown)
    app = shown["app"]
    assert app.conf.task_default_queue == "from-django-settings"
    package = [tasks.purge_expired, tasks.recover_stale_leases, tasks.relay_outbox]
    assert {task.name for task in package} <= set(app.tasks)
    schedule = app.conf.beat_schedule
    assert {entry["task"] for entry in schedule.values()} == {task.name for task in package}
    for entry in schedule.values():
        task = app.tasks[entry["task"]]
        inspect.signature(task.run).bind(*entry.get("args", ()), **entry.get("kwargs", {}))
        assert entry["schedule"] > 0


# --- curl lines, against the example project ---------------------------------------------------


def as_request(words: list[str], base: str) -> dict[str, Any]:
    request: dict[str, Any] = {"method": "GET", "headers": {}}
    args = iter(words[1:])
    for word in args:
        if word == "-u":
            request["auth"] = tuple(next(args).split(":", 1))
        elif word == "-H":
            name, _, value = next(args).partition(":")
            request["headers"][name.strip()] = value.strip()
        elif word == "-d":
            request["content"] = next(args)
            request["method"] = "POST"
        elif word == "-X":
            request["method"] = next(args)
        elif word == "-i":
            continue
        else:
            request["url"] = word.replace("http://127.0.0.1:8000", base)
    return request


def test_the_curl_lines_create_one_charge_and_replay_it(example: Any) -> None:
    import httpx

    from example_project.docs_examples.client_usage import pay

    lines = curl_lines()
    assert len(lines) >= 2
    for block, words in lines:
        request = as_request(words, example.url)
        url = request.pop("url")
        first = httpx.request(url=url, timeout=30, **request)
        again = httpx.request(url=url, timeout=30, **request)
        assert first.status_code == 201, f"{block.page}:{block.line}: {first.text}"
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.content == first.content
    assert pay(example.url)["amount"] == 1000


# --- the API reference -------------------------------------------------------------------------


def test_the_api_reference_renders_docstrings_without_sphinx_roles() -> None:
    """mkdocstrings renders Markdown: a ``:func:`x``` role would show as written."""
    import importlib
    import inspect

    reference = (DOCS / "reference.md").read_text()
    names = re.findall(r"^::: ([\w.]+)$", reference, re.M)
    # Rendered without their members (the models: their fields are the admin's business).
    bare = set(re.findall(r"^::: ([\w.]+)\n    options:\n      members: false$", reference, re.M))
    assert len(names) >= 20
    assert bare
    for name in names:
        module_name, _, attribute = name.rpartition(".")
        try:
            obj = importlib.import_module(name)
        except ImportError:
            obj = getattr(importlib.import_module(module_name), attribute)
        docs = [inspect.getdoc(obj) or ""]
        if inspect.isclass(obj) and name not in bare:
            docs += [inspect.getdoc(m) or "" for n, m in vars(obj).items() if not n.startswith("_")]
        for doc in docs:
            assert not re.search(r":(func|class|meth|exc|data|attr):`", doc), name


# --- SQL, on PostgreSQL --------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_sql_blocks_run_on_postgresql() -> None:
    from django.db import connection, transaction

    if connection.vendor != "postgresql":
        pytest.skip("the SQL shown is PostgreSQL's (TEST_DB=postgres runs it)")
    shown = [block for block in all_blocks() if block.lang == "sql"]
    assert shown
    for block in shown:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(block.text)
            transaction.set_rollback(True)  # what it changes stays in this test


def test_the_readmes_client_contract_never_says_a_503_kept_nothing_when_its_outcome_is_kept() -> (
    None
):
    """A ``503`` ``idempotency_record_unreadable`` answers a key whose outcome is stored (and
    never runs again within its TTL): a client told "nothing was kept" would think the
    operation never happened. The README's line for ``503`` names that case."""
    readme = (ROOT / "README.md").read_text()
    contract = readme.split("## The client's contract", 1)[1].split("\n## ", 1)[0]
    (item,) = [text for text in re.split(r"\n(?=\d+\. )", contract) if "`503`" in text]
    assert "idempotency_record_unreadable" in item, item
    client = (ROOT / "example_project" / "client.py").read_text()
    comment = client.split("# 409: still running elsewhere.", 1)[1].split("retry =", 1)[0]
    assert "idempotency_record_unreadable" in comment, comment
