"""Start and stop hicache-daemon as a child process (for scripts, tests and benchmarks)."""

from __future__ import annotations

import signal
import subprocess
import sys


def start_daemon(endpoint: str, *flags: str) -> subprocess.Popen:
    """Spawn ``python -m hicache.daemon`` and return once it reports ready (or raise)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache.daemon", "--endpoint", endpoint, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    line = proc.stdout.readline()  # blocks until the daemon says it is ready, or dies
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"hicache-daemon did not start: {line}{proc.stdout.read()}")
    return proc


def stop_daemon(proc: subprocess.Popen, timeout: float = 30) -> str:
    """SIGTERM, wait, and return what the daemon printed after starting."""
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    return out
