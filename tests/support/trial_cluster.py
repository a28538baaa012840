"""A throw-away Redis Cluster for the cluster harness until the shared topology
(``RedisClusterTopology``, branch fences-topo) is merged: three primaries with one
replica each, on free loopback ports, stopped by their PIDs."""

from __future__ import annotations

import atexit
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.servers import InTempRoot, ServerUnavailable, free_port, terminate, wait_for_port


def _cluster_port(taken: list[int]) -> int:
    """A free port whose cluster bus port (+10000) exists and is free too."""
    while True:
        port = free_port()
        if port + 10000 < 65536 and port not in taken:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


@dataclass
class TrialCluster(InTempRoot):
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="syncguard-rc-")))
    ports: list[int] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    log_name = "node0.log"

    def start(self) -> TrialCluster:
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if binary is None or cli is None:
            raise ServerUnavailable("redis-server / redis-cli are not installed")
        for n in range(6):
            port = _cluster_port(self.ports)
            node = self.root / f"node{n}"
            node.mkdir()
            argv = [
                binary,
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--dir", str(node),
                "--save", "",
                "--protected-mode", "no",
                "--cluster-enabled", "yes",
                "--cluster-node-timeout", "2000",
                "--logfile", str(self.root / f"node{n}.log"),
            ]  # fmt: skip
            self.processes.append(
                subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
            self.ports.append(port)
        atexit.register(self.stop)
        for port in self.ports:
            wait_for_port(port, 20)
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run(
            [cli, "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=60,
        )
        self._wait_ok()
        return self

    def _wait_ok(self) -> None:
        import redis

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            infos = []
            for port in self._live():
                with redis.Redis(port=port) as client:
                    infos.append(client.cluster("info"))
            links = []
            for port in self._live():
                with redis.Redis(port=port) as client:
                    replication = client.info("replication")
                if replication["role"] == "slave":
                    links.append(replication["master_link_status"] == "up")
            if all(info["cluster_state"] == "ok" for info in infos) and all(links):
                return
            time.sleep(0.1)  # the nodes agree by gossip: no event to wait on
        raise ServerUnavailable("the trial cluster did not reach state ok")

    @property
    def startup_url(self) -> str:
        return f"redis://127.0.0.1:{self.primaries()[0]}/0"

    def _ask(self, port: int, *args: object) -> Any:
        import redis

        with redis.Redis(port=port, socket_timeout=10) as client:
            return client.execute_command(*args)

    def _live(self) -> list[int]:
        return [
            p for p, proc in zip(self.ports, self.processes, strict=True) if proc.poll() is None
        ]

    def _slot_map(self) -> list[tuple[int, int, int]]:
        import redis

        with redis.Redis(port=self._live()[0], socket_timeout=10) as client:
            rows = client.execute_command("CLUSTER", "SLOTS")
        return sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in rows)

    def primaries(self) -> list[int]:
        """The ports of the primaries that hold slots, in order."""
        return sorted({port for _, _, port in self._slot_map()})

    def owner(self, slot: int) -> int:
        return next(p for start, end, p in self._slot_map() if start <= slot <= end)

    def migrate_slot(self, slot: int, to_port: int) -> None:
        """Move ``slot`` and its keys to the primary on ``to_port`` (as ``redis-cli
        --cluster reshard``), while clients use it."""
        source = self.owner(slot)
        if source == to_port:
            return
        source_id = self._ask(source, "CLUSTER", "MYID").decode()
        target_id = self._ask(to_port, "CLUSTER", "MYID").decode()
        self._ask(to_port, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        self._ask(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        while keys := self._ask(source, "CLUSTER", "GETKEYSINSLOT", slot, 10):
            self._ask(source, "MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *keys)
        for port in (to_port, source, *(p for p in self.primaries() if p not in (source, to_port))):
            self._ask(port, "CLUSTER", "SETSLOT", slot, "NODE", target_id)
        self._wait_ok()

    def fail_over_primary(self, port: int) -> int:
        """Kill the primary on ``port``; once its replica took over (and the cluster is
        ok), return the new primary's port. The old node stays down."""
        me = self._ask(port, "CLUSTER", "MYID").decode()
        lines = self._ask(port, "CLUSTER", "NODES").decode().splitlines()
        fields = [line.split() for line in lines]
        replica = next(int(f[1].split(":")[1].split("@")[0]) for f in fields if f[3] == me)
        process = self.processes[self.ports.index(port)]
        process.kill()  # by its PID: a crash, not a shutdown
        process.wait(10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if port not in self.primaries() and replica in self.primaries():
                    self._wait_ok()
                    return replica
            except Exception:
                pass
            time.sleep(0.1)  # gossip decides: no event to wait on
        raise ServerUnavailable(f"no replica took over from {port}")

    def stop(self) -> None:
        for process in self.processes:
            terminate(process)
        self.processes = []
