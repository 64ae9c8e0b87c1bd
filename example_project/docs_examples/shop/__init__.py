"""A small shop: the user app that the docs' "Testing your endpoints" page tests.

Orders are paid through a payment gateway and confirmed by e-mail from a Celery task sent
through the outbox. Its test suite (``tests/``) is written with ``django_idempotency.testing``
alone, and each of its tests fails when the protection is taken off the view and the task.
"""
