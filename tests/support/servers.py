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


# -- Redis topologies: Sentinel and Cluster, made of RedisServer processes -----------
#: How long a topology may take to settle (start, failover, resharding) before the
#: wait gives up: Sentinel's leader election may need a second round (10 s later),
#: a cluster's failure detection a few node timeouts.
SETTLE_S = 60.0


def redis_client(port: int, *, decode: bool = True) -> Any:
    """A redis-py client of 127.0.0.1:``port`` with timeouts on connecting and on every
    reply, so that a hung server fails a wait instead of hanging it."""
    import redis

    return redis.Redis(
        host="127.0.0.1",
        port=port,
        socket_connect_timeout=2,
        socket_timeout=10,  # above MIGRATE's own timeout (MIGRATE_TIMEOUT_MS)
        decode_responses=decode,
        protocol=2,  # flat RESP2 replies (pairs, lists), whatever redis-py's default
    )


def ask(port: int, *command: Any, decode: bool = True) -> Any:
    """The raw reply of one command to 127.0.0.1:``port``, on a connection of its own."""
    with redis_client(port, decode=decode) as client:
        return client.execute_command(*command)


def poll(check: Callable[[], Any], what: str, timeout_s: float = SETTLE_S) -> Any:
    """``check()``'s first truthy result, asked every 50 ms until ``timeout_s``. A server
    that refuses or drops the connection meanwhile (one just killed or restarted)
    counts as not yet; past the deadline: ``ServerUnavailable`` naming ``what``."""
    import redis

    deadline = time.monotonic() + timeout_s
    error: Exception | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except (redis.RedisError, OSError) as exc:
            error = exc
        if time.monotonic() > deadline:
            raise ServerUnavailable(f"{what}: not after {timeout_s} s (last error: {error})")
        time.sleep(0.05)  # the servers' own state: no event to wait on


def pairs(flat: list[Any]) -> dict[str, Any]:
    """A reply of alternating field names and values (``SENTINEL REPLICAS``' entries)."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


#: ``redis-server`` options of every topology's data servers: a primary sends a
#: (re)starting replica its data at once, not 5 s later in case more replicas come.
TOPOLOGY_OPTIONS = ("--repl-diskless-sync-delay", "0")


def replica_linked(port: int, primary: int) -> bool:
    """Whether the server on ``port`` replicates ``primary`` over a link that is up."""
    with redis_client(port) as client:
        info = client.info("replication")
    return info.get("master_port") == primary and info.get("master_link_status") == "up"


def role(port: int) -> str:
    """``ROLE``'s first word: ``master`` or ``slave``."""
    return str(ask(port, "ROLE")[0])


@dataclass
class RedisSentinel(InTempRoot):
    """One ``redis-server <conf> --sentinel`` (Debian's redis-sentinel package is the
    same binary in the same mode), watching the primary its config names."""

    #: The ``sentinel ...`` lines of its config (the monitor and its timings).
    directives: str
    root: Path
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    log_name = "sentinel.log"

    def start(self) -> RedisSentinel:
        binary = redis_binary("redis-server")

        def argv() -> list[str]:
            # Written anew for each port tried; Sentinel rewrites it as it learns
            # (its ID, the replicas and other sentinels it found), hence its own file.
            config = self.root / "sentinel.conf"
            config.write_text(
                f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\n"
                f"dir {self.root}\nlogfile {self.root / self.log_name}\n{self.directives}"
            )
            return [binary, str(config), "--sentinel"]

        listen_on_a_port(self, argv, "redis sentinel")
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        terminate(self.process)
        self.process = None


def subdir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    return path


class Topology(InTempRoot):
    """What a topology of several processes in one temporary ``root`` shares: a log
    tail made of each member's (a failed test shows them all)."""

    tail_chars = 600  # per member

    def members(self) -> list[InTempRoot]:
        raise NotImplementedError

    def stop(self) -> None:
        for member in self.members():  # each by the PID it started
            member.stop()

    def log_tail(self) -> str:
        return "\n".join(
            f"--- {member.root.name}:\n{member.log_tail()[-self.tail_chars :]}"
            for member in self.members()
        )


