"""Real stores for the L3 tests, on loopback ports: a Redis Cluster of three nodes (Debian's
redis-server) and a Mooncake master (the wheel's mooncake_master). Every process is started
in a session of its own and stopped by PID, whatever the test did; a server that is not
installed skips the test that wants it."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from tests.optional import require_program

BIN = Path(sys.executable).parent


def free_port(bus: bool = False) -> int:
    """A free loopback port; ``bus``: port + 10000 is free too (a Redis Cluster node's bus)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 45000)
        if _free(port) and (not bus or _free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20.0) -> None:
    """Return once ``port`` accepts connections; raise with the log if ``proc`` died first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} (see its log)")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout} s")


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stop ``proc`` (and its process group) by PID; SIGKILL after 5 s."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


class RedisCluster:
    """Three masters, no replicas, ``cluster-require-full-coverage no`` (a dead node fails only
    its own slots)."""

    def __init__(self, folder: Path, nodes: int = 3, maxmemory: str = "256mb"):
        self.folder, self.procs = folder, {}
        self.ports = [free_port(bus=True) for _ in range(nodes)]
        self.maxmemory = maxmemory

    @property
    def url(self) -> str:
        return "redis://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start_node(self, port: int) -> None:
        d = self.folder / str(port)
        d.mkdir(parents=True, exist_ok=True)
        args = [
            shutil.which("redis-server") or "redis-server",
            "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
            "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
            "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no",
            "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
            "--save", "", "--appendonly", "no", "--logfile", str(d / "redis.log"),
        ]  # fmt: skip
        proc = subprocess.Popen(args, start_new_session=True, stdout=subprocess.DEVNULL)
        self.procs[port] = proc
        wait_port(port, proc, f"redis-server :{port}")

    def start(self) -> None:
        for port in self.ports:
            self.start_node(port)
        addrs = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run(
            [shutil.which("redis-cli") or "redis-cli", "--cluster", "create", *addrs,
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # every node must agree before keys are routed
            states = [self._info(p) for p in self.ports]
            if all("cluster_state:ok" in s for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError("redis cluster did not reach cluster_state:ok")

    def _info(self, port: int) -> str:
        out = subprocess.run(
            [shutil.which("redis-cli") or "redis-cli", "-p", str(port), "cluster", "info"],
            capture_output=True, text=True, timeout=5,
        )  # fmt: skip
        return out.stdout

    def kill(self, port: int) -> None:
        stop(self.procs[port], signal.SIGKILL)

    def stop(self) -> None:
        for proc in self.procs.values():
            stop(proc)


class MooncakeMaster:
    def __init__(self, client_ttl: int = 10):
        self.port, self.metrics = free_port(), free_port()
        self.client_ttl = client_ttl
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [
            str(BIN / "mooncake_master"), f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
            "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics}",
            f"--client_ttl={self.client_ttl}",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_port(self.port, self.proc, "mooncake_master")

    def kill(self) -> None:
        if self.proc is not None:
            stop(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


@contextmanager
def redis_cluster(folder: Path, **kw: object):
    require_program("redis-server", "redis-server", "the Redis Cluster store's tests")
    cluster = RedisCluster(folder, **kw)  # type: ignore[arg-type]
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@contextmanager
def mooncake_master(**kw: object):
    require_program(
        "mooncake_master", "mooncake", "the Mooncake store's tests", BIN / "mooncake_master"
    )
    master = MooncakeMaster(**kw)  # type: ignore[arg-type]
    try:
        master.start()
        yield master
    finally:
        master.stop()


def l3_settled(endpoint: str) -> dict:
    """A daemon's third-tier figures once nothing is queued to write or being fetched."""
    from hicache.client import HiCacheClient

    with HiCacheClient(endpoint, name="probe") as hc:
        l3 = hc.stats()["l3"]
        while l3["queued_pages"] or l3["fetches_in_flight"]:
            l3 = hc.stats()["l3"]
    return l3
