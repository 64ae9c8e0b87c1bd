"""What a release rests on: the version and its dated changelog section, the metadata of the
package against the tox grid, and the GitHub workflows against ``.ci/run``.

The workflows' syntax is checked by ``make lint`` (yamllint and actionlint); these tests
check what a linter cannot: that the test workflow runs the steps of ``.ci/run``, and that
the release workflow publishes only from a tag, with trusted publishing.
"""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"

pytestmark = pytest.mark.skipif(
    not (ROOT / ".ci" / "run").is_file(), reason="the repository is not here (tox tests the wheel)"
)
# .ci/run's steps that the workflow has no job for: "tools" installs, before the suites that
# run side by side in one venv, what they would install at once; each job installs its own.
SETUP_STEPS = {"tools"}


def project() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"])


def workflow(name: str) -> dict[Any, Any]:
    yaml = pytest.importorskip("yaml")
    loaded: dict[Any, Any] = yaml.safe_load((WORKFLOWS / name).read_text())
    # PyYAML reads GitHub's `on:` as the boolean True.
    loaded["on"] = loaded.pop(True, loaded.get("on"))
    return loaded


# --- the version and the changelog --------------------------------------------------------------


def version() -> str:
    """The version, written once: ``django_idempotency.__version__``."""
    import django_idempotency

    return django_idempotency.__version__


def test_the_version_is_written_once_in_the_package() -> None:
    """pyproject.toml has no version of its own: setuptools reads the package's."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert pyproject["project"]["dynamic"] == ["version"]
    dynamic = pyproject["tool"]["setuptools"]["dynamic"]
    assert dynamic == {"version": {"attr": "django_idempotency.__version__"}}
    assert re.fullmatch(r"\d+\.\d+\.\d+", version()), version()


def test_the_version_has_a_dated_changelog_section_under_unreleased() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (.+)$", changelog, re.M)
    assert headings[0] == "[Unreleased]"
    assert re.fullmatch(rf"\[{re.escape(version())}\] - \d{{4}}-\d{{2}}-\d{{2}}", headings[1])
    # Keep a Changelog's links: each version heading is a link.
    assert f"[{version()}]: " in changelog
    assert "[Unreleased]: " in changelog


def test_the_release_workflow_checks_the_changelog_as_this_test_does() -> None:
    """The release job's own check (a grep) accepts the changelog of this version."""
    (step,) = [
        s
        for s in workflow("release.yml")["jobs"]["build"]["steps"]
        if "CHANGELOG" in s.get("run", "")
    ]
    pattern = re.search(r'grep -Eq "(.+?)" CHANGELOG\.md', step["run"])
    assert pattern
    regex = pattern.group(1).replace("$version", re.escape(version()))
    assert re.search(regex, (ROOT / "CHANGELOG.md").read_text(), re.M)


# --- the package's metadata -----------------------------------------------------------------


def tox_grid() -> set[tuple[str, str]]:
    """The (Python, Django) pairs of tox.ini's env_list: ``py3{12,13}-django{52,60}-...``."""
    text = (ROOT / "tox.ini").read_text()
    env_list = text.split("env_list =", 1)[1].split("\n\n", 1)[0]
    pairs = set()
    for line in env_list.splitlines():
        match = re.match(r"\s*py3(\{[\d,]+\}|\d+)-django(\{[\d,]+\}|\d+)", line)
        if match:
            pythons, djangos = (group.strip("{}").split(",") for group in match.groups())
            for py, dj in itertools.product(pythons, djangos):
                pairs.add((f"3.{py}", f"{dj[0]}.{dj[1:]}"))
    return pairs


def test_the_classifiers_name_every_python_and_django_of_the_tox_grid() -> None:
    grid = tox_grid()
    assert ("3.10", "5.2") in grid
    assert ("3.13", "6.1") in grid
    classifiers = project()["classifiers"]
    pythons = {
        c.rsplit(" :: ", 1)[1]
        for c in classifiers
        if c.startswith("Programming Language :: Python :: 3.")
    }
    djangos = {
        c.rsplit(" :: ", 1)[1] for c in classifiers if c.startswith("Framework :: Django :: ")
    }
    assert pythons == {py for py, _ in grid}
    assert djangos == {dj for _, dj in grid}
    assert (
        project()["requires-python"]
        == f">={min(pythons, key=lambda v: tuple(map(int, v.split('.'))))}"
    )
    assert project()["dependencies"] == [f"Django>={min(djangos)}"]


def test_the_project_links_to_its_docs_changelog_source_and_issues() -> None:
    urls = project()["urls"]
    assert set(urls) >= {"Documentation", "Changelog", "Source", "Issues"}
    site = "https://django-idempotency.readthedocs.io/en/latest/"
    assert urls["Documentation"] == site
    assert urls["Changelog"] == site + "changelog/"
    assert all(url.startswith("https://") for url in urls.values())


# --- the workflows --------------------------------------------------------------------------


def ci_run_steps() -> dict[str, list[str]]:
    """The steps of .ci/run, by name: ``step NAME CMD...`` and ``side_by_side NAME CMD...``."""
    script = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    # A job of several steps (a function of the script's) counts as its steps.
    jobs = set(re.findall(r"^(\w+)\(\) \{", script, re.MULTILINE))
    steps = {}
    for line in script.splitlines():
        words = shlex.split(line, comments=True) if line.strip() else []
        named = len(words) > 2 and words[0] in {"step", "side_by_side"} and words[1] != "$name"
        if named and words[2] not in jobs:
            steps[words[1]] = words[2:]
    return steps


