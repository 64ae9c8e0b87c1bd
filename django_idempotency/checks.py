"""System checks for the ``IDEMPOTENCY`` setting (ids ``django_idempotency.E0xx``/``W0xx``).

Every entry has an Error id of its own (every id is listed in :mod:`._check_ids`),
checked by the same rules the settings object applies at run time. The check never raises:
a value that cannot be validated is reported as an Error of its entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register

from django_idempotency import _check_ids, _database_checks, _validation, conf


def _warning(name: str, msg: str, hint: str) -> Warning:
    return Warning(msg, hint=hint, id=_check_ids.warning(name))


def _error(name: str, msg: str, hint: str) -> Error:
    return Error(msg, hint=hint, id=_check_ids.error(name))


@register(Tags.compatibility)
def check_settings(**kwargs: Any) -> list[CheckMessage]:
    """Validate ``IDEMPOTENCY`` and its interplay with ``DATABASES``."""
    values, problems = conf.validate()
    messages: list[CheckMessage] = [Error(p.message, hint=p.hint, id=p.id) for p in problems]
    if "_" in values.get("HEADER", ""):
        messages.append(
            _warning(
                "HEADER_UNDERSCORE",
                f"IDEMPOTENCY['HEADER'] ({values['HEADER']!r}) has an underscore: runserver, "
                "gunicorn and nginx drop a request header so named by default, so the key "
                "would never reach the view (every request refused as without a "
                "key, or, with keys optional, run unprotected).",
                hint=f"Spell it with hyphens: {values['HEADER'].replace('_', '-')!r}.",
            )
        )
    if "DATABASE" in values:
        messages += _check_database(values["DATABASE"])
    claims = values.get("CLAIM_DATABASE")
    if claims and claims != values.get("DATABASE") and "CLAIM_TIMEOUT" in values:
        # (CLAIM_DATABASE naming DATABASE itself is E038's, not a connection to bound.)
        messages += _check_claim_database(values["CLAIM_DATABASE"], values["CLAIM_TIMEOUT"])
    if claims and "DATABASE" in values:
        messages += _check_claim_tenant(values["DATABASE"], claims)
        if claims != values["DATABASE"]:
            messages += _check_claim_transactions(claims)
    return messages


def _check_claim_transactions(claims: str) -> Iterable[CheckMessage]:
    """E038: ``CLAIM_DATABASE``'s entry opens transactions of its own (``ATOMIC_REQUESTS``, as
    a copy of ``DATABASE``'s entry often carries, or ``AUTOCOMMIT`` off). Its claims must
    commit at once: inside such a transaction every claim made in a caller's transaction
    would be refused when it comes (``ImproperlyConfigured``, a ``500`` for a request)."""
    database = settings.DATABASES[claims]
    opened = [
        name
        for name, opens in (
            ("ATOMIC_REQUESTS", bool(database.get("ATOMIC_REQUESTS", False))),
            ("AUTOCOMMIT", not database.get("AUTOCOMMIT", True)),
        )
        if opens
    ]
    if opened:
        said = " and ".join(
            "ATOMIC_REQUESTS is on" if name == "ATOMIC_REQUESTS" else "AUTOCOMMIT is off"
            for name in opened
        )
        yield _error(
            "CLAIM_DATABASE",
            f"IDEMPOTENCY['CLAIM_DATABASE'] ({claims!r}) opens transactions of its own "
            f"({said} for it): its claims must commit at once, so every claim made inside "
            "a caller's transaction would be refused.",
            hint=(
                f"Leave ATOMIC_REQUESTS off and AUTOCOMMIT on for {claims!r} (a copy of "
                "another DATABASES entry carries them along); the requests keep their "
                "transactions on the other aliases."
            ),
        )


def _check_claim_tenant(alias: str, claims: str) -> Iterable[CheckMessage]:
    """E038: ``DATABASE``'s backend keeps a tenant schema on the connection (django-tenants'
    ``set_tenant``) and ``CLAIM_DATABASE``'s cannot take one: a claim would be made in the
    claim connection's own schema, not in the caller's tenant's."""
    from django.db.utils import load_backend

    def keeps_a_tenant(name: str) -> bool:
        try:
            wrapper = load_backend(settings.DATABASES[name]["ENGINE"]).DatabaseWrapper
        except Exception:  # an engine that cannot be loaded: the database checks say so
            return False
        return callable(getattr(wrapper, "set_tenant", None))

    if keeps_a_tenant(alias) and not keeps_a_tenant(claims):
        yield _error(
            "CLAIM_DATABASE",
            f"IDEMPOTENCY['DATABASE'] ({alias!r}) keeps a tenant schema on its connection, "
            f"but IDEMPOTENCY['CLAIM_DATABASE'] ({claims!r}) has an ENGINE that cannot: its "
            "claims would be made outside the caller's tenant.",
            hint=(
                f"Give {claims!r} the ENGINE of {alias!r} (django_tenants.postgresql_backend), "
                "so that each claim follows the caller's tenant."
            ),
        )


