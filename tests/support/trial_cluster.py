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
            for port in self.ports:
                with redis.Redis(port=port) as client:
                    infos.append(client.cluster("info"))
            if all(info["cluster_state"] == "ok" for info in infos):
                return
            time.sleep(0.1)  # the nodes agree by gossip: no event to wait on
        raise ServerUnavailable("the trial cluster did not reach state ok")

    @property
    def startup_url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def stop(self) -> None:
        for process in self.processes:
            terminate(process)
        self.processes = []