def test_the_test_workflow_runs_the_steps_of_ci_run() -> None:
    steps = ci_run_steps()
    assert {"make test", "make docs", "quickstart", "tox", "storm"} <= set(steps)
    jobs = workflow("test.yml")["jobs"]
    (job,) = jobs.values()
    matrix = job["strategy"]["matrix"]["include"]
    shown = {entry["step"]: shlex.split(entry["run"]) for entry in matrix}
    expected = {name: words for name, words in steps.items() if name not in SETUP_STEPS}
    assert shown == expected
    # The matrix's command is what the job runs.
    assert job["steps"][-1]["run"] == "${{ matrix.run }}"
    assert job["strategy"]["fail-fast"] is False
    on = workflow("test.yml")["on"]
    assert {"push", "pull_request", "workflow_call"} <= set(on)


def test_ci_run_waits_for_every_step_it_starts_beside_another() -> None:
    """A background step that is never waited for could fail and leave CI green."""
    script = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    started = re.findall(r"^side_by_side ([\w-]+) ", script, re.MULTILINE)
    waited = [
        name
        for line in re.findall(r"^wait_side_by_side (.+)$", script, re.MULTILINE)
        for name in line.split()
    ]
    assert started
    assert sorted(started) == sorted(waited)


def ci_run_helpers() -> str:
    """``.ci/run``'s helpers for its steps, as it defines them (the functions, the log
    directory, the table of background jobs and the exit trap), without its steps."""
    script = (ROOT / ".ci" / "run").read_text()
    start = script.index("step() {")
    end = script.index("trap wait_for_the_rest EXIT\n") + len("trap wait_for_the_rest EXIT\n")
    return script[start:end]


@pytest.mark.parametrize(
    "failing",
    [
        "side_by_side broken false\nwait_side_by_side broken",  # a step in the background
        'step "make test" false',  # a step in the foreground
    ],
)
def test_ci_run_waits_for_and_prints_every_background_step_when_another_fails(
    tmp_path: Path, failing: str
) -> None:
    """A failure leaves no background step running after CI (its servers and pytest runs
    would outlive the job) and none unseen: each is waited for and its output printed."""
    import subprocess

    done = tmp_path / "done"
    script = "\n".join(
        [
            "set -euo pipefail",
            ci_run_helpers(),
            f"side_by_side slow bash -c 'sleep 1; echo slow is done; touch {done}'",
            failing,
            "echo not reached",
        ]
    )
    ran = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert ran.returncode == 1, ran
    assert done.exists()  # waited for: it finished before the script exited
    assert "slow is done" in ran.stdout
    assert "==> slow was still running; waiting for it" in ran.stdout
    assert "not reached" not in ran.stdout


def test_the_test_workflow_has_what_ci_run_starts_and_installs() -> None:
    job = next(iter(workflow("test.yml")["jobs"].values()))
    services = {name: spec["image"].split(":")[0] for name, spec in job["services"].items()}
    assert services == {"postgres": "postgres", "mariadb": "mariadb", "redis": "redis"}
    script = (ROOT / ".ci" / "run").read_text()
    packages = set(re.findall(r"missing\+=\(([\w-]+)\)", script))
    installed = " ".join(step.get("run", "") for step in job["steps"])
    for package in packages - {"chromium"}:
        assert package in installed, package
    assert "/usr/bin/chromium" in installed
    versions = job["steps"][1]["with"]["python-version"].split()
    assert set(versions) == {py for py, _ in tox_grid()}


def test_the_release_workflow_publishes_a_tag_with_trusted_publishing() -> None:
    release = workflow("release.yml")
    assert release["on"] == {"push": {"tags": ["v*"]}}
    assert release["permissions"] == {"contents": "read"}
    jobs = release["jobs"]
    assert jobs["tests"]["uses"] == "./.github/workflows/test.yml"
    build = " ".join(step.get("run", "") for step in jobs["build"]["steps"])
    assert "python -m build" in build
    assert "twine check --strict dist/*" in build
    assert '"$GITHUB_REF_NAME" != "v$version"' in build
    assert "print(django_idempotency.__version__)" in build  # the version's one place
    publish = jobs["publish"]
    assert set(publish["needs"]) == {"tests", "build"}
    assert publish["permissions"] == {"id-token": "write"}
    assert publish["environment"]["name"] == "pypi"
    uses = [step.get("uses", "") for step in publish["steps"]]
    assert uses[-1] == "pypa/gh-action-pypi-publish@release/v1"
    assert not any("password" in step.get("with", {}) for step in publish["steps"])
    # Only the publishing job may ask for an OIDC token.
    others = [job for name, job in jobs.items() if name != "publish"]
    assert all("id-token" not in job.get("permissions", {}) for job in others)


# --- the demo's venv ----------------------------------------------------------------------------


def group(name: str) -> set[str]:
    """The names of the packages of a dependency group, its included groups resolved."""
    tomllib = pytest.importorskip("tomllib")
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["dependency-groups"]
    names = set()
    for item in groups[name]:
        if isinstance(item, dict):
            names |= group(item["include-group"])
        else:
            names.add(re.split(r"[\[<>=;! ]", item, maxsplit=1)[0].lower())
    return names


def test_the_demo_installs_nothing_of_the_test_or_docs_tooling() -> None:
    demo = group("demo")
    assert {"gunicorn", "celery"} <= demo
    tooling = (group("test") | group("lint") | group("docs") | group("packaging")) - group(
        "example"
    )
    assert not demo & tooling, demo & tooling
    makefile = (ROOT / "Makefile").read_text()
    assert '-e ".[$(EXTRAS)]" --group demo' in makefile