def _check_claim_database(alias: str, timeout: Any) -> Iterable[CheckMessage]:
    """W011: CLAIM_DATABASE may wait longer than CLAIM_TIMEOUT to connect: the watchdog
    bounds the claim's statements, not the connect, which its own settings bound."""
    database = settings.DATABASES[alias]
    options = database.get("OPTIONS", {})
    limit = timeout.total_seconds()
    engine = database.get("ENGINE", "")
    pool = options.get("pool")
    waits: list[str] = []
    if pool:
        # OPTIONS["pool"] = True is a pool of psycopg-pool's defaults: it waits 30 s.
        waited = pool.get("timeout", 30) if isinstance(pool, dict) else 30
        if float(waited) > limit:
            waits.append(f"its pool's timeout ({waited} s)")
    if engine.endswith(("postgresql", "mysql")):
        connect = options.get("connect_timeout")
        if connect is None:
            waits.append("no connect_timeout in its OPTIONS (a connect may wait for ever)")
        elif float(connect) <= 0 or float(connect) > max(limit, 2):  # 0: no timeout at all
            waits.append(f"its connect_timeout ({connect} s)")
    if waits:
        yield _warning(
            "CLAIM_CONNECT_MAY_WAIT",
            f"IDEMPOTENCY['CLAIM_DATABASE'] ({alias!r}) may wait longer than CLAIM_TIMEOUT "
            f"({timeout}) for a connection: {'; '.join(waits)}.",
            hint=(
                "Set OPTIONS['connect_timeout'] (and a pool's timeout) of that alias at or "
                "below CLAIM_TIMEOUT, so that a claim that cannot be had fails closed in time."
            ),
        )


@register(Tags.compatibility)
def check_outbox_sender(**kwargs: Any) -> list[CheckMessage]:
    """The outbox's sender can be imported: the default one needs Celery (E037), unless
    the outbox serves Django's Tasks framework (``tasks_backend.OutboxBackend``), whose
    messages the relay hands to a Tasks backend.

    Not a wrong value of the setting, so requests are not refused over it, and a project
    that never calls ``enqueue()`` may silence it (``SILENCED_SYSTEM_CHECKS``).
    """
    raw = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(raw, Mapping):  # E001, reported by check_settings
        return []
    if not conf.sender_lacks_celery(raw.get("OUTBOX_SENDER", conf.DEFAULT_OUTBOX_SENDER)):
        return []
    if conf.tasks_through_outbox():  # the relay hands those messages to a Tasks backend
        return []
    return [
        _error(
            "OUTBOX_SENDER_WITHOUT_CELERY",
            "IDEMPOTENCY['OUTBOX_SENDER'] is the Celery sender (the default), but Celery is "
            "not installed: relay_outbox cannot send the outbox's messages.",
            hint=(
                "Install Celery (pip install 'django-idempotency[celery]'), or set "
                "IDEMPOTENCY['OUTBOX_SENDER'] to a sender of your own. A project that never "
                "calls enqueue() can add 'django_idempotency.E037' to SILENCED_SYSTEM_CHECKS."
            ),
        )
    ]


def _audit() -> Any:
    """The URL audit the checks of the URLconf read, or ``None`` where a view's attribute is
    wrong (the audit and the view report that)."""
    from django.core.exceptions import ImproperlyConfigured

    from django_idempotency._endpoints import audit

    try:
        return audit()
    except ImproperlyConfigured:
        return None


