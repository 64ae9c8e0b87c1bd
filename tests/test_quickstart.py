"""The README's quickstart, pasted into a new project, with the built wheel, on PostgreSQL.

A fresh venv gets the wheel with the README's extras and nothing else; ``django-admin
startproject mysite .`` makes the project; every block and ``manage.py`` line of the README's
installation and quickstarts is applied in order (``tests/quickstart.py`` reads them, so the
test breaks when the README drifts); the server runs on a free port. Then the README's
``curl`` request, as a client would send it: first (held on a table lock, so a duplicate
arrives while it runs: ``409``), the replay (byte for byte), the same key with another body
(``422``), no key (``400``), and the rows created, counted. The function views get the same,
through a session from the admin's login. The only line that is the test's own: PostgreSQL
in ``DATABASES``.

Runs with ``RUN_QUICKSTART=1`` (``make test-quickstart``, in CI): it builds a wheel and
installs packages, about a minute.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import pytest

from tests import quickstart
from tests.live import free_port, starting_a_server

pytestmark = [
    pytest.mark.quickstart,
    pytest.mark.skipif(
        os.environ.get("RUN_QUICKSTART") != "1",
        reason="set RUN_QUICKSTART=1 (make test-quickstart)",
    ),
    pytest.mark.skipif(not quickstart.README.is_file(), reason="the README is not here (tox)"),
    pytest.mark.timeout(900),
]

ROOT = quickstart.ROOT
PG = {
    "host": os.environ.get("PGHOST", "127.0.0.1"),
    "port": os.environ.get("PGPORT", "5432"),
    "user": os.environ.get("PGUSER", "postgres"),
}


def run(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{args}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def wait_until(what: str, condition: Callable[[], bool], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.1)


# --- HTTP, as a client sends it -----------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def code(self) -> str:
        assert self.header("Content-Type") == "application/problem+json", self.body
        return str(json.loads(self.body)["code"])

    def cookies(self) -> dict[str, str]:
        jar: SimpleCookie = SimpleCookie()
        for name, value in self.headers:
            if name.lower() == "set-cookie":
                jar.load(value)
        return {key: morsel.value for key, morsel in jar.items()}


@dataclass
class Client:
    base: str
    cookies: dict[str, str] = field(default_factory=dict)

    def send(self, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> Answer:
        url = urlsplit(self.base)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        if self.cookies:
            headers = {**headers, "Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())}
        try:
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            answer = Answer(response.status, response.getheaders(), response.read())
        finally:
            conn.close()
        self.cookies.update(answer.cookies())
        return answer


@dataclass
class Curl:
    """The README's ``curl`` line: what it sends, where."""

    path: str
    headers: dict[str, str]
    body: bytes
    username: str
    password: str

    @classmethod
    def parse(cls, words: list[str]) -> Curl:
        headers, body, user, path = {}, b"", "", ""
        args = iter(words[1:])
        for word in args:
            if word == "-H":
                name, _, value = next(args).partition(":")
                headers[name.strip()] = value.strip()
            elif word == "-d":
                body = next(args).encode()
            elif word == "-u":
                user = next(args)
            elif word.startswith("http"):
                path = urlsplit(word).path
        username, _, password = user.partition(":")
        token = base64.b64encode(user.encode()).decode()
        return cls(path, {**headers, "Authorization": f"Basic {token}"}, body, username, password)


# --- the project --------------------------------------------------------------------------------


