"""A real Redis Cluster on loopback from Debian's `redis-server`: 6 nodes (3 primaries, 3 replicas), created
with `redis-cli --cluster create --cluster-replicas 1`, a short node timeout so a failover takes seconds.

A node's cluster bus listens on its port plus 10,000, so the ports are picked below 55,536 with both free.
`cluster-require-full-coverage no`: while one primary is away (before its replica is promoted) the other
primaries keep serving their slots, as a deployment that wants pools on other shards unaffected would run.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from redis.crc import key_slot

from tests.support.services import ServiceUnavailable, wait_for_port

NODES = 6
# How long a node may be silent before the others mark it failing (the failover starts then).
NODE_TIMEOUT_MS = 1000


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_ports(count: int = NODES) -> list[int]:
    """`count` ports below 55,536 whose bus ports (+10,000) are free too."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(20_000, 45_000)
        if port not in ports and _free(port) and _free(port + 10_000):
            ports.append(port)
    return ports


def slot_of(key: str) -> int:
    """The key's hash slot (CRC16 of its `{tag}` when it has one, mod 16384), as CLUSTER KEYSLOT says."""
    return int(key_slot(key.encode()))


class LocalRedisCluster:
    """The six servers, their work folders, and what a test needs: who owns a slot, kill a node, restart it."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None or shutil.which("redis-cli") is None:
            raise ServiceUnavailable("redis-server not found; run `make system-deps` (Debian package redis-server)")
        self.binary = binary
        self.ports = cluster_ports()
        self.workdir = Path(tempfile.mkdtemp(prefix="tokenpools-redis-cluster-"))
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}"

    def start_node(self, port: int) -> None:
        folder = self.workdir / str(port)
        folder.mkdir(exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "",
             "--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-require-full-coverage", "no",
             # A replica may take over however long it was cut off from its primary (a test kills it).
             "--cluster-replica-validity-factor", "0"],
            stdout=(folder / "server.log").open("w"), stderr=subprocess.STDOUT)
        wait_for_port(port, proc=self.procs[port])

    def cli(self, port: int, *args: str) -> str:
        result = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=30)
        return result.stdout

    def start(self) -> None:
        for port in self.ports:
            self.start_node(port)
        created = subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas", "1",
             "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if created.returncode != 0:
            raise ServiceUnavailable(f"redis-cli --cluster create failed:\n{created.stdout}\n{created.stderr}")
        self.wait_ok()

    def alive(self) -> list[int]:
        return [port for port, proc in self.procs.items() if proc.poll() is None]

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        """Until every live node says cluster_state:ok and all agree on 3 primaries covering every slot."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in self.cli(p, "cluster", "info") for p in self.alive()) and all(
                    len(self.primaries(p)) == 3 for p in self.alive()):
                return
            time.sleep(0.1)
        raise ServiceUnavailable("the Redis Cluster did not reach cluster_state:ok")

    def primaries(self, asked: int | None = None) -> dict[int, list[tuple[int, int]]]:
        """Each primary's port and its slot ranges, as node `asked` (else a live one) sees them."""
        port = asked if asked is not None else self.alive()[0]
        owners: dict[int, list[tuple[int, int]]] = {}
        for line in self.cli(port, "cluster", "nodes").splitlines():
            fields = line.split()
            if len(fields) < 9 or "master" not in fields[2] or "fail" in fields[2]:
                continue
            node_port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            for part in fields[8:]:
                if part.startswith("["):
                    continue  # a slot being migrated
                low, _, high = part.partition("-")
                owners.setdefault(node_port, []).append((int(low), int(high or low)))
        return owners

    def owner(self, slot: int) -> int:
        """The port of the primary that serves `slot` now."""
        for port, ranges in self.primaries().items():
            if any(low <= slot <= high for low, high in ranges):
                return port
        raise LookupError(f"no primary serves slot {slot}")

    def kill(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs[port].wait()

    def restart(self, port: int) -> None:
        """Start a killed node again (it rejoins as a replica of the primary that took its slots)."""
        self.start_node(port)
        self.wait_ok()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


@contextlib.contextmanager
def running_redis_cluster() -> Iterator[LocalRedisCluster]:
    cluster = LocalRedisCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def pools_on_distinct_primaries(cluster: LocalRedisCluster, count: int = 3, prefix: str = "shard") -> list[str]:
    """`count` pool names whose hash tags (`{<pool>}`) fall in slots of different primaries."""
    names: dict[int, str] = {}
    index = 0
    while len(names) < count:
        name = f"{prefix}{index}"
        names.setdefault(cluster.owner(slot_of(f"tp:gw:{{{name}}}:pool")), name)
        index += 1
    return list(names.values())
