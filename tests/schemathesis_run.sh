#!/usr/bin/env bash
# schemathesis against the example project's OpenAPI schema, on a throwaway server.
#
# The example project runs on a fresh SQLite database in a temporary folder (the demo user
# demo/demo created), served by `manage.py runserver --noreload` on a free port of 127.0.0.1.
# schemathesis generates requests from /api/schema/ and checks that no answer is a server
# error and that every status, header and body is the one the schema documents. Each
# generated request carries a fresh Idempotency-Key (tests/schemathesis_hooks.py).
#
# Bounded: ST_MAX_EXAMPLES cases per operation and phase (default 25), and the whole run is
# stopped after ST_TIMEOUT seconds (default 300: about 50 s alone on 2 cores, and CI runs it
# beside the soak), which fails it.
#
#   bash tests/schemathesis_run.sh            # from the repository's root or anywhere
#   ST_MAX_EXAMPLES=200 bash tests/schemathesis_run.sh
#   ST_SEED=<the Seed a failed run printed> bash tests/schemathesis_run.sh   # replay a run
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
SCHEMATHESIS=${SCHEMATHESIS:-$(dirname "$PYTHON")/schemathesis}
MAX_EXAMPLES=${ST_MAX_EXAMPLES:-25}
TIMEOUT=${ST_TIMEOUT:-300}

workdir=$(mktemp -d)
server=
cleanup() {
    if [[ -n $server ]]; then
        kill "$server" 2>/dev/null || true
        wait "$server" 2>/dev/null || true
    fi
    rm -rf "$workdir"
}
trap cleanup EXIT

export EXAMPLE_DB=sqlite
export EXAMPLE_SQLITE_PATH=$workdir/db.sqlite3
export EXAMPLE_PROVIDER_LATENCY=0
export EXAMPLE_CELERY_EAGER=1
# No DEBUG pages: an error answers like it would in production.
export EXAMPLE_DEBUG=0
# Basic auth on every request: a fast password hash, or most of a second goes to PBKDF2.
export EXAMPLE_FAST_PASSWORDS=1

"$PYTHON" manage.py migrate --verbosity 0
"$PYTHON" manage.py ensure_demo_user --username demo --password demo --verbosity 0

port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
base=http://127.0.0.1:$port
"$PYTHON" manage.py runserver --noreload "127.0.0.1:$port" >"$workdir/server.log" 2>&1 &
server=$!

if ! "$PYTHON" - "$base/api/schema/" <<'EOF'
import sys, time, urllib.request
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2)
        sys.exit(0)
    except OSError:
        time.sleep(0.2)
sys.exit(1)
EOF
then
    echo "the example project did not start on $base" >&2
    cat "$workdir/server.log" >&2
    exit 1
fi

status=0
SCHEMATHESIS_HOOKS=tests.schemathesis_hooks PYTHONPATH=. timeout "$TIMEOUT" "$SCHEMATHESIS" run \
    "$base/api/schema/" \
    --auth demo:demo \
    --checks not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance \
    --max-examples "$MAX_EXAMPLES" \
    --workers 1 \
    --request-timeout 10 \
    --suppress-health-check too_slow \
    --no-color \
    ${ST_SEED:+--seed "$ST_SEED"} || status=$?

if ((status != 0)); then
    echo "schemathesis failed (exit $status); the server's log:" >&2
    tail -n 50 "$workdir/server.log" >&2
fi
exit $status
