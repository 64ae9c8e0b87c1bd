"""Test settings. ``TEST_DB`` picks the database: ``sqlite`` (default), ``postgres`` or ``mysql``.

Two more run PostgreSQL through a connection pooler: ``pgbouncer`` (a PgBouncer in transaction
mode that ``python -m tests.poolers pgbouncer`` starts and passes in ``PGPORT``) and
``postgres-pool`` (Django's own pool, ``OPTIONS["pool"]``). On PostgreSQL an unreachable server
fails the run; it is never skipped. ``TEST_DB_PREPARE=N`` sets PostgreSQL's
``OPTIONS["prepare_threshold"]``: the engine's statements are then prepared.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

SECRET_KEY = "django-idempotency-tests"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.testapp.urls"
STATIC_URL = "/static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

TEST_DB = os.environ.get("TEST_DB", "sqlite")
# One test database per run, so that runs (tox envs, a developer and CI) never collide.
TEST_DB_NAME = os.environ.get("TEST_DB_NAME", f"test_django_idempotency_{os.getpid()}")

POSTGRES_DBS = ("postgres", "pgbouncer", "postgres-pool")
DATABASES: dict[str, dict[str, Any]]

if TEST_DB in POSTGRES_DBS:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ.get("DB_NAME", "django_idempotency"),
            "USER": os.environ.get("PGUSER", "postgres"),
            "HOST": os.environ.get("PGHOST", "127.0.0.1"),
            "PORT": os.environ.get("PGPORT", "5432"),
            "TEST": {"NAME": TEST_DB_NAME},
        }
    }
    if TEST_DB == "pgbouncer":
        if "PGPORT" not in os.environ:
            raise RuntimeError("TEST_DB=pgbouncer runs through `python -m tests.poolers pgbouncer`")
        # Transaction pooling hands each transaction to any server connection: a named
        # server-side cursor would not outlive its transaction. (Django keeps psycopg's
        # prepared statements off by default, which this mode needs as well.)
        DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
    elif TEST_DB == "postgres-pool":
        # Django's pool needs CONN_MAX_AGE = 0 (the default). Enough connections for the
        # storms of tests/test_concurrency.py (16 requests at once); a short wait for one, so
        # that with the server down a request answers 503 promptly rather than hanging.
        # TEST_POOL_MAX: a pool sized to a server's threads (tests/test_bursts.py).
        max_size = int(os.environ.get("TEST_POOL_MAX", "24"))
        DATABASES["default"]["OPTIONS"] = {
            "pool": {"min_size": 1, "max_size": max_size, "timeout": 3}
        }
        # Without it the pool hands out connections the server has closed (a restart, a
        # terminated backend), and the next request fails on one.
        DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
    # TEST_DB_PREPARE=N: psycopg prepares a statement after N runs on a connection (0: at its
    # first), as OPTIONS["prepare_threshold"] allows; the engine's statements then run
    # prepared (server-side binding). make test-pg16 and the pool's run use 0.
    if os.environ.get("TEST_DB_PREPARE"):
        DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = int(
            os.environ["TEST_DB_PREPARE"]
        )
elif TEST_DB == "mysql":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            "NAME": os.environ.get("DB_NAME", "django_idempotency"),
            "USER": os.environ.get("MYSQL_USER", "root"),
            "HOST": os.environ.get("MYSQL_HOST", "127.0.0.1"),
            "PORT": os.environ.get("MYSQL_PORT", "3306"),
            "TEST": {"NAME": TEST_DB_NAME},
        }
    }
elif TEST_DB == "sqlite":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("SQLITE_NAME", ":memory:"),
        }
    }
else:
    raise RuntimeError(
        f"TEST_DB must be sqlite, postgres, pgbouncer, postgres-pool or mysql, not {TEST_DB!r}"
    )

# Servers started by the tests may run every request in a transaction (TEST_ATOMIC_REQUESTS).
DATABASES["default"]["ATOMIC_REQUESTS"] = os.environ.get("TEST_ATOMIC_REQUESTS") == "1"

# The fake payment provider writes through a connection of its own, like an external system.
DATABASES["provider"] = {
    **DATABASES["default"],
    "ATOMIC_REQUESTS": False,
    "TEST": {"MIRROR": "default"},
}
# The same database once more, for IDEMPOTENCY["CLAIM_DATABASE"] (tests/test_claim_connection.py);
# and on PostgreSQL through a Django pool of one connection, for a caller that holds it all.
DATABASES["claims"] = {**DATABASES["provider"]}
# A server of tests/test_bursts.py: the claims through a PgBouncer pool of their own (that
# database name), without Django's pool (IDEMPOTENCY from tests/settings_from_env.py).
# Bounded as check W011 asks of a claim database: its connect never waits past CLAIM_TIMEOUT.
# (Not for the servers of tests/test_bursts.py, whose claims wait on a starved PgBouncer by
# design: CLAIM_DATABASE's own pool is what keeps them from being refused there.)
if TEST_DB != "sqlite" and not os.environ.get("TEST_CLAIMS_NAME"):
    DATABASES["claims"]["OPTIONS"] = {
        **DATABASES["claims"].get("OPTIONS", {}),
        "connect_timeout": 2,
    }
if os.environ.get("TEST_CLAIMS_NAME"):
    DATABASES["claims"]["NAME"] = os.environ["TEST_CLAIMS_NAME"]
    DATABASES["claims"]["OPTIONS"] = {
        k: v for k, v in DATABASES["claims"].get("OPTIONS", {}).items() if k != "pool"
    }
if TEST_DB in POSTGRES_DBS:
    DATABASES["pooled"] = {
        **DATABASES["provider"],
        "OPTIONS": {
            **DATABASES["default"].get("OPTIONS", {}),
            "pool": {"min_size": 0, "max_size": 1, "timeout": 3},
        },
        "CONN_MAX_AGE": 0,
    }

# tests/test_outbox_batches.py: the same database through psycopg's server-side binding
# (Django's OPTIONS["server_side_binding"]), where one statement carries at most 65535
# parameters, as PostgreSQL's protocol counts them.
if TEST_DB == "postgres":
    DATABASES["server_binding"] = {
        **DATABASES["provider"],
        "OPTIONS": {**DATABASES["provider"].get("OPTIONS", {}), "server_side_binding": True},
    }

# tests/test_standby.py: the fake provider's ledger on another server than the app's (it
# survives the app's failover, as an external system's would), and a project router that
# sends every read to a streaming standby (``replica``) and every write to the primary.
if os.environ.get("TEST_PROVIDER_NAME"):
    DATABASES["provider"] = {
        **DATABASES["provider"],
        "NAME": os.environ["TEST_PROVIDER_NAME"],
        "PORT": os.environ["TEST_PROVIDER_PORT"],
    }
if os.environ.get("TEST_REPLICA_PORT"):
    DATABASES["replica"] = {
        **DATABASES["provider"],
        "PORT": os.environ["TEST_REPLICA_PORT"],
        "NAME": DATABASES["default"]["NAME"],
    }
    DATABASE_ROUTERS = ["tests.replica_router.ReplicaRouter"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_idempotency",
    "tests.testapp",
]
try:
    import rest_framework  # noqa: F401
except ImportError:  # the tox env without the optional dependencies
    HAS_DRF = False
else:
    HAS_DRF = True
    INSTALLED_APPS.append("rest_framework")
    # The example project's app: its migrations are checked, its models type-checked. (tox
    # runs a copy of tests/ without the example project beside it.)
    if importlib.util.find_spec("example_project") is not None:
        INSTALLED_APPS += [
            "example_project.payments",
            "example_project.recipes",
            # The user app of the docs' testing page, and its test suite's subject.
            "example_project.docs_examples.shop",
        ]

# -- Django's Tasks framework (tests/test_tasks_backend.py, tests/test_tasks_worker.py) -------
# Django 6's django.tasks, or the django-tasks backport on Django 5.2 (which, unlike Django,
# is an app: its checks and the receiver that resets the backends under override_settings).
# Enqueued tasks go through the outbox; the relay hands them to the database backend "worker",
# whose `manage.py db_worker --backend worker` runs them. Absent both, nothing is configured.
HAS_DJANGO_TASKS = importlib.util.find_spec("django_tasks_db") is not None and (
    importlib.util.find_spec("django.tasks") is not None
    or importlib.util.find_spec("django_tasks") is not None
)
if HAS_DJANGO_TASKS:
    if importlib.util.find_spec("django.tasks") is None:
        INSTALLED_APPS.append("django_tasks")
    INSTALLED_APPS.append("django_tasks_db")
    TASKS = {
        "default": {
            "BACKEND": "django_idempotency.tasks_backend.OutboxBackend",
            "OPTIONS": {"DELIVER_TO": "worker"},
        },
        "worker": {
            "BACKEND": "django_tasks_db.DatabaseBackend",
            "QUEUES": ["default", "emails"],
        },
    }
# -- end of Django's Tasks framework ----------------------------------------------------------

# django-ninja is optional too: its operations are served under /ninja/ where it is installed.
HAS_NINJA = importlib.util.find_spec("ninja") is not None

# Without Celery (the tox env `core`) nothing here goes through the outbox's default sender:
# the tests silence its check, as the check's hint tells a project that never enqueues.
if importlib.util.find_spec("celery") is None:
    SILENCED_SYSTEM_CHECKS = ["django_idempotency.E037"]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "rest_framework.authentication.BasicAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}

# The webhook recipes' signing secrets (example_project/recipes/).
STRIPE_WEBHOOK_SECRET = "whsec_test_stripe"
GITHUB_WEBHOOK_SECRET = "test-github-secret"
STANDARD_WEBHOOK_SECRET = "whsec_dGVzdC1zdGFuZGFyZC13ZWJob29rcy1zZWNyZXQ="

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

LOGGING: dict[str, Any] = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"null": {"class": "logging.NullHandler"}},
    "loggers": {"django_idempotency": {"handlers": ["null"], "level": "DEBUG"}},
}

# TEST_LOG_REQUEST_ERRORS=1: a server's unhandled exceptions (its 500s) on its stderr.
if os.environ.get("TEST_LOG_REQUEST_ERRORS") == "1":
    LOGGING["handlers"]["stderr"] = {"class": "logging.StreamHandler"}
    LOGGING["loggers"]["django.request"] = {"handlers": ["stderr"], "level": "ERROR"}
