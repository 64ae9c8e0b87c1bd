"""A project router of the most common kind: every read to a replica, every write to the
primary (tests/test_standby.py). The package names its alias on each of its queries, so
its records are read where they are written, whatever a router says."""

from __future__ import annotations

from typing import Any


class ReplicaRouter:
    def db_for_read(self, model: Any, **hints: Any) -> str:
        return "replica"

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return "default"

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool:
        return True

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool:
        return db == "default"
