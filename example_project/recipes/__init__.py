"""Recipes: webhook endpoints (Stripe, GitHub, Standard Webhooks), a queue consumer and a
management command, each made safe to run twice with django-idempotency.

Each module is the code the README shows, and each has its test in ``tests/``.
"""