@register(Tags.urls)
def check_shared_operations(**kwargs: Any) -> list[CheckMessage]:
    """E060: endpoints of two routes that derive one operation name (one basename under two
    routers, ``v1/`` and ``v2/``; one ninja ``operation_id`` in two APIs; two actions of a
    viewset with one ``idempotency_operation``). They would share their records: a key sent
    to one replays the other's outcome, and its own view never runs. An operation the
    project gives one of them (``operation=``, ``idempotency_operation`` on a view that is
    no viewset, a basename of its own) settles it. The spellings of one endpoint (DRF's
    format suffixes) are one operation."""

    report = _audit()
    if report is None:
        return []
    shared = report.shared
    return [
        _error(
            "OPERATION_SHARED",
            f"{len(endpoints)} endpoints derive the one operation {operation!r}: "
            f"{', '.join(f'{e.method} {e.url}' for e in endpoints)}. A key sent to one "
            "would replay another's outcome, and its own view would never run.",
            hint=(
                "Give all but one an operation of its own: another basename where a "
                "viewset is registered (router.register(..., basename='charge-v2')), "
                "idempotency_operation on a view that is no viewset (on a viewset it names "
                "every action: override get_idempotency_operation there), or "
                "@idempotent(operation=...) (a ninja operation_id names the operation in its "
                "API's schema only)."
            ),
        )
        for operation, endpoints in shared.items()
    ]


@register(Tags.urls)
def check_drf_dispatch(**kwargs: Any) -> list[CheckMessage]:
    """E061: ``method_decorator(idempotent, name="dispatch")`` on a DRF view. The claim would
    come before DRF's authentication, permissions and throttles: the view refuses its first
    request (``ImproperlyConfigured``), and the audit lists it unprotected."""
    from django_idempotency import _protection

    views: set[str] = set()
    for callback in _protection.callbacks():
        view = getattr(callback, "cls", None)  # DRF's as_view() names its class so
        if _protection.marker(callback) is not None and _protection.is_drf_view(view):
            views.add(_validation.name_of(view))
    return [
        _error(
            "DECORATOR_ON_DRF_DISPATCH",
            f"@idempotent on the dispatch of the DRF view {name}: its claim would come before "
            "DRF's authentication, permission and throttle checks, so the view refuses "
            "every request.",
            hint=(
                "Put IdempotencyMixin first in the view's bases, or "
                'method_decorator(idempotent, name="post") on its handler (a viewset\'s '
                'action: name="create").'
            ),
        )
        for name in sorted(views)
    ]


@register(Tags.urls)
def check_ninja_decorator_off_ninja(**kwargs: Any) -> list[CheckMessage]:
    """E063: ninja's ``@idempotent`` on a view that is no ninja operation (a Django view, a
    DRF view's handler: the wrong import). It protects only an operation ninja builds from
    the function, and ninja builds none: the view runs unprotected."""
    import importlib.util

    if importlib.util.find_spec("ninja") is None:
        return []  # the decorator cannot have been used
    from django_idempotency import _protection
    from django_idempotency.ninja import intended

    views: set[str] = set()
    for callback in _protection.callbacks():
        if _protection.ninja_path_view(callback) is not None:
            continue
        handlers: list[Any] = [callback]
        view_class = getattr(callback, "cls", None) or getattr(callback, "view_class", None)
        if isinstance(view_class, type):
            handlers += [
                getattr(view_class, method.lower())
                for method in _protection.class_methods(view_class, callback)
            ]
        for handler in handlers:
            if _protection.options_of(handler, closures=False) is not None:
                continue  # the package's own decorator protects it
            if any(
                intended(f) is not None for f in _protection.wrapped_by(handler, closures=False)
            ):
                views.add(_validation.name_of(handler))
    return [
        _error(
            "NINJA_IDEMPOTENT_OFF_NINJA",
            f"django_idempotency.ninja.idempotent on {name}, which is no django-ninja "
            "operation: it protects only an operation ninja builds from the function, so "
            "the view runs unprotected.",
            hint=(
                "Use django_idempotency.decorators.idempotent on a Django or DRF view, "
                "and django_idempotency.ninja.idempotent beneath a ninja route decorator."
            ),
        )
        for name in sorted(views)
    ]


