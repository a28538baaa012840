"""Database routing of the test settings."""

from __future__ import annotations

from typing import Any

#: The app label of django-tasks-db (its task results table).
TASK_QUEUE_APP = "django_tasks_database"


class TaskQueueOnPostgres:
    """Put django-tasks-db's table on the ``postgres`` alias, and only there.

    The database task backend has no setting naming its database: it uses the
    routers. Its workers run against the session's PostgreSQL (row locks with
    ``SKIP LOCKED`` hand each task to one worker), not the SQLite ``default``."""

    alias = "postgres"

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return self.alias if model._meta.app_label == TASK_QUEUE_APP else None

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return self.db_for_read(model, **hints)

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return db == self.alias if app_label == TASK_QUEUE_APP else None
