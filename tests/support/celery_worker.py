"""A real ``celery worker`` (prefork, two child processes) for ``tests/test_celery_tasks.py``.

The worker is a separate OS process group started with ``subprocess.Popen``; it loads
``tests.celery_settings`` (``tests.settings`` plus what the environment variables of
:meth:`CeleryWorker.env` say: where redis-server and the PostgreSQL test database run).
Its broker and result backend are the session's redis-server; its lock backend, the
alias :data:`LOCK_ALIAS`, is the Redis backend on the same server. The test process
sends tasks through the app of :meth:`CeleryWorker.client`, given the same settings
(:func:`celery_conf`), so both sides read them from one place.

Each worker has a name of its own, used as its node name, its queue and the prefix of
its broker keys, so a worker started after another never sees the other's messages.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tests.support.servers import (
    REPO_ROOT,
    InTempRoot,
    ServerUnavailable,
    child_env,
    terminate,
    wait_until_started,
)

#: The alias of ``SYNCGUARD_BACKENDS`` the tasks of ``tests/testapp/tasks.py`` lock on.
LOCK_ALIAS = "tasks"
#: The alias of the tasks that lock in the PostgreSQL test database instead.
DB_LOCK_ALIAS = "tasks-db"
#: Prefix of the lock keys (and of the tasks' gates) in redis-server's database 0.
LOCK_PREFIX = "sgcelery"
#: redis-server's database numbers: the broker's messages and the tasks' results.
BROKER_DB, RESULT_DB = 1, 2
#: The worker's Django settings module.
SETTINGS_MODULE = "tests.celery_settings"

# The environment variables tests/celery_settings.py reads.
ENV_REDIS_PORT = "SYNCGUARD_CELERY_REDIS_PORT"
ENV_PG_PORT = "SYNCGUARD_CELERY_PG_PORT"
ENV_PG_NAME = "SYNCGUARD_CELERY_PG_NAME"
ENV_NAME = "SYNCGUARD_CELERY_NAME"
ENV_VISIBILITY = "SYNCGUARD_CELERY_VISIBILITY_TIMEOUT_S"
#: Set: the worker's main process locks on :data:`DB_LOCK_ALIAS` before its pool
#: forks (``tests/celery_app.py``).
ENV_LOCK_BEFORE_FORK = "SYNCGUARD_CELERY_LOCK_BEFORE_FORK"


def redis_url(port: int, db: int) -> str:
    return f"redis://127.0.0.1:{port}/{db}"


def lock_backend(redis_port: int) -> dict[str, Any]:
    """``SYNCGUARD_BACKENDS[LOCK_ALIAS]``, in the worker and in the test process.

    The tasks' TTLs are short (a test waits for one to run out), so calls to the
    server get a timeout below them (``syncguard.W003``)."""
    return {
        "BACKEND": "django_syncguard.backends.redis.RedisBackend",
        "LOCATION": redis_url(redis_port, 0),
        "KEY_PREFIX": LOCK_PREFIX,
        "OPTIONS": {"OPERATION_TIMEOUT_MS": 500},
    }


def database_lock_backend() -> dict[str, Any]:
    """``SYNCGUARD_BACKENDS[DB_LOCK_ALIAS]``: the database backend on the ``postgres``
    alias (the test database), in the worker and in the test process."""
    return {
        "BACKEND": "django_syncguard.backends.database.DatabaseBackend",
        "OPTIONS": {"DATABASE": "postgres"},
    }


def celery_conf(redis_port: int, name: str, visibility_timeout_s: float | None) -> dict[str, Any]:
    """Celery's settings for worker ``name`` (lower-case names, as ``app.conf`` has them).

    ``visibility_timeout_s``: how long the Redis transport leaves a delivered, unacked
    message alone before it puts it back in the queue (a redelivery); ``None`` keeps
    kombu's default (an hour). Kombu's worker looks for such messages every
    ``unacked_restore_interval`` s, scanning on one call in ``unacked_restore_throttle``
    (kombu/transport/redis.py, ``restore_visible``; defaults 10 s and 10): both are
    lowered with the timeout, so that a redelivery comes soon after it.
    """
    transport: dict[str, Any] = {"global_keyprefix": f"{name}:"}
    if visibility_timeout_s is not None:
        transport |= {
            "visibility_timeout": visibility_timeout_s,
            "unacked_restore_interval": 0.2,
            "unacked_restore_throttle": 1,
        }
    return {
        "broker_url": redis_url(redis_port, BROKER_DB),
        "broker_transport_options": transport,
        "result_backend": redis_url(redis_port, RESULT_DB),
        "task_default_queue": name,
        # A worker reserves no more than one message per child beyond those running.
        "worker_prefetch_multiplier": 1,
        "broker_connection_retry_on_startup": True,
    }


@dataclass
class CeleryWorker(InTempRoot):
    """``celery -A tests.celery_app worker --pool=prefork --concurrency=2``, logging to
    ``root / worker.log``; stopped by its PID (SIGTERM, then SIGKILL to its group)."""

    redis_port: int
    postgres_port: int
    database: str
    visibility_timeout_s: float | None = None
    #: Whether the main process takes a lock on :data:`DB_LOCK_ALIAS` before its
    #: pool forks (the children then inherit its connection).
    lock_before_fork: bool = False
    name: str = field(default_factory=lambda: f"sgw{uuid.uuid4().hex[:10]}")
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="syncguard-celery-")))
    process: subprocess.Popen[bytes] | None = None
    _client: Any = field(default=None, init=False, repr=False)
    _previous_app: Any = field(default=None, init=False, repr=False)
    log_name = "worker.log"
    tail_chars = 6000  # a task's traceback and what led to it
    #: The ``-A`` of ``celery worker``, and the directory it is started in.
    app_module: ClassVar[str] = "tests.celery_app"
    cwd: ClassVar[Path] = REPO_ROOT

    @property
    def node(self) -> str:
        return f"{self.name}@localhost"

    @property
    def conf(self) -> dict[str, Any]:
        return celery_conf(self.redis_port, self.name, self.visibility_timeout_s)

    def env(self) -> dict[str, str]:
        """The worker's environment: this one, plus where its settings find the servers."""
        extra = {
            "DJANGO_SETTINGS_MODULE": SETTINGS_MODULE,
            ENV_REDIS_PORT: str(self.redis_port),
            ENV_PG_PORT: str(self.postgres_port),
            ENV_PG_NAME: self.database,
            ENV_NAME: self.name,
        }
        if self.visibility_timeout_s is not None:
            extra[ENV_VISIBILITY] = str(self.visibility_timeout_s)
        if self.lock_before_fork:
            extra[ENV_LOCK_BEFORE_FORK] = "1"
        return child_env(**extra)

    def client(self) -> Any:
        """The test process's Celery app for this worker, made the current app:
        ``task.delay()`` of a ``@shared_task`` sends to this worker.

        An app of its own, configured as the worker's: an app caches its broker
        connections, so one app re-configured for the next worker would still send
        to the last one's keys."""
        from celery import Celery, current_app

        if self._client is None:
            self._previous_app = current_app._get_current_object()
            self._client = Celery("syncguard_tests")
            self._client.conf.update(self.conf)
        self._client.set_current()
        return self._client

    def start(self, timeout_s: float = 60) -> CeleryWorker:
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            self.app_module,
            "worker",
            "--pool=prefork",
            "--concurrency=2",
            "--loglevel=INFO",
            f"--hostname={self.node}",
            # Nothing to exchange with other workers: starts quicker.
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        log = (self.root / self.log_name).open("wb")
        self.process = subprocess.Popen(
            argv,
            cwd=self.cwd,
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the children go with it
        )
        log.close()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        """Until the worker answers a ping (its pool is up and it consumes)."""
        app = self.client()
        assert self.process is not None
        try:
            wait_until_started(
                self.process,
                lambda: bool(app.control.ping(destination=[self.node], timeout=0.5)),
                time.monotonic() + timeout_s,
                f"celery worker {self.node}",
                self.log_tail,
            )
        except ServerUnavailable:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM (a warm shutdown: running tasks finish), then SIGKILL the group."""
        if self.process is None:
            return
        terminate(self.process, group=True)
        self.process = None
        if self._client is not None:
            self._client.close()  # its broker connections
            self._client = None
            self._previous_app.set_current()  # as it was for the tests after this one
