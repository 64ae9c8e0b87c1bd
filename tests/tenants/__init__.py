"""Schemas per tenant with django-tenants (tests/test_tenants.py, ``make test-tenants``).

The tenant model and its domains live in the shared (``public``) schema; the package's
records, outbox and audit tables, and the test app's charges, in each tenant's schema.
"""
