"""The shared schema's models: the tenants, their domains, and what the outbox sent."""

from __future__ import annotations

from django.db import models
from django_tenants.models import DomainMixin, TenantMixin


class Client(TenantMixin):
    """A tenant: its schema holds its records, its outbox and its charges."""

    name = models.CharField(max_length=100)
    auto_create_schema = True

    def __str__(self) -> str:
        return self.name


class Domain(DomainMixin):
    """The host name a tenant is served on."""

    def __str__(self) -> str:
        return str(self.domain)


class Delivery(models.Model):
    """One message handed over by the test sender, and the schema its relay ran in. In the
    shared schema, so that one query counts every tenant's."""

    schema = models.CharField(max_length=63)
    message = models.UUIDField()
    task = models.CharField(max_length=200)
    args = models.JSONField(default=list)

    def __str__(self) -> str:
        return f"{self.schema}: {self.task}"
