"""A small DRF project that serves one create endpoint, plain or protected by one library.

``BENCH_VARIANT`` picks what protects ``POST /charges/``: ``plain`` (nothing), ``ours``
(``django_idempotency.drf.IdempotencyMixin``), ``dik`` (django-idempotency-key 1.3.0) or
``dfi`` (drf-idempotency 1.0.0). The alternatives are importable only in the separate venv
``benchmarks/.venv-alternatives``; ``plain`` runs in both.
"""