@register(Tags.urls)
def check_ninja_routes_out_of_reach(**kwargs: Any) -> list[CheckMessage]:
    """E062: ninja's ``@idempotent`` above two route decorators of one function. ninja keeps
    the operation of the last one only, so the decorator protects that route and never
    reaches the one beneath it, which runs unprotected."""

    report = _audit()
    if report is None:
        return []
    endpoints = report.endpoints
    return [
        _error(
            "NINJA_IDEMPOTENT_ABOVE_ROUTES",
            f"ninja @idempotent on {e.view} is above the route decorator of {e.method} "
            f"{e.url} and another one: it never reached that route's operation, which runs "
            "unprotected.",
            hint=(
                "Put @idempotent beneath every route decorator of the function, right above "
                "the def."
            ),
        )
        for e in endpoints
        if e.unreached
    ]


@register()
def check_claim_database(**kwargs: Any) -> list[CheckMessage]:
    """``CLAIM_DATABASE`` on another engine or SQLite file than ``DATABASE`` (E051, told
    from the settings): on every ``check``, ``runserver`` and ``migrate``, as no
    database-tagged check is on Django 6.1 without ``--database``."""
    values, problems = conf.validate()
    alias = values.get("DATABASE")
    if problems or alias is None:
        return []  # a wrong setting is reported by check_settings
    return _database_checks.not_the_same_database(alias, values.get("CLAIM_DATABASE"), None)


