"""Real servers for the tests, started on free loopback ports and stopped afterwards.

Each server runs from the binaries of this machine image, in a temporary directory,
as an unprivileged user when the tests run as root (PostgreSQL refuses root).
The session's servers are fixtures (``tests/conftest.py``). When ``CI`` is set, a
server that cannot start fails the tests that need it; otherwise they are skipped
with the reason.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

#: The checkout's root: ``tests`` and ``django_syncguard`` import from here.
REPO_ROOT = Path(__file__).resolve().parents[2]
PG_BIN = Path(os.environ.get("SYNCGUARD_PG_BIN", "/usr/lib/postgresql/15/bin"))
#: Whether a server that cannot start fails the tests that need it (else: a skip).
IN_CI = bool(os.environ.get("CI"))


class ServerUnavailable(RuntimeError):
    """A test server could not be started here."""


def extra_installed(module: str) -> bool:
    """Whether ``module`` (that of a pip extra, e.g. ``google.cloud.firestore``) imports."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def import_extra(module: str, extra: str) -> Any:
    """``module``, for a test module that needs a pip extra at import time: without the
    extra, the whole test module is skipped with the pip command (and fails to
    collect when ``CI`` is set, the rule for every missing server)."""
    if IN_CI:
        return importlib.import_module(module)
    import pytest

    reason = f'needs the {extra} extra: pip install "django-syncguard[{extra}]"'
    return pytest.importorskip(module, reason=reason)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.2)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise ServerUnavailable(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


def terminate(process: subprocess.Popen[bytes] | None, *, group: bool = False) -> None:
    """SIGTERM a process we started (by its PID), SIGKILL it if it lingers. ``group``:
    it leads a process group of its own (``start_new_session``), whose members (a
    worker's pool, one stuck in a task for instance) are SIGKILLed with it."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            if group:  # the leader still runs, so the group ID is still its PID
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
            else:
                process.kill()
                process.wait(5)


def wait_until_started(
    process: subprocess.Popen[bytes],
    ready: Callable[[], bool],
    deadline: float,
    what: str,
    log_tail: Callable[[], str],
) -> None:
    """Poll ``ready()`` until it is true. ``process`` exiting first, or the
    ``time.monotonic()`` ``deadline`` passing, is ``ServerUnavailable`` with the end of
    its log (a skip, a failure in CI)."""
    while not ready():
        if process.poll() is not None:
            raise ServerUnavailable(f"{what} exited ({process.returncode}): {log_tail()}")
        if time.monotonic() > deadline:
            raise ServerUnavailable(f"{what} not ready in time: {log_tail()}")
        time.sleep(0.05)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a Python child process that must import this checkout's
    packages (``tests``, ``django_syncguard``) before any installed copy."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def unprivileged_user() -> str | None:
    """The user to run servers as when we are root (``postgres``, else ``nobody``)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise ServerUnavailable("running as root and no unprivileged user to run servers as")


def as_user(user: str | None, argv: list[str]) -> list[str]:
    return ["runuser", "-u", user, "--", *argv] if user else argv


@dataclass
class PostgresServer:
    """A throw-away PostgreSQL cluster: ``initdb``, ``pg_ctl start``, ``pg_ctl stop``."""

    port: int = 0
    user: str | None = None
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="syncguard-pg-")))
    settings: tuple[str, ...] = ("fsync=off", "synchronous_commit=off", "full_page_writes=off")

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_file(self) -> Path:
        return self.root / "server.log"

    def start(self) -> PostgresServer:
        if not (PG_BIN / "initdb").exists():
            raise ServerUnavailable(f"no PostgreSQL binaries in {PG_BIN}")
        self.user = unprivileged_user()
        if self.user:
            shutil.chown(self.root, self.user)
        self._run(
            [
                str(PG_BIN / "initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ]
        )
        for _ in range(3):  # a port picked free may be taken before we bind it
            self.port = free_port()
            try:
                self._ctl("start", "-w", "-t", "60", "-l", str(self.log_file), "-o", self._opts())
                break
            except ServerUnavailable:
                continue
        else:
            raise ServerUnavailable(f"PostgreSQL did not start: {self.log_tail()}")
        atexit.register(self.stop)
        return self

    def _opts(self) -> str:
        extra = " ".join(f"-c {s}" for s in self.settings)
        return f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 {extra}"

    def stop(self, mode: str = "immediate") -> None:
        if self.data_dir.exists() and (self.data_dir / "postmaster.pid").exists():
            with contextlib.suppress(ServerUnavailable):
                self._ctl("stop", "-m", mode, "-w", "-t", "60")

    def restart(self) -> None:
        """Stop cleanly and start again on the same port and data."""
        self._ctl("stop", "-m", "fast", "-w", "-t", "60")
        self._ctl("start", "-w", "-t", "60", "-l", str(self.log_file), "-o", self._opts())

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def _ctl(self, *args: str) -> None:
        self._run([str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), *args])

    def _run(self, argv: list[str]) -> None:
        done = subprocess.run(
            as_user(self.user, argv), capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode != 0:
            raise ServerUnavailable(f"{Path(argv[0]).name} failed: {done.stderr.strip()}")

    def log_tail(self) -> str:
        try:
            return self.log_file.read_text()[-2000:]
        except OSError:
            return "(no log)"

    def database_settings(self, name: str) -> dict[str, object]:
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": str(self.port),
        }

    # -- fault injection (tests/test_faults.py, on clusters of its own) ------------
    def kill(self) -> None:
        """SIGKILL the postmaster and every process of the cluster, as a crash would.

        The postmaster is frozen first so that it cannot fork a backend meanwhile.
        Nothing reaps the orphaned postmaster here (PID 1 may not), and a zombie still
        passes the lock files' liveness test: the stale ``postmaster.pid``, the socket's
        lock file and the SysV interlock segment are removed, as a reboot would have."""
        pid_file = self.data_dir / "postmaster.pid"
        lines = pid_file.read_text().splitlines()
        postmaster = int(lines[0])
        os.kill(postmaster, signal.SIGSTOP)
        victims = [*process_children(postmaster), postmaster]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_until_dead(victims, 30)
        pid_file.unlink()
        (self.root / f".s.PGSQL.{self.port}.lock").unlink(missing_ok=True)
        if len(lines) > 6 and len(lines[6].split()) == 2:
            subprocess.run(["ipcrm", "-m", lines[6].split()[1]], capture_output=True, check=False)

    def start_again(self) -> None:
        """Start the stopped or killed cluster on the same port and data directory."""
        self._ctl("start", "-w", "-t", "60", "-l", str(self.log_file), "-o", self._opts())


class InTempRoot:
    """What a server started by ``Popen`` in a temporary ``root`` shares: removal of
    that directory, and the tail of its log file, ``root / log_name``."""

    root: Path
    log_name: ClassVar[str]
    #: How much of the log's end ``log_tail`` shows.
    tail_chars: ClassVar[int] = 2000

    def stop(self) -> None:
        raise NotImplementedError

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self) -> str:
        try:
            return (self.root / self.log_name).read_text(errors="replace")[-self.tail_chars :]
        except OSError:
            return "(no log)"


