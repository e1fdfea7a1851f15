"""Daemon settings: the embedded default, a TOML file, HICACHE_* variables and flags.

Precedence, lowest first: embedded default < ``--config`` TOML file < ``HICACHE_<FIELD>``
environment variables < command-line flags (``--<field-name>`` in kebab case). Every
HiCacheConfig field can be set each way, plus ``endpoint`` and ``lease_seconds``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from dataclasses import dataclass
from typing import Any

from hicache.config import HiCacheConfig
from hicache.endpoints import env_endpoint
from hicache.protocol import DEFAULT_LEASE_S

# A small model that serves on any machine: 4 layers, 4 KV heads of 64, fp32, page 16.
EMBEDDED_DEFAULT: dict[str, Any] = {
    "num_layers": 4,
    "num_kv_heads": 4,
    "head_dim": 64,
    "dtype": "float32",  # CPU matmuls in fp16/bf16 are several times slower than fp32
    "page_size": 16,
    "device": "cpu",
    "device_tokens": 16384,
    "host_ratio": 4.0,
}


@dataclass(frozen=True)
class DaemonSettings:
    config: HiCacheConfig
    endpoint: str  # ipc://path or tcp://host:port
    lease_seconds: float  # session lease without messages

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: _plain(getattr(self.config, f.name)) for f in _fields()}
        out.update(endpoint=self.endpoint, lease_seconds=self.lease_seconds)
        return out


def _plain(value: Any) -> Any:
    return value.value if hasattr(value, "value") else value


def _fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(HiCacheConfig))


_TYPES = {
    "num_layers": int,
    "num_kv_heads": int,
    "head_dim": int,
    "kv_lora_rank": int,
    "qk_rope_head_dim": int,
    "page_size": int,
    "device_tokens": int,
    "host_tokens": int,
    "write_through_threshold": int,
    "load_back_threshold": int,
    "host_ratio": float,
    "lease_seconds": float,
}


def _convert(name: str, raw: str) -> Any:
    kind = _TYPES.get(name, str)
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}: {raw!r} is not a valid {kind.__name__}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hicache-daemon", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="TOML file with any of the settings below")
    ap.add_argument("--print-config", action="store_true", help="print the settings and exit")
    for name in [f.name for f in _fields()] + ["endpoint", "lease_seconds"]:
        ap.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None)
    return ap


def resolve(args: argparse.Namespace, environ: dict[str, str] | None = None) -> DaemonSettings:
    """Merge the four sources; raises ValueError naming the bad field."""
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = dict(EMBEDDED_DEFAULT)
    merged.update(endpoint=env_endpoint(), lease_seconds=DEFAULT_LEASE_S)
    names = [f.name for f in _fields()] + ["endpoint", "lease_seconds"]
    if args.config:
        with open(args.config, "rb") as fh:
            table = tomllib.load(fh)
        unknown = set(table) - set(names)
        if unknown:
            raise ValueError(f"{args.config}: unknown settings {sorted(unknown)}")
        merged.update(table)
    for name in names:
        raw = environ.get(f"HICACHE_{name.upper()}")
        if raw is not None:
            merged[name] = _convert(name, raw)
    for name in names:
        raw = getattr(args, name, None)
        if raw is not None:
            merged[name] = _convert(name, raw)
    endpoint, lease = merged.pop("endpoint"), float(merged.pop("lease_seconds"))
    if lease <= 0:
        raise ValueError(f"lease_seconds: must be > 0, got {lease}")
    return DaemonSettings(HiCacheConfig(**merged), endpoint, lease)