@dataclass
class RedisSentinelTopology(Topology):
    """A primary, its replica and three sentinels (quorum 2) watching them, on
    loopback. ``failover`` crashes the primary and brings it back as the replica, as
    often as a test likes: ``servers`` knows which server is on which port."""

    service: str = "syncguard"
    #: Above Sentinel's PING period (1 s) by a margin. At 1000 (so a PING period of
    #: 1000 too) the primary a failover has just switched to is marked down in the
    #: very tick that sends it its first PING, now and then; with the votes the other
    #: sentinels gave on the crashed one still counted (for 5 s), that is a quorum, and
    #: a second failover follows (about 1 in 6 failovers here).
    down_after_ms: int = 2000
    failover_timeout_ms: int = 5000
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="syncguard-sent-")))
    #: The two data servers by port; which is the primary changes with each failover.
    servers: dict[int, RedisServer] = field(default_factory=dict)
    sentinel_servers: list[RedisSentinel] = field(default_factory=list)

    def members(self) -> list[InTempRoot]:
        return [*self.sentinel_servers, *self.servers.values()]

    def start(self) -> RedisSentinelTopology:
        primary = RedisServer(root=subdir(self.root, "a"), options=TOPOLOGY_OPTIONS).start()
        self.servers[primary.port] = primary
        replica = RedisServer(
            root=subdir(self.root, "b"), replica_of=primary.port, options=TOPOLOGY_OPTIONS
        )
        self.servers[replica.start().port] = replica
        # In sync first: the sentinels' first look at the primary then finds the replica.
        poll(lambda: replica_linked(replica.port, primary.port), "the replica's link")
        for n in range(3):
            sentinel = RedisSentinel(self._directives(primary.port), subdir(self.root, f"s{n}"))
            self.sentinel_servers.append(sentinel.start())
        self._wait_steady(primary.port, replica.port)
        atexit.register(self.stop)
        return self

    def _directives(self, primary: int) -> str:
        name = self.service
        return (
            f"sentinel monitor {name} 127.0.0.1 {primary} 2\n"
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}\n"
            "sentinel resolve-hostnames no\n"
        )

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", sentinel.port) for sentinel in self.sentinel_servers]

    @property
    def location(self) -> str:
        """A ``LOCATION`` naming the service, whose primary the sentinels tell."""
        return f"redis://{self.service}/0"

    def primary_port(self) -> int:
        """The primary's port, as the first sentinel that answers tells it."""
        import redis

        for _, port in self.sentinels:
            try:
                return int(ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)[1])
            except (redis.RedisError, OSError, TypeError):
                continue  # that one is down, or knows no primary (TypeError: a nil)
        raise ServerUnavailable(f"no sentinel tells the primary of {self.service}")

    def failover(self, kill: bool = True) -> int:
        """Fail over to the replica; return the new primary's port.

        ``kill``: SIGKILL the primary (a crash), then restart it on its port as the new
        primary's replica (about 8 s in all here). Otherwise: ``SENTINEL FAILOVER`` (a
        planned switch), after which the sentinels make the old primary a replica
        themselves, at their own pace (about 20 s). Either way it returns once the
        topology is steady again (see ``_wait_steady``)."""
        old = self.primary_port()
        if kill:
            self.servers[old].kill()
        else:
            ask(self.sentinels[0][1], "SENTINEL", "FAILOVER", self.service)
        new = poll(lambda: self._new_primary(old), f"a primary other than {old}")
        self.servers[old].replica_of = new
        if kill:
            self.servers[old].start()  # same port and directory: the sentinels know it
        self._wait_steady(new, old)
        return int(new)

    def _new_primary(self, old: int) -> int | None:
        """The port of a primary other than ``old`` that a sentinel names and that
        says it is one (the sentinel may name it a moment before its promotion)."""
        port = self.primary_port()
        return port if port != old and role(port) == "master" else None

    def _wait_steady(self, primary: int, replica: int) -> None:
        """Wait until the replica is in sync and every sentinel sees the same: the
        primary up, that one replica linked, the two other sentinels. Then no failover
        is under way, and the next one has a replica to promote."""
        poll(lambda: replica_linked(replica, primary), f"{replica} replicating {primary}")
        for _, port in self.sentinels:
            poll(lambda p=port: self._sees(p, primary, replica), f"sentinel {port}'s view")

    def _sees(self, sentinel: int, primary: int, replica: int) -> bool:
        """Whether ``sentinel`` sees the steady state. The others' flags must be bare
        ``sentinel``: after a failover their ``master_down`` votes on the crashed
        primary linger 5 s, and would count toward the next one's quorum."""
        name = self.service
        master = pairs(ask(sentinel, "SENTINEL", "MASTER", name))
        replicas = [pairs(r) for r in ask(sentinel, "SENTINEL", "REPLICAS", name)]
        others = [pairs(s) for s in ask(sentinel, "SENTINEL", "SENTINELS", name)]
        return (
            int(master["port"]) == primary
            and master["flags"] == "master"  # no s_down, o_down, failover_in_progress
            and [(int(r["port"]), r["flags"], r["master-link-status"]) for r in replicas]
            == [(replica, "slave", "ok")]
            and len(others) == 2
            and all(s["flags"] == "sentinel" for s in others)
        )


