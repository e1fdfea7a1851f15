"""SGLang 0.5.23's own server (``python -m sglang.launch_server``) for the tests and the served
benchmark: started from the SGLang venv (scripts/setup_sglang.sh) with the README's SGLang
config, on the CPU engine, on a loopback port, in a folder of its own, and always stopped by
PID (its process group: the tokenizer, scheduler and detokenizer processes).

The command is the README's own line: its flags, with the model, the daemon's endpoint and the
flags a CPU server needs (``CPU_FLAGS``, which the README names) put in. ``prefix_keys=True``
adds ``hicache_storage_pass_prefix_keys`` to the README's extra config (chains instead of the
README's one-page keys).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("HICACHE_SGLANG_VENV", ROOT / ".venv-sglang"))
PYTHON = VENV / "bin" / "python"
HERE = Path(__file__).resolve().parent
# SGLang's page hasher, compiled by scripts/setup_sglang.sh where the servers look for it
HASHER = VENV / "torch-extensions" / "hicache_hash_cpp" / "hicache_hash_cpp.so"
# what a CPU server needs beyond the README's line (the README says so): SGLang's CPU engine,
# the direct io backend and a page_first layout it can copy without CUDA kernels
CPU_FLAGS = {"--device": "cpu", "--hicache-io-backend": "direct",
             "--hicache-mem-layout": "page_first_direct"}  # fmt: skip
# this machine's limits (2 cores, a tiny model): not the README's business
SMALL = ["--max-total-tokens", "8192", "--max-running-requests", "8",
         "--attention-backend", "torch_native", "--disable-overlap-schedule"]  # fmt: skip
START_TIMEOUT_S = 300.0  # a start takes 25-30 s on two quiet cores, up to 100 s loaded


def readme_args() -> list[str]:
    """The arguments of the README's ``python -m sglang.launch_server`` line."""
    text = (ROOT / "README.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("python -m sglang.launch_server"))
    return shlex.split(line)[3:]


def server_args(
    model: str, endpoint: str, prefix_keys: bool = False, storage: str = "hicache"
) -> list[str]:
    """The README's arguments for ``model`` and ``endpoint`` on the CPU. ``storage``:
    "hicache" (the README's), "file" (SGLang's own file backend instead) or "none" (SGLang's
    hierarchical cache without a storage tier), for the served benchmark's comparisons."""
    args = readme_args()
    out: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i]
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        if storage != "hicache" and flag.startswith("--hicache-storage-backend"):
            i += 1 if value is None else 2
            if storage == "file" and flag == "--hicache-storage-backend":
                out += [flag, "file"]
            continue
        if flag == "--model-path":
            value = model
        elif flag in CPU_FLAGS:
            value = CPU_FLAGS[flag]
        elif flag == "--hicache-storage-backend-extra-config":
            extra = json.loads(value)
            extra["hicache.endpoint"] = endpoint
            if prefix_keys:
                extra["hicache_storage_pass_prefix_keys"] = True
            value = json.dumps(extra)
        out += [flag] if value is None else [flag, value]
        i += 1 if value is None else 2
    for flag, value in CPU_FLAGS.items():
        if flag not in out:
            out += [flag, value]
    return out


def make_model(folder: Path) -> Path:
    """The tiny random Llama (make_model.py) in ``folder``, made once."""
    if not (folder / "model.safetensors").exists():
        subprocess.run([str(PYTHON), str(HERE / "make_model.py"), str(folder)], check=True,
                       capture_output=True, timeout=300)  # fmt: skip
    return folder