def redis_binary(name: str) -> str:
    """The path of ``redis-server`` or ``redis-cli`` (both in Debian's redis-server)."""
    binary = shutil.which(name)
    if binary is None:
        raise ServerUnavailable(f"{name} is not installed (Debian package redis-server)")
    return binary


def listen_on_a_port(server: Any, argv: Callable[[], list[str]], what: str) -> None:
    """Start ``argv()`` as ``server.process`` and wait until it listens on ``server.port``.

    A server without a port gets a free one; as a port picked free may be taken before
    the server binds it, that is tried three times with a new port. A server that keeps
    its port (a restart) gets no other: whoever knows it by its port must find it there.
    """
    picked = not server.port
    for _ in range(3 if picked else 1):
        server.port = server.port or free_port()
        server.process = subprocess.Popen(
            argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            wait_for_port(server.port, 20)
            return
        except ServerUnavailable:
            server.stop()
            if picked:
                server.port = 0
    raise ServerUnavailable(f"{what} did not start: {server.log_tail()}")


@dataclass
class RedisServer(InTempRoot):
    """A throw-away ``redis-server`` (Debian's package) on a free loopback port."""

    port: int = 0
    aof: bool = False
    #: The port of a primary on loopback to replicate (``--replicaof``); 0: a primary.
    replica_of: int = 0
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="syncguard-redis-")))
    process: subprocess.Popen[bytes] | None = None
    #: More ``redis-server`` arguments, after the others (the cluster's ``--cluster-*``).
    options: tuple[str, ...] = ()
    log_name = "server.log"

    def start(self) -> RedisServer:
        binary = redis_binary("redis-server")

        def argv() -> list[str]:
            args = [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.root),
                "--save",
                "",
                "--daemonize",
                "no",
                "--protected-mode",
                "no",
                "--logfile",
                str(self.root / self.log_name),
            ]
            if self.aof:
                args += ["--appendonly", "yes", "--appendfsync", "always"]
            if self.replica_of:
                args += ["--replicaof", "127.0.0.1", str(self.replica_of)]
            return [*args, *self.options]

        listen_on_a_port(self, argv, "redis-server")
        atexit.register(self.stop)
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        terminate(self.process)  # SIGTERM: Redis flushes the AOF and exits
        self.process = None

    def restart(self) -> None:
        """Stop and start again on the same port and data directory."""
        self.stop()
        self.start()

    # -- fault injection (tests/test_faults.py, on servers of its own) -------------
    def kill(self) -> None:
        """SIGKILL redis-server: no final AOF flush, no shutdown save."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
        self.process = None


@dataclass
class PgBouncerServer(InTempRoot):
    """PgBouncer (Debian's package) in transaction pooling mode, in front of a
    :class:`PostgresServer`: the pooler under which ``LISTEN`` cannot work."""

    postgres_port: int
    port: int = 0
    user: str | None = None
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="syncguard-pgb-")))
    process: subprocess.Popen[bytes] | None = None

    BINARY = Path("/usr/sbin/pgbouncer")
    log_name = "pgbouncer.log"

    def start(self) -> PgBouncerServer:
        if not self.BINARY.exists():
            raise ServerUnavailable("pgbouncer is not installed (Debian package pgbouncer)")
        self.user = unprivileged_user()
        if self.user:
            shutil.chown(self.root, self.user)
        for _ in range(3):
            self.port = free_port()
            config = self.root / "pgbouncer.ini"
            config.write_text(
                "[databases]\n"
                f"* = host=127.0.0.1 port={self.postgres_port}\n"
                "[pgbouncer]\n"
                f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\n"
                f"unix_socket_dir = {self.root}\n"
                "auth_type = trust\n"
                f"auth_file = {self.root / 'users.txt'}\n"
                "pool_mode = transaction\n"
                "max_client_conn = 200\ndefault_pool_size = 10\n"
                # Django and psycopg send these startup parameters.
                "ignore_startup_parameters = extra_float_digits,options\n"
                f"logfile = {self.root / self.log_name}\n"
            )
            (self.root / "users.txt").write_text('"postgres" ""\n')
            if self.user:
                for path in (config, self.root / "users.txt"):
                    shutil.chown(path, self.user)
            self.process = subprocess.Popen(
                as_user(self.user, [str(self.BINARY), str(config)]),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                wait_for_port(self.port, 20)
                break
            except ServerUnavailable:
                self.stop()
        else:
            raise ServerUnavailable(f"pgbouncer did not start: {self.log_tail()}")
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        terminate(self.process)
        self.process = None


@dataclass
class FirestoreEmulator(InTempRoot):
    """``gcloud emulators firestore start`` on a free loopback port (Java 17)."""

    port: int = 0
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="syncguard-fs-")))
    process: subprocess.Popen[bytes] | None = None
    #: An ``.overall_export_metadata`` file to load at start (see ``export``).
    import_data: Path | None = None
    log_name = "emulator.log"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120) -> FirestoreEmulator:
        if not extra_installed("google.cloud.firestore"):
            # The tests talk to it through the client library only.
            raise ServerUnavailable(
                'google-cloud-firestore is not installed: pip install "django-syncguard[firestore]"'
            )
        gcloud = shutil.which("gcloud")
        if gcloud is None:
            raise ServerUnavailable("gcloud is not installed (Firestore emulator)")
        self.port = self.port or free_port()  # a restart keeps its port
        argv = [gcloud, "emulators", "firestore", "start", f"--host-port={self.host}", "--quiet"]
        if self.import_data is not None:
            argv.append(f"--import-data={self.import_data}")
        log = (self.root / self.log_name).open("wb")
        self.process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "CLOUDSDK_CORE_DISABLE_PROMPTS": "1"},
        )
        try:
            wait_until_started(
                self.process,
                lambda: "Dev App Server is now running" in self.log_tail(),
                time.monotonic() + timeout_s,
                "Firestore emulator",
                self.log_tail,
            )
        except ServerUnavailable:
            self.stop()
            raise
        wait_for_port(self.port, 10)
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            import signal

            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        self.process = None

    # -- fault injection (tests/test_faults.py, on emulators of its own) -----------
    def export(self, project: str) -> Path:
        """Export every document of ``project`` now; return the metadata file that
        ``import_data`` takes. (``--export-on-exit`` of this emulator version writes
        nothing here, whatever signal stops it; the emulator's export endpoint does.)"""
        target = Path(tempfile.mkdtemp(prefix="export-", dir=self.root))
        database = f"projects/{project}/databases/(default)"
        body = {"database": database, "export_directory": str(target)}
        request = urllib.request.Request(
            f"http://{self.host}/emulator/v1/projects/{project}:export",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
        [metadata] = target.glob("*/*.overall_export_metadata")
        return metadata

    def kill(self) -> None:
        """SIGKILL the emulator (gcloud, its shell and the JVM): nothing is saved."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self.process = None
        wait_for_port_free(self.port, 30)

    def stop_and_wait(self) -> None:
        """``stop`` and wait until the JVM has let go of the port (for a restart)."""
        self.stop()
        wait_for_port_free(self.port, 30)


# -- fault injection helpers ---------------------------------------------------------
def process_children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from ``/proc``)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry))
    return children


def running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie does not: PID 1 may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_until_dead(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(running(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise ServerUnavailable(f"processes {pids} still run after {timeout_s} s")
        time.sleep(0.02)


def wait_for_port_free(port: int, timeout_s: float) -> None:
    """Wait until nothing accepts connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.2)
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.05)
    raise ServerUnavailable(f"127.0.0.1:{port} still accepts connections after {timeout_s} s")


def start_or_skip(server: Any, kind: str) -> Any:
    """``server``, started; when it cannot start, skip the test that asked for it
    (fail it when ``CI`` is set: there a missing server is a failure)."""
    import pytest

    try:
        return server.start()
    except ServerUnavailable as exc:
        server.destroy()
        if IN_CI:
            pytest.fail(f"CI is set and {kind} cannot start: {exc}")
        pytest.skip(f"{kind} unavailable: {exc}")
