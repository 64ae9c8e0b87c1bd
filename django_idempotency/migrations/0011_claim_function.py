"""PostgreSQL's claim as a server-side function, ``django_idempotency_record_claim``.

The claim is one statement whatever the key's state (see ``_vendors.postgresql``). Sent as text
on Django's defaults (no prepared statements, which PgBouncer before 1.21 in transaction
mode cannot keep), the server parsed and planned it on every request: about half a
millisecond, as long as running it. A PL/pgSQL function keeps the plans of its statements
for the life of the server connection, with no named statement in the protocol, so it works
through any pooler; the request sends a one-line call with its values bound.

The statement inside is the claim as it was: the INSERT runs only when no row holds the key
(``NOT EXISTS``: a replay or a conflict writes nothing and takes no transaction id), two new
claims racing for one key meet in ``ON CONFLICT DO NOTHING`` (the unique key picks the
winner), the row in the way is handed back from the statement's snapshot, and under a
recovery policy whose claim need not be durable (``"retry"``, see ``_policies``: the caller
says so in ``p_relaxed_commit``) the claim's commit does not wait for its WAL flush. With a
deadline (a claim a watchdog bounds) the INSERT runs only before it on the server's clock,
and past it a last row of NULLs says so. Other databases are left as they are.
"""

from django.db import migrations

CLAIM_FUNCTION = """
CREATE OR REPLACE FUNCTION django_idempotency_record_claim(
    p_account text,
    p_operation text,
    p_key text,
    p_request_hash text,
    p_fingerprint_version text,
    p_recovery_policy text,
    p_created_at timestamptz,
    p_lease interval,
    p_ttl interval,
    p_deadline timestamptz,
    p_relaxed_commit boolean
) RETURNS TABLE (
    id bigint,
    status text,
    lease_expires_at double precision,
    expires_at double precision,
    request_hash text,
    fingerprint_version text,
    response_status integer,
    response_headers jsonb,
    response_body bytea,
    lease_token uuid,
    relaxed text
) LANGUAGE plpgsql VOLATILE AS $claim$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH late AS MATERIALIZED (
        SELECT p_deadline IS NOT NULL AND clock_timestamp() >= p_deadline AS past
    ), claim AS (
        INSERT INTO django_idempotency_record AS r (
            account, operation, key, request_hash, fingerprint_version, status, lease_token,
            lease_expires_at, recovery_policy, recovery_attempts, response_headers,
            created_at, expires_at
        )
        SELECT p_account, p_operation, p_key, p_request_hash, p_fingerprint_version,
            'in_progress', gen_random_uuid(), p_created_at + p_lease, p_recovery_policy, 0,
            '[]'::jsonb, p_created_at, p_created_at + p_ttl
        WHERE NOT EXISTS (
            SELECT 1 FROM django_idempotency_record AS e
            WHERE e.account = p_account AND e.operation = p_operation AND e.key = p_key
        ) AND NOT (SELECT l.past FROM late AS l)
        ON CONFLICT (account, operation, key) DO NOTHING
        RETURNING r.id, r.lease_token
    )
    SELECT c.id::bigint, NULL::text, NULL::double precision, NULL::double precision,
        NULL::text, NULL::text, NULL::integer, NULL::jsonb, NULL::bytea, c.lease_token,
        CASE WHEN p_relaxed_commit
            THEN set_config('synchronous_commit', 'off', true) END
    FROM claim AS c
    UNION ALL
    SELECT e.id::bigint, e.status::text, date_part('epoch', e.lease_expires_at),
        date_part('epoch', e.expires_at), e.request_hash::text, e.fingerprint_version::text,
        e.response_status::integer, e.response_headers, e.response_body, NULL::uuid, NULL::text
    FROM django_idempotency_record AS e
    WHERE e.account = p_account AND e.operation = p_operation AND e.key = p_key
    UNION ALL
    SELECT NULL::bigint, NULL::text, NULL::double precision, NULL::double precision,
        NULL::text, NULL::text, NULL::integer, NULL::jsonb, NULL::bytea, NULL::uuid, NULL::text
    FROM late AS l WHERE l.past;
END
$claim$
"""

DROP_FUNCTION = (
    "DROP FUNCTION IF EXISTS django_idempotency_record_claim("
    "text, text, text, text, text, text, timestamptz, interval, interval, timestamptz, boolean)"
)


def create(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CLAIM_FUNCTION)


def drop(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP_FUNCTION)


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0010_outbox_unique_key"),
    ]

    operations = [migrations.RunPython(create, drop, elidable=False)]
