"""Load SGLang's RadixCache (sglang==0.4.6.post5) for side-by-side benchmarks.

The wheel is downloaded once with ``pip download --no-deps`` into a cache folder; only
``sglang/srt/mem_cache/radix_cache.py`` is read from it and executed with its engine imports
replaced by inert stubs. Nothing of SGLang is copied into this repository.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

VERSION = "0.4.6.post5"
MEMBER = "sglang/srt/mem_cache/radix_cache.py"
CACHE_DIR = Path(os.environ.get("HICACHE_BENCH_CACHE", Path.home() / ".cache" / "hicache-bench"))


def _wheel() -> Path:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    found = sorted(CACHE_DIR.glob(f"sglang-{VERSION}-*.whl"))
    if not found:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                f"sglang=={VERSION}",
                "-d",
                str(CACHE_DIR),
            ],
            capture_output=True,  # (pip's warnings about this machine's index are noise here)
            text=True,
        )
        if done.returncode:
            raise RuntimeError(f"pip download sglang=={VERSION} failed:\n{done.stderr}")
        found = sorted(CACHE_DIR.glob(f"sglang-{VERSION}-*.whl"))
    return found[0]


def _stub(name: str, **attrs: object) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


class _Inert:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass


def load_radix_cache() -> type:
    """SGLang's RadixCache class, with its scheduler-side imports stubbed out."""
    source = zipfile.ZipFile(_wheel()).read(MEMBER).decode()
    for pkg in (
        "sglang",
        "sglang.srt",
        "sglang.srt.mem_cache",
        "sglang.srt.managers",
        "sglang.srt.disaggregation",
    ):
        _stub(pkg, __path__=[])
    _stub(
        "sglang.srt.disaggregation.kv_events",
        AllBlocksCleared=_Inert,
        BlockRemoved=_Inert,
        BlockStored=_Inert,
        KVCacheEvent=_Inert,
    )
    _stub("sglang.srt.managers.schedule_batch", global_server_args_dict={})
    _stub("sglang.srt.mem_cache.base_prefix_cache", BasePrefixCache=object)
    _stub("sglang.srt.mem_cache.memory_pool", ReqToTokenPool=_Inert, TokenToKVPoolAllocator=_Inert)
    module = types.ModuleType("sglang.srt.mem_cache.radix_cache")
    exec(compile(source, MEMBER, "exec"), module.__dict__)  # noqa: S102
    return module.RadixCache
