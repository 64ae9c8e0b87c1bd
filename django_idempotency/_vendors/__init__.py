"""What the package needs of a database, one module per vendor: the only place that tells
one database from another.

:class:`Vendor` lists every difference the engine, the maintenance and the checks rely on,
each as a member with its portable default (what any database Django supports is given,
and what this package ran before it knew the vendor). ``postgresql``, ``mysql`` (MariaDB,
MySQL, and Galera's differences) and ``sqlite`` override what they do differently. The
members are the checklist of a new vendor: a module here with a subclass that answers each
of them, registered in :data:`VENDORS`, and the suites run on it.

:func:`of` gives an alias's vendor, looked up once per alias: on the request's path it is
a hit of ``functools.lru_cache`` (no Python call: no hand-off), and the members read there
are plain attributes. Errors are told apart by the driver that raised them
(:func:`retryable`, :func:`connection_lost`): no alias needed where a loop retries.

The migrations keep their own tests of ``connection.vendor``: a migration is history, and
must do the same thing for ever, whatever these members become.
"""

from __future__ import annotations

import functools

from django.db import Error, InterfaceError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency._vendors.base import Vendor
from django_idempotency._vendors.mysql import MySQL
from django_idempotency._vendors.postgresql import PostgreSQL
from django_idempotency._vendors.sqlite import SQLite

__all__ = ["VENDORS", "Vendor", "connection_lost", "of", "of_connection", "retryable"]


#: Every vendor the package knows, by Django's name.
VENDORS: dict[str, Vendor] = {vendor.name: vendor for vendor in (PostgreSQL(), MySQL(), SQLite())}


def of_connection(connection: BaseDatabaseWrapper) -> Vendor:
    """The vendor of ``connection``, asked afresh (the checks, which compare two aliases'
    backends); a database the package has no module for gets the portable defaults, under
    its own name."""
    name = connection.vendor
    return VENDORS.get(name) or Vendor(name)


@functools.lru_cache(maxsize=64)
def of(alias: str) -> Vendor:
    """The vendor of the database ``alias`` names, looked up once per alias."""
    return of_connection(connections[alias])


def retryable(exc: Error, bounded: bool = False) -> bool:
    """Whether the driver that raised ``exc`` asks for its transaction to run again (see
    :meth:`Vendor.retryable`)."""
    return any(vendor.retryable(exc, bounded) for vendor in VENDORS.values())


def connection_lost(exc: Error) -> bool:
    """Whether ``exc`` says that its connection was lost (see
    :meth:`Vendor.connection_lost`): an ``InterfaceError`` (the driver's connection is
    closed already), or what the driver that raised it says."""
    return isinstance(exc, InterfaceError) or any(
        vendor.connection_lost(exc) for vendor in VENDORS.values()
    )
