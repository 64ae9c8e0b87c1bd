"""Settings shown in the documentation. Nothing here is the example project's own setting."""

from __future__ import annotations

from datetime import timedelta

from corsheaders.defaults import default_headers

# --8<-- [start:installed-apps]
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django_idempotency",
]
# --8<-- [end:installed-apps]

# --8<-- [start:idempotency]
IDEMPOTENCY = {
    "HEADER": "Idempotency-Key",
    "REQUIRED": True,
    "TTL": timedelta(hours=24),
    "LEASE": timedelta(seconds=60),
}
# --8<-- [end:idempotency]

# --8<-- [start:logging]
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_idempotency": {"handlers": ["console"], "level": "INFO"}},
}
# --8<-- [end:logging]

# --8<-- [start:cors]
CORS_ALLOWED_ORIGINS = ["https://shop.example.com"]
CORS_ALLOW_HEADERS = (*default_headers, "idempotency-key")
CORS_EXPOSE_HEADERS = ["Idempotent-Replayed", "Retry-After", "Location"]
# --8<-- [end:cors]

# --8<-- [start:pgbouncer]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": "pgbouncer.internal",
        "PORT": "6432",
        "NAME": "shop",
        # Named cursors do not outlive a transaction, which is all a pooled connection is.
        "DISABLE_SERVER_SIDE_CURSORS": True,
        # Leave OPTIONS["prepare_threshold"] unset (None: no prepared statements), unless
        # PgBouncer is 1.21 or newer with max_prepared_statements set.
    }
}
# --8<-- [end:pgbouncer]

# --8<-- [start:claims]
# The same database through a PgBouncer pool of its own (pgbouncer.ini: shop_claims).
DATABASES["claims"] = {**DATABASES["default"], "NAME": "shop_claims"}
IDEMPOTENCY["CLAIM_DATABASE"] = "claims"
# --8<-- [end:claims]

# --8<-- [start:pool]
DATABASES["default"]["OPTIONS"] = {"pool": {"min_size": 2, "max_size": 20, "timeout": 3}}
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True  # CONN_MAX_AGE stays 0, as the pool needs
# --8<-- [end:pool]

# --8<-- [start:prepared]
DATABASES["default"]["OPTIONS"] = {
    "pool": {"min_size": 2, "max_size": 20, "timeout": 3},  # or CONN_MAX_AGE > 0, no pool
    # The package's statements prepared on their fifth run on a connection (psycopg's
    # default): a direct connection, or PgBouncer 1.21+ with max_prepared_statements.
    "prepare_threshold": 5,
}
# --8<-- [end:prepared]
