"""Start and stop hicache-daemon as a child process (for scripts, tests and benchmarks)."""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import threading

READY = "hicache-daemon ready"
KEEP_LINES = 10_000  # of the daemon's output after start-up (older lines are dropped)
START_TIMEOUT_S = 120.0  # a start takes seconds; past this it is hung


class DaemonProcess(subprocess.Popen):
    """A daemon child whose output is read all along by a thread (a full pipe would block the
    daemon's logging, and so the daemon), keeping the last KEEP_LINES lines."""

    def start_draining(self, before: list[str]) -> None:
        self.lines: collections.deque[str] = collections.deque(before, maxlen=KEEP_LINES)
        self._drain = threading.Thread(target=self._read, daemon=True, name="daemon-output")
        self._drain.start()

    def _read(self) -> None:
        assert self.stdout is not None  # (start_daemon: stdout=PIPE)
        for line in self.stdout:
            self.lines.append(line)

    def output(self) -> str:
        """What the daemon printed so far (all of it once it has exited and been waited for)."""
        if self.poll() is not None:
            self._drain.join(timeout=5)
        return "".join(self.lines)


def start_daemon(endpoint: str, *flags: str, timeout: float = START_TIMEOUT_S) -> DaemonProcess:
    """Spawn ``python -m hicache.daemon`` and return once it reports ready (or raise with what
    it printed). Lines before the ready line (log messages) are kept, not mistaken for it. A
    daemon not ready within ``timeout`` seconds is killed and reported: a start that hangs
    (a planted FIFO, a stuck mount) never hangs its caller."""
    proc = DaemonProcess(
        [sys.executable, "-m", "hicache.daemon", "--endpoint", endpoint, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None  # (stdout=PIPE)
        for line in proc.stdout:  # until ready, or the daemon exits
            seen.append(line)
            if line.startswith(READY):
                ready.set()
                return

    reader = threading.Thread(target=read, daemon=True, name="daemon-start")
    reader.start()
    reader.join(timeout)
    if ready.is_set():
        proc.start_draining(seen)
        return proc
    hung = reader.is_alive()
    if hung:
        proc.kill()
    proc.wait()
    reader.join(5)
    why = f"not ready in {timeout:.0f} s: killed" if hung else f"exit {proc.returncode}"
    raise RuntimeError(f"hicache-daemon did not start ({why}): {''.join(seen)}")


def stop_daemon(proc: DaemonProcess, timeout: float = 30) -> str:
    """SIGTERM, wait, and return everything the daemon printed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return proc.output()