@dataclass(frozen=True)
class ClusterNode:
    """One line of ``CLUSTER NODES``."""

    id: str
    port: int
    flags: frozenset[str]
    primary_id: str  # "-" for a primary
    connected: bool

    @classmethod
    def parse(cls, line: str) -> ClusterNode:
        node_id, address, flags, primary_id, _, _, _, link, *_ = line.split()
        port = int(address.split("@")[0].rsplit(":", 1)[1])
        return cls(node_id, port, frozenset(flags.split(",")), primary_id, link == "connected")


def cluster_nodes(port: int) -> list[ClusterNode]:
    return [ClusterNode.parse(line) for line in ask(port, "CLUSTER", "NODES").splitlines()]


def slot_map(port: int) -> list[tuple[int, int, int]]:
    """The slot ranges and their primaries' ports, as the node on ``port`` sees them
    (``CLUSTER SLOTS``, what cluster clients read)."""
    return sorted(
        (start, end, primary[1]) for start, end, primary, *_ in ask(port, "CLUSTER", "SLOTS")
    )


@dataclass
class RedisClusterTopology(Topology):
    """A Redis Cluster of three primaries with one replica each, on loopback: six
    ``redis-server --cluster-enabled yes``, joined by ``redis-cli --cluster create``."""

    node_timeout_ms: int = 2000
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="syncguard-clu-")))
    #: The six nodes by port; a failover swaps the roles, never the ports.
    nodes: dict[int, RedisServer] = field(default_factory=dict)

    #: ``MIGRATE``'s timeout, and how many keys each one moves (redis-cli's default).
    MIGRATE_TIMEOUT_MS: ClassVar[int] = 5000
    MIGRATE_BATCH: ClassVar[int] = 10

    def members(self) -> list[InTempRoot]:
        return list(self.nodes.values())

    def start(self) -> RedisClusterTopology:
        cli = redis_binary("redis-cli")
        for n in range(6):
            node = self._node(subdir(self.root, f"node-{n}"))
            self.nodes[node.start().port] = node
        # redis-cli makes the first three primaries and gives each a replica.
        addresses = [f"127.0.0.1:{port}" for port in self.nodes]
        created = subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if created.returncode != 0:
            raise ServerUnavailable(f"redis-cli --cluster create failed: {created.stdout[-2000:]}")
        self._wait_steady()
        atexit.register(self.stop)
        return self

    def _node(self, root: Path) -> RedisServer:
        """A cluster node whose state (``nodes.conf``) survives a crash in ``root``. Its
        bus port is picked free too: the default (port + 10000) may be taken, or
        above 65535 for a port from the ephemeral range."""
        return RedisServer(
            root=root,
            options=(
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(root / "nodes.conf"),
                "--cluster-node-timeout",
                str(self.node_timeout_ms),
                "--cluster-port",
                str(free_port()),
                "--appendonly",
                "no",
                *TOPOLOGY_OPTIONS,
            ),
        )

    @property
    def startup_url(self) -> str:
        return f"redis://127.0.0.1:{self.primaries()[0]}/0"

    def primaries(self) -> list[int]:
        """The ports of the primaries that hold slots, in order."""
        return sorted({port for _, _, port in slot_map(self._running()[0])})

    def owner(self, slot: int) -> int:
        """The port of the primary that holds ``slot``."""
        return next(p for start, end, p in slot_map(self._running()[0]) if start <= slot <= end)

    def _running(self) -> list[int]:
        return [port for port, node in self.nodes.items() if node.process is not None]

    def migrate_slot(self, slot: int, to_port: int) -> None:
        """Move ``slot`` and its keys to the primary on ``to_port``, as ``redis-cli
        --cluster reshard`` does, while clients may use it: during the move, the
        source answers for the keys it still has and sends the others (new ones too)
        to the target with ``ASK``; then every primary learns the new owner."""
        source = self.owner(slot)
        if source == to_port:
            return
        source_id, target_id = (ask(p, "CLUSTER", "MYID") for p in (source, to_port))
        # The target first: once the source redirects, the target must accept.
        ask(to_port, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        ask(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        while keys := ask(
            source, "CLUSTER", "GETKEYSINSLOT", slot, self.MIGRATE_BATCH, decode=False
        ):
            ask(
                source,
                "MIGRATE",
                "127.0.0.1",
                to_port,
                "",
                0,
                self.MIGRATE_TIMEOUT_MS,
                "KEYS",
                *keys,
            )
        # The target, then the source (it stops redirecting with ASK), then the rest;
        # the target's epoch bump carries the change to the replicas.
        others = [p for p in self.primaries() if p not in (source, to_port)]
        for port in (to_port, source, *others):
            ask(port, "CLUSTER", "SETSLOT", slot, "NODE", target_id)
        self._wait_steady()

    def fail_over_primary(self, port: int) -> int:
        """SIGKILL the primary on ``port``; once its replica has taken over, restart it
        (its ``nodes.conf`` kept) so that it rejoins as that one's replica. Returns the
        new primary's port, when the whole cluster is steady again."""
        me = next(n for n in cluster_nodes(port) if "myself" in n.flags)
        [replica] = [n.port for n in cluster_nodes(port) if n.primary_id == me.id]
        self.nodes[port].kill()
        others = [p for p in self.nodes if p != port]
        poll(lambda: self._took_over(replica, port, others), f"{replica} replacing {port}")
        self.nodes[port].start()  # same port and directory
        self._wait_steady()
        return replica

    @staticmethod
    def _took_over(replica: int, old: int, others: list[int]) -> bool:
        """Whether ``replica`` is a primary, and every other live node is ok with the
        slots of ``old`` now on it."""
        if role(replica) != "master":
            return False
        for port in others:
            info = ask(port, "CLUSTER", "INFO")
            ports = {p for _, _, p in slot_map(port)}
            if "cluster_state:ok" not in info or old in ports or replica not in ports:
                return False
        return True

    def _wait_steady(self) -> None:
        poll(self._steady, "a steady cluster (state ok, one slot map, replicas linked)")

    def _steady(self) -> bool:
        """Every node: ``cluster_state:ok``, the same slot map, all six nodes known,
        connected and none suspected; three primaries, each with one linked replica."""
        ports = list(self.nodes)
        if any("cluster_state:ok" not in ask(p, "CLUSTER", "INFO") for p in ports):
            return False
        if any(slot_map(p) != slot_map(ports[0]) for p in ports[1:]):
            return False
        bad = {"fail", "fail?", "handshake", "noaddr"}
        views = [cluster_nodes(p) for p in ports]
        if any(len(v) != 6 or any(n.flags & bad or not n.connected for n in v) for v in views):
            return False
        primaries = {n.id: n.port for n in views[0] if "master" in n.flags}
        replicas = [(n.port, primaries.get(n.primary_id)) for n in views[0] if "slave" in n.flags]
        return (
            len(primaries) == 3
            and sorted(p for _, p in replicas if p) == sorted(primaries.values())
            and all(replica_linked(r, p) for r, p in replicas)
        )


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
