"""Worker processes of django-tasks-db (``manage.py db_worker``), started for a test.

Each worker is a separate OS process (``python -m django db_worker``) with its own
log file (stdout and stderr); they run the tasks queued on the ``database`` alias of
``TASKS`` against the test run's PostgreSQL database and are stopped by their PID.
"""

from __future__ import annotations

import atexit
import functools
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.servers import (
    REPO_ROOT,
    InTempRoot,
    child_env,
    terminate,
    wait_until_started,
)

#: What ``db_worker`` logs once it polls the queue.
READY_LINE = "Starting worker"


@dataclass
class TaskWorkers(InTempRoot):
    """``count`` ``db_worker`` processes named ``worker-1``... (their ``worker_ids``),
    on the database described by ``database`` (a ``DATABASES`` entry)."""

    count: int
    database: dict[str, Any]
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="syncguard-tasks-")))
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    log_name = "worker-1.log"  # InTempRoot's; log_tail shows every worker's

    @property
    def names(self) -> list[str]:
        return [f"worker-{i}" for i in range(1, self.count + 1)]

    def start(self, timeout_s: float = 60) -> TaskWorkers:
        """Start every worker, then wait until each polls the queue."""
        atexit.register(self.stop)
        self.processes = [self._spawn(name) for name in self.names]
        deadline = time.monotonic() + timeout_s
        for name, process in zip(self.names, self.processes, strict=True):
            polling = functools.partial(self._logged, name, READY_LINE)
            wait_until_started(process, polling, deadline, name, self.log_tail)
        return self

    def _logged(self, name: str, line: str) -> bool:
        return line in self._log(name)

    def _spawn(self, name: str) -> subprocess.Popen[bytes]:
        env = child_env(
            DJANGO_SETTINGS_MODULE="tests.support.task_worker_settings",
            SYNCGUARD_WORKER_DATABASE=json.dumps(self.database),
            PYTHONUNBUFFERED="1",  # the log file is current when a test fails
        )
        argv = [sys.executable, "-m", "django", "db_worker", "--backend", "database"]
        argv += ["--worker-id", name, "--interval", "0.05", "--no-startup-delay", "--no-reload"]
        with (self.root / f"{name}.log").open("wb") as log:
            return subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT
            )

    def _log(self, name: str) -> str:
        try:
            return (self.root / f"{name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"

    def log_tail(self) -> str:
        """The end of each worker's output (stdout and stderr)."""
        return "".join(f"\n--- {name} ---\n{self._log(name)[-3000:]}" for name in self.names)

    def stop(self) -> None:
        """SIGTERM each worker (it finishes its task and exits), SIGKILL if it lingers."""
        for process in self.processes:
            terminate(process)