@register(Tags.database)
def check_database(databases: Iterable[str] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """``check --database <alias>``: the package's tables on ``DATABASE`` (E052), and
    ``CLAIM_DATABASE`` on the same database as ``DATABASE`` where only the connections
    tell (E051; :func:`check_claim_database` tells it from the settings)."""
    values, problems = conf.validate()
    alias = values.get("DATABASE")
    if problems or alias is None:
        return []  # a wrong setting is reported by check_settings
    chosen = tuple(databases or ())
    return [
        *_database_checks.not_the_same_database(alias, values.get("CLAIM_DATABASE"), chosen),
        *_database_checks.missing_tables(alias, chosen),
    ]


@register(Tags.database)
def check_sealed_outcomes(
    databases: Iterable[str] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """``check --database <alias>``: outcomes and step results sealed with a key that
    ``ENCRYPTION_KEYS`` does not hold (E026). They are refused until that key is configured
    again: a key was removed (or the keys emptied) before ``rotate_idempotency_encryption``
    resealed them."""
    values, problems = conf.validate()
    alias = values.get("DATABASE")
    if problems or alias is None or alias not in (databases or ()):
        return []  # a wrong setting is reported by check_settings
    from collections import Counter

    from django.db import DatabaseError

    from django_idempotency import crypto

    def read() -> tuple[dict[str, int], dict[str, int]]:
        return crypto.missing_key_ids(alias), crypto.missing_step_key_ids(alias)

    missing: Counter[str] = Counter()
    steps: Counter[str] = Counter()
    where: dict[str, list[str]] = {}
    try:
        schemas = _database_checks.tenant_schemas(alias)
        # Under django-tenants, each tenant's schema (E052 names one without the tables).
        found = (
            {"": read()}
            if schemas is None
            else _database_checks.in_each_schema(alias, schemas, read)
        )
    except DatabaseError:  # not migrated yet (migrate runs the database checks first)
        return []
    for schema, (outcomes, results) in found.items():
        missing.update(outcomes)
        steps.update(results)
        for kid in outcomes.keys() | results.keys():
            where.setdefault(kid, []).append(schema)
    return [
        _error(
            "SEALED_WITH_A_MISSING_KEY",
            f"{_sealed_rows(missing.get(kid, 0), steps.get(kid, 0))} on {alias!r}"
            f"{_in_schemas(where[kid])} sealed "
            f"with the key {kid}, which IDEMPOTENCY['ENCRYPTION_KEYS'] does not hold: "
            "their retries are refused (503 idempotency_record_unreadable, RecordUnreadable) "
            "until it is configured again.",
            hint=(
                "Put the key back into ENCRYPTION_KEYS (after the first), run manage.py "
                "rotate_idempotency_encryption, and remove it only once that is done. The "
                "records leave at their TTL like any other."
            ),
        )
        for kid in sorted(missing.keys() | steps.keys())
    ]


def _in_schemas(schemas: list[str]) -> str:
    """``" (in the schemas of the tenants 'a', 'b')"``; nothing outside django-tenants."""
    named = [schema for schema in schemas if schema]
    if not named:
        return ""
    listed = ", ".join(repr(schema) for schema in named[:5])
    if len(named) > 5:
        listed += f" and {len(named) - 5} more"
    which = "the schema of the tenant" if len(named) == 1 else "the schemas of the tenants"
    return f" (in {which} {listed})"


def _sealed_rows(outcomes: int, steps: int) -> str:
    """``"2 stored outcomes and 1 step result are"``, without what counts none."""
    parts = [f"{outcomes} stored outcome{'s' if outcomes != 1 else ''}"] if outcomes else []
    if steps:
        parts.append(f"{steps} step result{'s' if steps != 1 else ''}")
    return " and ".join(parts) + (" is" if len(parts) == 1 and outcomes + steps == 1 else " are")


@register(Tags.compatibility)
def check_tenant_apps(**kwargs: Any) -> list[CheckMessage]:
    """W030: schemas per tenant (django-tenants' ``SHARED_APPS`` and ``TENANT_APPS``) with
    the package among the shared apps only. Every tenant's records are then in the public
    schema's one table, where user 1 of one tenant and user 1 of another are one account:
    a key sent in one tenant would replay another tenant's outcome."""
    shared = getattr(settings, "SHARED_APPS", None)
    tenant = getattr(settings, "TENANT_APPS", None)
    if not isinstance(shared, (list, tuple)) or not isinstance(tenant, (list, tuple)):
        return []
    if not _database_checks.names_this_app(shared) or _database_checks.names_this_app(tenant):
        return []
    return [
        _warning(
            "RECORDS_IN_SHARED_SCHEMA",
            "django_idempotency is in SHARED_APPS but not in TENANT_APPS: the records of "
            "every tenant share the public schema's table, and an account that two tenants "
            "both have (user:1) shares its records between them.",
            hint=(
                "Put django_idempotency in TENANT_APPS, so each tenant's schema has its own "
                "records and outbox (see the scaling page's schemas per tenant); or keep one "
                "shared table with an ACCOUNT_RESOLVER whose accounts name the tenant, and "
                "silence this warning."
            ),
        )
    ]


@register(Tags.database)
def check_synchronous_standby(
    databases: Iterable[str] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """``check --database <alias>`` on PostgreSQL: a primary with streaming standbys, none of
    them synchronous (or ``synchronous_commit`` at ``local`` or ``off``), while an operation's
    recovery policy needs a durable claim: ``"fail"``, ``"resume"`` or a callable (W020). A
    claim committed on the primary may not have reached the standby that takes over: the
    retry then finds no record and runs the operation again, which the first two promise
    never to do, and which the callable is never asked about."""
    values, problems = conf.validate()
    alias = values.get("DATABASE")
    if problems or alias is None or alias not in (databases or ()):
        return []
    from django_idempotency._vendors import of

    sql = of(alias).replication_sql
    if sql is None:
        return []
    policies = _never_twice_policies(values["RECOVERY"])
    if not policies:
        return []
    row = _server_row(alias, sql)
    if row is None:
        return []
    names, commit, standbys, unsynchronised = row
    if not standbys or (names and commit not in ("local", "off") and not unsynchronised):
        return []
    if not names:
        why = "synchronous_standby_names is empty"
    elif commit in ("local", "off"):
        why = f"synchronous_commit is {commit!r}"
    else:
        why = f"synchronous_standby_names does not name {unsynchronised} of them"
    return [
        _warning(
            "NO_SYNCHRONOUS_STANDBY",
            f"{alias!r} streams to {standbys} standby server{'s' if standbys != 1 else ''}, "
            f"not all synchronously ({why}), and {', '.join(policies)} use the recovery policy "
            "'fail', 'resume' or a callable: after a failover, a claim the standby never "
            "received is lost, and a retry runs that operation again, its policy never "
            "asked.",
            hint=(
                "Name the standby in synchronous_standby_names (synchronous_commit 'on', "
                "'remote_write' or 'remote_apply'), for the whole server or for the role "
                "the idempotency database connects as; see the deployment page's topologies."
            ),
        )
    ]


@register(Tags.database)
def check_statement_size(
    databases: Iterable[str] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """``check --database <alias>`` on MariaDB and MySQL: a ``max_allowed_packet`` below
    1 MiB (W040). The engine reads the server's limit before a completion only for an
    outcome that would not fit in 1 MiB; below that, a smaller outcome could be refused by
    the server, which drops the connection, and its request would answer 503 and run again
    on every retry."""
    values, problems = conf.validate()
    alias = values.get("DATABASE")
    if problems or alias is None or alias not in (databases or ()):
        return []
    from django_idempotency._vendors import of
    from django_idempotency._vendors.mysql import ANY_SERVER

    sql = of(alias).packet_limit_sql
    if sql is None:
        return []
    row = _server_row(alias, sql)
    if row is None:
        return []
    limit = int(row[0])
    if limit >= ANY_SERVER:
        return []
    return [
        _warning(
            "SMALL_PACKET",
            f"{alias!r} takes statements of at most {limit} bytes (max_allowed_packet): a "
            "response or result whose completion is larger is refused by the server, which "
            "drops the connection; such a request answers 503 and runs again on every retry.",
            hint=(
                f"Set max_allowed_packet to at least {ANY_SERVER} bytes (MariaDB's default "
                "is 16 MiB), and MAX_RESPONSE_BYTES below half of it."
            ),
        )
    ]


def _server_row(alias: str, sql: str) -> tuple[Any, ...] | None:
    """The row a database check's statement reads from the server of ``alias``; ``None``
    where it cannot be read (unreachable: the first request says so, ``503``; or a role
    that may not read those settings)."""
    from django.db import DatabaseError, connections

    try:
        with connections[alias].cursor() as cursor:
            cursor.execute(sql)
            row: tuple[Any, ...] = cursor.fetchone()
    except DatabaseError:
        return None
    return row


def _never_twice_policies(default: Any) -> list[str]:
    """What uses a recovery policy whose claim must be durable (``"fail"``, ``"resume"``, a
    callable: every one but ``"retry"``): the ``RECOVERY`` setting, and the operations the
    URL audit finds with such a policy of their own."""
    from django_idempotency import _endpoints
    from django_idempotency._policies import recovery_policy
    from django_idempotency._recovery import recovery_name

    def durable(policy: Any) -> bool:
        return policy is not None and recovery_policy(policy).durable_claim

    found = []
    if durable(default):
        found.append(f"IDEMPOTENCY['RECOVERY'] ({recovery_name(default)!r})")
    try:
        endpoints = _endpoints.audit().endpoints
    except Exception:  # a URLconf that does not import: reported by Django's own checks
        endpoints = []
    operations = sorted({e.operation for e in endpoints if durable(e.recovery) and e.operation})
    if operations:
        found.append("the operations " + ", ".join(repr(o) for o in operations[:5]))
        if len(operations) > 5:
            found[-1] += f" and {len(operations) - 5} more"
    return found


def _check_database(alias: str) -> Iterable[CheckMessage]:
    # Where the views' writes go unless they say otherwise: 'default' without routers (W002),
    # else what the routers answer for the project's models (W010). Elsewhere, the record's
    # completion no longer commits in one transaction with the business state.
    hint = (
        "The record completes in the same transaction as the view's writes only for "
        "writes to this database; writes to other databases are not covered."
    )
    if not settings.DATABASE_ROUTERS:
        if alias != "default":
            yield _warning(
                "DATABASE_NOT_DEFAULT",
                f"IDEMPOTENCY['DATABASE'] is {alias!r}, not 'default'.",
                hint=hint,
            )
        return
    write_alias = _routed_write_alias()
    if write_alias is not None and alias != write_alias:
        yield _warning(
            "DATABASE_NOT_ROUTED",
            f"IDEMPOTENCY['DATABASE'] is {alias!r}, but DATABASE_ROUTERS send the project's "
            f"writes to {write_alias!r}.",
            hint=hint,
        )


def _routed_write_alias() -> str | None:
    """The alias ``db_for_write`` answers for most of the project's models, or ``None``.

    The project's models are those outside ``django.contrib`` and this app; a project made
    only of contrib apps is judged by those.
    """
    from collections import Counter

    from django.apps import apps
    from django.db import router

    models = [m for m in apps.get_models() if m._meta.app_label != "django_idempotency"]
    own = [m for m in models if not m.__module__.startswith("django.contrib.")]
    try:
        votes = Counter(router.db_for_write(model) for model in own or models)
    except Exception:  # a router that cannot answer without a request: nothing to compare
        return None
    return votes.most_common(1)[0][0] if votes else None