@dataclass
class Project:
    path: Path
    python: Path
    database: str
    env: dict[str, str]

    def manage(self, *args: str, **env: str) -> str:
        return run(self.python, "manage.py", *args, cwd=self.path, env={**self.env, **env})

    def count(self, sql: str) -> int:
        import psycopg

        with psycopg.connect(dbname=self.database, autocommit=True, **PG) as conn:
            row = conn.execute(sql).fetchone()
        assert row is not None
        return int(row[0])


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    import psycopg

    name = f"quickstart_{os.getpid()}"
    with psycopg.connect(dbname="postgres", autocommit=True, **PG) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    yield name
    with psycopg.connect(dbname="postgres", autocommit=True, **PG) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def install_from_a_clone(home: Path, python: Path, project: Path) -> None:
    """The README's lines that install from a clone, run from the project folder with
    ``$HOME`` at ``home``: the clone is this checkout's files (committed or not), the rest
    runs as written (``pip`` is the venv's). Installing the clone builds and installs a
    wheel of it, so a file missing from the wheel fails the quickstart."""
    (clone, source, build, wheel) = quickstart.install_lines()
    assert clone[:2] == ["git", "clone"], clone
    assert clone[-1] == "$HOME/django-idempotency", clone
    target = home / "django-idempotency"
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (entry.decode() for entry in listed)):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes((ROOT / name).read_bytes())
    env = {**os.environ, "HOME": str(home)}
    for words in (source, build, wheel):
        line = [os.path.expandvars(w.replace("$HOME", str(home))) for w in words]
        if line[0] == "pip":
            line = [str(python), "-m", "pip", *line[1:]]
        elif line[:3] == ["python", "-m", "pip"]:
            line = [str(python), *line[1:]]
        run(*line, "--quiet", cwd=project, env=env)
    assert list((target / "dist").glob("django_idempotency-*.whl")), "no wheel was built"


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, database: str) -> Project:
    """A new project with the wheel and the README's quickstart; ``runserver`` not yet run."""
    tmp = tmp_path_factory.mktemp("quickstart")
    run(sys.executable, "-m", "venv", tmp / "venv")
    python = tmp / "venv" / "bin" / "python"
    path = tmp / "project"
    path.mkdir()
    install_from_a_clone(tmp, python, path)
    # Nothing of the test or docs tooling came along.
    run(python, "-c", "import importlib.util as u; assert not u.find_spec('pytest')")

    run(tmp / "venv" / "bin" / "django-admin", "startproject", "mysite", ".", cwd=path)
    settings = path / "mysite" / "settings.py"
    # The test's own line: the quickstart on PostgreSQL, in a database of its own.
    connection = {"NAME": database, "HOST": PG["host"], "PORT": PG["port"], "USER": PG["user"]}
    database_line = {"default": {"ENGINE": "django.db.backends.postgresql", **connection}}
    settings.write_text(settings.read_text() + f"\nDATABASES = {database_line!r}\n")

    env = {key: value for key, value in os.environ.items() if not key.startswith("DJANGO_")}
    made = Project(path, python, database, {**env, "PYTHONDONTWRITEBYTECODE": "1"})
    password = Curl.parse(quickstart.first_request()).password
    for step in quickstart.steps():
        if isinstance(step, quickstart.Paste):
            quickstart.apply(step, path)
        elif step.words[:2] == ["python", "manage.py"] and step.words[2] != "runserver":
            args = step.words[2:]
            if args[0] == "createsuperuser":  # the README's user, with the curl line's password
                made.manage(*args, "--noinput", DJANGO_SUPERUSER_PASSWORD=password)
            else:
                made.manage(*args)
    return made


@pytest.fixture(scope="module")
def server(project: Project) -> Iterator[Client]:
    (runserver,) = [w for w in quickstart.commands("python") if w[2] == "runserver"]
    starting_a_server("the quickstart project's runserver")
    port = free_port()
    log = (project.path / "server.log").open("w")
    process = subprocess.Popen(
        [str(project.python), *runserver[1:], "--noreload", f"127.0.0.1:{port}"],
        cwd=project.path,
        env=project.env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client = Client(f"http://127.0.0.1:{port}")

    def answers() -> bool:
        assert process.poll() is None, (project.path / "server.log").read_text()
        try:
            return client.send("GET", "/api/", {}).status == 200
        except OSError:
            return False

    try:
        wait_until("the server answers", answers)
        yield client
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
        log.close()


# --- the DRF quickstart --------------------------------------------------------------------


def test_the_curl_sequence_runs_once_and_replays(project: Project, server: Client) -> None:
    import psycopg

    curl = Curl.parse(quickstart.first_request())
    key = curl.headers["Idempotency-Key"]
    orders = "SELECT count(*) FROM orders_order"
    records = f"SELECT count(*) FROM django_idempotency_record WHERE key = '{key}'"
    before = project.count(orders)  # the function views' terminal trial made one

    # The first request is held at its INSERT by a lock on the orders table: its claim has
    # committed, so the same request sent meanwhile is answered 409 at once.
    first: dict[str, Answer] = {}
    with psycopg.connect(dbname=project.database, **PG) as lock:
        lock.execute("LOCK TABLE orders_order IN SHARE MODE")
        sender = threading.Thread(
            target=lambda: first.update(a=server.send("POST", curl.path, curl.headers, curl.body))
        )
        sender.start()
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO \"orders_order\"%'"
        )
        wait_until("the first request waits on the lock", lambda: project.count(waiting) == 1)
        duplicate = server.send("POST", curl.path, curl.headers, curl.body)
        assert duplicate.status == 409, duplicate.body
        assert duplicate.code() == "idempotency_key_in_use"
        assert duplicate.header("Retry-After")
        assert project.count(orders) == before
        lock.rollback()
    sender.join(timeout=60)
    assert not sender.is_alive()
    original = first["a"]
    assert original.status == 201, original.body
    assert json.loads(original.body)["item"] == "book"
    assert original.header("Idempotent-Replayed") is None

    replay = server.send("POST", curl.path, curl.headers, curl.body)
    assert (replay.status, replay.body) == (original.status, original.body)
    assert replay.header("Content-Type") == original.header("Content-Type")
    assert replay.header("Idempotent-Replayed") == "true"

    changed = json.dumps({**json.loads(curl.body), "quantity": 2}).encode()
    reused = server.send("POST", curl.path, curl.headers, changed)
    assert reused.status == 422, reused.body
    assert reused.code() == "idempotency_key_reused"

    keyless = {k: v for k, v in curl.headers.items() if k != "Idempotency-Key"}
    missing = server.send("POST", curl.path, keyless, curl.body)
    assert missing.status == 400, missing.body
    assert missing.code() == "idempotency_key_missing"

    # One order and one record, whatever was sent.
    assert project.count(orders) == before + 1
    assert project.count(records) == 1