class Server:
    """One running SGLang server: its port, log and HTTP API."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path, shm_before: set[str]):
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"
        self.shm_before = shm_before  # SGLang's kind of /dev/shm files before it started

    def post(self, path: str, body: dict | None = None, timeout: float = 300) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError:
            raise  # an answer (a refusal): the caller decides
        except (OSError, http.client.HTTPException) as exc:  # no answer: say why from its log
            state = "running" if self.proc.poll() is None else f"exited ({self.proc.returncode})"
            tail = "\n".join(self.output().splitlines()[-60:])
            raise RuntimeError(
                f"{path}: {exc!r}; the server is {state}, its log ends:\n{tail}"
            ) from None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode()

    def generate(self, text: str, max_new_tokens: int = 8) -> dict:
        """Greedy ``/generate``: {"text", "output_ids", "prompt_tokens", "cached_tokens",
        "details" (SGLang's cached_tokens_details: device, host, storage), "seconds"}."""
        t0 = time.perf_counter()
        d = self.post("/generate", {"text": text, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0}})  # fmt: skip
        meta = d["meta_info"]
        return {
            "text": d["text"],
            "output_ids": d["output_ids"],
            "prompt_tokens": meta["prompt_tokens"],
            "cached_tokens": meta["cached_tokens"],
            "details": meta.get("cached_tokens_details") or {},
            "seconds": time.perf_counter() - t0,
        }

    def flush(self) -> None:
        """``/flush_cache``: SGLang's device and host tiers emptied (the storage tier stays)."""
        deadline = time.monotonic() + 60
        while True:  # (refused while requests run or backups are queued: asked again)
            try:
                self.post("/flush_cache", timeout=60)
                return
            except urllib.error.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """Stop it (``stop``), then remove the /dev/shm files it left (SGLang's load slots
        and multiprocessing semaphores outlive a stopped server): those new since it started
        that no running process maps (another server's stay)."""
        stop(self.proc)
        left = _shm_names() - self.shm_before
        for name in left - _mapped(left):
            with contextlib.suppress(FileNotFoundError):
                (SHM / name).unlink()


SHM = Path("/dev/shm")
LEFT_BY_SGLANG = ("sglang_loads_", "sem.mp-")  # what a stopped SGLang server leaves there


def _shm_names() -> set[str]:
    return {p.name for p in SHM.iterdir() if p.name.startswith(LEFT_BY_SGLANG)}


def _mapped(names: set[str]) -> set[str]:
    """Of ``names`` (in /dev/shm), those some process maps or holds open."""
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            text = (proc / "maps").read_text(errors="replace")
            used |= {n for n in names if f"/dev/shm/{n}" in text}
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/") and target[9:] in names:
                        used.add(target[9:])
    return used


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    if proc.poll() is None:
        with _quiet():
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with _quiet():
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    with _quiet():  # children the launcher left (its group outlives it)
        os.killpg(proc.pid, signal.SIGKILL)


@contextmanager
def _quiet() -> Iterator[None]:
    try:
        yield
    except ProcessLookupError:
        pass


def start(model: Path, endpoint: str, folder: Path, *extra: str, prefix_keys: bool = False,
          port: int | None = None, storage: str = "hicache",
          env: dict[str, str] | None = None) -> Server:  # fmt: skip
    """Start SGLang's server with the README's config (see ``server_args``) in ``folder``;
    returns once it answers, else stops it and raises with its log's end."""
    from tests.l3_servers import free_port

    if not HASHER.exists():  # (else the first prefetch compiles it, and a flush kills SGLang)
        raise RuntimeError(f"{HASHER} is missing: run scripts/setup_sglang.sh")
    folder.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log = folder / f"sglang-{port}.log"
    # TMPDIR: SGLang names its ipc sockets by temp files it never removes: in ``folder``
    environ = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "TMPDIR": str(folder),
               "TORCH_EXTENSIONS_DIR": str(VENV / "torch-extensions"), **(env or {})}  # fmt: skip
    environ.pop("PYTHONPATH", None)  # (the SGLang venv has hicache installed: nothing else)
    cmd = [str(PYTHON), "-m", "sglang.launch_server", *server_args(str(model), endpoint,
           prefix_keys, storage), "--host", "127.0.0.1", "--port", str(port), *SMALL,
           *extra]  # fmt: skip
    before = _shm_names()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=folder, env=environ, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    server = Server(proc, port, log, before)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"SGLang's server exited ({proc.returncode})")
            if "fired up and ready" in server.output():
                return server
            if time.monotonic() > deadline:
                raise RuntimeError(f"SGLang's server not ready in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.25)
    except BaseException as exc:
        server.stop()
        tail = "\n".join(server.output().splitlines()[-40:])
        raise RuntimeError(f"{exc}; its log ends:\n{tail}") from None


def hicache_lines(server: Server) -> list[str]:
    """The server log's lines about the storage tier (hicache's own, and SGLang's prefetches)."""
    pattern = re.compile(r"hicache|prefetch success|storage backend", re.IGNORECASE)
    return [ln for ln in server.output().splitlines() if pattern.search(ln)]


if __name__ == "__main__":  # a look by hand: python -m tests.sglang_server.server MODEL ENDPOINT
    print(shlex.join(server_args(sys.argv[1], sys.argv[2])))
