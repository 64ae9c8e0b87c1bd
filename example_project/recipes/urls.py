"""The recipes' webhook endpoints, under ``/webhooks/``."""

from __future__ import annotations

from django.urls import path

from example_project.recipes.github_webhooks import github_webhook
from example_project.recipes.standard_webhooks import standard_webhook
from example_project.recipes.stripe_webhooks import stripe_webhook

urlpatterns = [
    path("stripe/", stripe_webhook, name="webhook-stripe"),
    path("github/", github_webhook, name="webhook-github"),
    path("standard/", standard_webhook, name="webhook-standard"),
]