# --- the function views --------------------------------------------------------------------


def signed_in(server: Client, username: str, password: str) -> tuple[Client, dict[str, str]]:
    """A session from the admin's login page, and the headers a page's script would send."""
    session = Client(server.base)
    session.send("GET", "/admin/login/", {})
    form = {"username": username, "password": password, "next": "/admin/"}
    form["csrfmiddlewaretoken"] = session.cookies["csrftoken"]
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    login = session.send("POST", "/admin/login/", headers, urlencode(form).encode())
    assert login.status == 302, login.body
    assert "sessionid" in session.cookies
    return session, {
        "Content-Type": "application/json",
        "X-CSRFToken": session.cookies["csrftoken"],
    }


def test_the_function_views_run_once_per_key(project: Project, server: Client) -> None:
    curl = Curl.parse(quickstart.first_request())
    urls = (project.path / "mysite" / "urls.py").read_text()
    paths = re.findall(r'path\("(orders/[^"]+)"', urls)
    orders = "SELECT count(*) FROM orders_order"
    before = project.count(orders)
    # The README's terminal trial (manage.py shell, run with the project's other commands):
    # two posts with one key, one order and one record.
    trial = "SELECT count(*) FROM django_idempotency_record WHERE key = 'try-function-view-1'"
    assert project.count(trial) == 1
    assert project.count("SELECT count(*) FROM orders_order WHERE item = 'pen'") == 1

    # Anonymous, with a key (and a CSRF token): refused before anything is claimed.
    anonymous = Client(server.base)
    anonymous.send("GET", "/admin/login/", {})
    token = {"X-CSRFToken": anonymous.cookies["csrftoken"], "Content-Type": "application/json"}
    headers = {**token, "Idempotency-Key": str(uuid.uuid4())}
    refused = anonymous.send("POST", "/orders/new/", headers, b'{"item": "pen", "quantity": 1}')
    assert refused.status == 403, refused.body
    assert refused.code() == "idempotency_account_missing"
    assert project.count(orders) == before

    session, session_headers = signed_in(server, curl.username, curl.password)
    # Each route, with its body and the orders one run creates; the reorder copies the
    # order the first one made.
    requests = {
        "orders/new/": (b'{"item": "pen", "quantity": 3}', 1),
        "orders/<int:pk>/reorder/": (b"{}", 1),
        "orders/gift/": (b'{"item": "card"}', 1),
        "orders/bulk/": (b'{"items": ["a", "b", "c"]}', 3),
    }
    assert paths == list(requests)
    created, made = 0, ""
    for route, (body, rows) in requests.items():
        path = "/" + route.replace("<int:pk>", made)
        headers = {**session_headers, "Idempotency-Key": str(uuid.uuid4())}
        first = session.send("POST", path, headers, body)
        again = session.send("POST", path, headers, body)
        assert first.status == 201, (path, first.body)
        assert (again.status, again.body) == (first.status, first.body), path
        assert again.header("Idempotent-Replayed") == "true", path
        created += rows
        assert project.count(orders) == before + created, path
        made = made or str(json.loads(first.body)["id"])
