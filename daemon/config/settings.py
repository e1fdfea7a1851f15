"""Daemon settings: the embedded default, a TOML file, HICACHE_* variables and flags, merged
and checked into ``DaemonSettings`` (what each of the daemon's own settings means and its
default: ``fields.py``).

Precedence, lowest first: embedded default < ``--config`` TOML file < ``HICACHE_<FIELD>``
environment variables < command-line flags (``--<field-name>`` in kebab case). Every
HiCacheConfig field can be set each way, plus the daemon's own settings (``DAEMON_FIELDS``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import tomllib
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hicache.config import DTYPES, HiCacheConfig
from hicache.curve import load_secret
from hicache.daemon.config.fields import (
    DAEMON_FIELDS,
    DEFAULT_ENGINE_HOST_BYTES,
    DEVICE_TIERS,
    EMBEDDED_DEFAULT,
    parse_bytes,
)
from hicache.daemon.config.l3 import L3_FIELDS, l3_config
from hicache.endpoints import env_endpoint, is_loopback
from hicache.l3 import WRITE_BACK_NEEDS_HOST, L3Config, L3WritePolicy
from hicache.transfers import resolve_backend


@dataclass(frozen=True)
class DaemonSettings:
    config: HiCacheConfig
    endpoint: str  # ipc://path or tcp://host:port
    lease_seconds: float  # session lease without messages
    quarantine_seconds: float | None = None  # None: the lease
    session_owned_fraction: float = 0.75
    session_max_locks: int = 65536
    session_max_loads: int = 256
    max_sessions: int = 4096
    device_tier: str = "daemon"  # daemon: the daemon's device pool; engine: engines' own blocks
    host_bytes: int | None = None  # device_tier=engine: the pool's size (None: engine_tokens)
    engine_tokens: int | None = None  # device_tier=engine: host_tokens, the pool's size in tokens
    l3: L3Config | None = None  # the store under the host tier (None: no third tier)
    l3_settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # as given (--l3-*)
    metrics_port: int = 0  # Prometheus /metrics (0: off)
    metrics_host: str = "127.0.0.1"
    events_endpoint: str | None = None  # KV events PUB (None: off)
    events_replay_endpoint: str | None = None  # their replay and dump ROUTER (None: off)
    events_topic: str = ""
    events_buffer: int = 10000  # batches kept for replay
    shutdown_timeout: float = 10.0  # the longest a SIGTERM drain lasts
    busy_poll_us: float = 200.0  # how long the loop watches the socket after a reply
    keep_host: bool = True  # a clean stop leaves the host pool for the next daemon to adopt
    snapshot_seconds: float = 30.0  # periodic host snapshots (0: only at a clean stop)
    keep_host_seconds: float = 120.0  # a kept host pool waits this long for a successor
    curve_secret_key: str | None = None  # CurveZMQ: the daemon's secret key file
    curve_clients: str | None = None  # CurveZMQ: folder of the allowed clients' public keys
    insecure_local_tcp: bool = False  # loopback tcp without CurveZMQ: any local user connects

    @property
    def curve(self) -> bool:
        return self.curve_secret_key is not None

    @property
    def engine_tier(self) -> bool:
        return self.device_tier == "engine"

    def engine_pool_tokens(self, page_bytes: int, page_size: int) -> int:
        """device_tier=engine: the pool's size in tokens for pages of ``page_bytes``."""
        if self.host_bytes is None and self.engine_tokens:
            return self.engine_tokens // page_size * page_size
        size = DEFAULT_ENGINE_HOST_BYTES if self.host_bytes is None else self.host_bytes
        return size // page_bytes * page_size

    @property
    def quarantine(self) -> float:
        return self.lease_seconds if self.quarantine_seconds is None else self.quarantine_seconds

    def as_dict(self, config: HiCacheConfig | None = None) -> dict[str, Any]:
        """The settings as JSON-able values; ``config``: the cache's config in their place
        (device_tier=engine: the pool an engine's layout made)."""
        config = config or self.config
        out = {f.name: _plain(getattr(config, f.name)) for f in _fields()}
        out.update({name: getattr(self, name) for name in DAEMON_FIELDS})
        out.update({name: default for name, (_, default, _) in L3_FIELDS.items()})
        out.update(self.l3_settings)
        out["quarantine_seconds"] = self.quarantine
        if self.l3 is not None:  # what --disk resolves them to (its admission, its drain)
            out["l3_write_policy"] = str(self.l3.write_policy)
            out["l3_write_threshold"] = self.l3.write_threshold
            out["l3_close_drain_s"] = self.l3.close_drain_s
        # what the defaults resolve to (not settings themselves)
        out["host_capacity_tokens"] = config.host_capacity_tokens
        with contextlib.suppress(ValueError):  # (a backend that cannot run fails at start)
            out["transfer_backend_resolved"] = resolve_backend(config).value
        return out


def _number(settings: dict[str, Any], name: str) -> float:
    """A numeric setting as a float; ValueError naming it for anything else (a TOML string,
    bool, list or table: flags and variables arrive converted already)."""
    value = settings[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    return float(value)


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
    "verify_pages": bool,
} | {name: kind for name, (kind, _, _) in (DAEMON_FIELDS | L3_FIELDS).items()}


_FLAGS = {"true": True, "1": True, "on": True, "yes": True,
          "false": False, "0": False, "off": False, "no": False}  # fmt: skip


def _convert(name: str, raw: str) -> Any:
    if name == "host_bytes":
        return parse_bytes(raw)
    kind = _TYPES.get(name, str)
    if kind is bool:
        flag = _FLAGS.get(raw.strip().lower())
        if flag is None:
            raise ValueError(f"{name}: {raw!r} is not true or false")
        return flag
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}: {raw!r} is not a valid {kind.__name__}") from None


def config_help() -> dict[str, str]:
    """Each HiCacheConfig field's help (its metadata in config.py: the one place it is
    written)."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(HiCacheConfig)}


def _choices(field: dataclasses.Field) -> list[str] | None:
    if field.name == "dtype":
        return list(DTYPES)
    enum = next((t for t in _enum_types() if t.__name__ in str(field.type)), None)
    return [m.value for m in enum] if enum else None


def _enum_types() -> list[type[Enum]]:
    from hicache import config

    return [v for v in vars(config).values() if isinstance(v, type) and issubclass(v, Enum)]


def _address(endpoint: str) -> str:
    """An endpoint in one spelling: an ipc path made absolute, tcp://*: as loopback. ValueError
    for one without a transport this daemon serves (a bare path is the usual slip)."""
    if not endpoint.startswith(("ipc://", "tcp://")):
        hint = f" (did you mean ipc://{endpoint}?)" if endpoint.startswith(("/", ".")) else ""
        raise ValueError(f"endpoint: {endpoint!r} is neither ipc://PATH nor tcp://HOST:PORT{hint}")
    if endpoint.startswith("ipc://@"):
        raise ValueError(
            f"endpoint: {endpoint} is an abstract socket, which has no owner: any local user "
            "could bind the name first or connect; use ipc://PATH in a folder of your own"
        )
    if endpoint.startswith("ipc://"):
        return "ipc://" + os.path.abspath(endpoint[len("ipc://") :])
    if endpoint.startswith(("tcp://*:", "tcp://:")):
        return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]
    return endpoint


def _check_curve(
    curve: dict[str, Any], endpoint: str, events: dict[str, Any], insecure_local: bool
) -> None:
    """Both CurveZMQ settings or neither; usable key files; no tcp address without them
    (anyone on the network could use the daemon, or read prompts' tokens), loopback included
    unless ``insecure_local`` (every local user could)."""
    secret, clients = curve["curve_secret_key"], curve["curve_clients"]
    if (secret is None) != (clients is None):
        raise ValueError("curve_secret_key and curve_clients: give both or neither")
    if secret is not None:
        load_secret(secret)  # CurveKeyError (a ValueError) names the file and the fault
        if not os.path.isdir(clients) or not any(
            name.endswith(".key") for name in os.listdir(clients)
        ):
            raise ValueError(f"curve_clients: {clients} is not a folder of client .key files")
        return
    for name, value in (("endpoint", endpoint), *events.items()):
        if value is not None and not is_loopback(str(value)):
            raise ValueError(
                f"{name}: {value} is reachable from other machines; listening there needs "
                "CurveZMQ keys (hicache keygen; --curve-secret-key, --curve-clients), or use "
                "a loopback or ipc:// address"
            )
        if value is not None and str(value).startswith("tcp://") and not insecure_local:
            raise ValueError(
                f"{name}: {value} without CurveZMQ keys lets every local user connect: read "
                "cached prompts' token ids and insert KV under any tokens. Use ipc://PATH "
                "(private to your user), CurveZMQ keys (hicache keygen), or accept the risk "
                "with --insecure-local-tcp true"
            )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hicache-daemon",
        description="hicache-daemon: serve a hierarchical KV cache to engines over ZeroMQ. "
        "Each setting below can also come from a TOML file (--config) or HICACHE_<NAME>.",
    )
    ap.add_argument("--config", help="TOML file with any of the settings below")
    ap.add_argument("--print-config", action="store_true", help="print the settings and exit")
    ap.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    ap.add_argument(
        "--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="the least severe events logged [default: INFO]",
    )  # fmt: skip
    comments = config_help()
    model = ap.add_argument_group("cache (HiCacheConfig; defaults are the embedded default)")
    for f in _fields():
        default = EMBEDDED_DEFAULT.get(f.name, _plain(f.default))
        help_ = comments.get(f.name, "")
        choices = _choices(f)
        if choices:
            help_ = f"{help_} (one of: {', '.join(choices)})".strip()
        flag = f"--{f.name.replace('_', '-')}"
        model.add_argument(flag, dest=f.name, metavar=f.name.upper(), help=help_ or " ")
        _shown_default(model, f.name, default)
    daemon = ap.add_argument_group("daemon")
    for name, (_, default, help_) in DAEMON_FIELDS.items():
        flag = f"--{name.replace('_', '-')}"
        daemon.add_argument(flag, dest=name, metavar=name.upper(), help=help_)
        _shown_default(daemon, name, default)
    l3 = ap.add_argument_group("third tier (a distributed store under the host tier)")
    for name, (_, default, help_) in L3_FIELDS.items():
        flag = f"--{name.replace('_', '-')}"
        l3.add_argument(flag, dest=name, metavar=name.upper(), help=help_ or " ")
        _shown_default(l3, name, default)
    return ap


def _shown_default(group: argparse._ArgumentGroup, name: str, default: Any) -> None:
    """Show ``default`` in --help while the parsed value stays None (meaning: not given)."""
    action = group._group_actions[-1]
    if default is not None:
        action.help = f"{action.help} [default: {default}]"
    action.default = None


def resolve(args: argparse.Namespace, environ: dict[str, str] | None = None) -> DaemonSettings:
    """Merge the four sources; raises ValueError naming the bad field, and where its value came
    from when that was the config file or a HICACHE_* variable."""
    origin: dict[str, str] = {}  # field: the file or variable that set it last (not flags)
    merged = _merge(args, os.environ if environ is None else environ, origin)
    try:
        return _checked(merged)
    except ValueError as exc:
        where = origin.get(str(exc).split(":", 1)[0])
        if where is None or where in str(exc):
            raise
        raise ValueError(f"{exc} (from {where})") from None


def _merge(args: argparse.Namespace, environ: Any, origin: dict[str, str]) -> dict[str, Any]:
    """Every field's value, lowest source first; notes in ``origin`` which file or variable
    set each field (a flag removes the note)."""
    merged: dict[str, Any] = dict(EMBEDDED_DEFAULT)
    merged.update({name: default for name, (_, default, _) in DAEMON_FIELDS.items()})
    merged.update({name: default for name, (_, default, _) in L3_FIELDS.items()})
    merged["endpoint"] = env_endpoint(environ)
    names = [f.name for f in _fields()] + list(DAEMON_FIELDS) + list(L3_FIELDS)
    if args.config:
        with open(args.config, "rb") as fh:
            try:
                table = tomllib.load(fh)
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{args.config}: not TOML: {exc}") from None
        unknown = set(table) - set(names)
        if unknown:
            raise ValueError(f"{args.config}: unknown settings {sorted(unknown)}")
        merged.update(table)
        origin.update(dict.fromkeys(table, str(args.config)))
    for name in names:
        raw = environ.get(f"HICACHE_{name.upper()}")
        if raw is not None:
            try:
                merged[name] = _convert(name, raw)
            except ValueError as exc:  # say where the value came from
                raise ValueError(f"{exc} (from HICACHE_{name.upper()})") from None
            origin[name] = f"HICACHE_{name.upper()}"
    for name in names:
        raw = getattr(args, name, None)
        if raw is not None:
            merged[name] = _convert(name, raw)
            origin.pop(name, None)
    return merged


def _checked(merged: dict[str, Any]) -> DaemonSettings:
    """The settings from the merged fields; ValueError (starting with the field's name) for
    the first bad one."""
    daemon = {name: merged.pop(name) for name in DAEMON_FIELDS}
    l3_settings = {name: merged.pop(name) for name in L3_FIELDS}
    l3 = l3_config(l3_settings, parse_bytes)
    if l3 is not None and daemon["device_tier"] != "engine" and merged.get("host_tokens") == 0:
        raise ValueError("l3: a third tier needs a host tier (host_tokens > 0)")
    if l3 is not None and daemon["device_tier"] == "engine":
        if l3.write_policy is L3WritePolicy.WRITE_BACK:
            raise ValueError(WRITE_BACK_NEEDS_HOST)
    engine_tokens = None
    if daemon["device_tier"] == "engine":  # the pool's shape comes from the engines' layout
        engine_tokens = merged.pop("host_tokens", None)
        if engine_tokens is not None and (
            isinstance(engine_tokens, bool)
            or not isinstance(engine_tokens, int)
            or engine_tokens < 1
        ):
            raise ValueError(f"host_tokens: expected a positive integer, got {engine_tokens!r}")
    lease = _number(daemon, "lease_seconds")
    if not lease > 0:
        raise ValueError(f"lease_seconds: must be > 0, got {lease}")
    quarantine = daemon["quarantine_seconds"]
    if quarantine is not None and not _number(daemon, "quarantine_seconds") >= 0:
        raise ValueError(f"quarantine_seconds: must be >= 0, got {quarantine}")
    fraction = _number(daemon, "session_owned_fraction")
    if not 0 < fraction <= 1:
        raise ValueError(f"session_owned_fraction: must be in (0, 1], got {fraction}")
    for name in ("session_max_locks", "session_max_loads", "max_sessions"):
        if isinstance(daemon[name], bool) or not isinstance(daemon[name], int) or daemon[name] < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {daemon[name]!r}")
    if daemon["device_tier"] not in DEVICE_TIERS:
        raise ValueError(
            f"device_tier: {daemon['device_tier']!r} is not one of {', '.join(DEVICE_TIERS)}"
        )
    port = daemon["metrics_port"]
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"metrics_port: must be a port number (0: off), got {port!r}")
    events = {k: daemon[k] for k in ("events_endpoint", "events_replay_endpoint")}
    for name, value in events.items():
        if value is not None and not str(value).startswith(("tcp://", "ipc://")):
            raise ValueError(f"{name}: expected tcp://HOST:PORT or ipc://PATH, got {value!r}")
    if events["events_replay_endpoint"] is not None and events["events_endpoint"] is None:
        raise ValueError("events_replay_endpoint: needs events_endpoint")
    taken = {_address(str(daemon["endpoint"])): "endpoint"}
    for name, value in events.items():  # an ipc bind would take another socket's path over
        if value is not None:
            if _address(value) in taken:
                raise ValueError(f"{name}: {value} is already the {taken[_address(value)]}")
            taken[_address(value)] = name
    curve = {k: daemon[k] for k in ("curve_secret_key", "curve_clients")}
    if not isinstance(daemon["insecure_local_tcp"], bool):
        raise ValueError(
            f"insecure_local_tcp: expected true or false, got {daemon['insecure_local_tcp']!r}"
        )
    _check_curve(curve, str(daemon["endpoint"]), events, daemon["insecure_local_tcp"])
    if not isinstance(daemon["keep_host"], bool):
        raise ValueError(f"keep_host: expected true or false, got {daemon['keep_host']!r}")
    grace = _number(daemon, "keep_host_seconds")
    if not 1 <= grace <= 86400:
        raise ValueError(f"keep_host_seconds: seconds in [1, 86400], got {grace}")
    every = _number(daemon, "snapshot_seconds")
    if not 0 <= every <= 86400:
        raise ValueError(f"snapshot_seconds: seconds in [0, 86400], got {every}")
    shutdown_timeout = _number(daemon, "shutdown_timeout")
    if not 0 <= shutdown_timeout <= 3600:
        raise ValueError(f"shutdown_timeout: seconds in [0, 3600], got {shutdown_timeout}")
    busy_poll_us = _number(daemon, "busy_poll_us")
    if not 0 <= busy_poll_us <= 10_000:
        raise ValueError(f"busy_poll_us: microseconds in [0, 10000], got {busy_poll_us:g}")
    buffer = daemon["events_buffer"]
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
        raise ValueError(f"events_buffer: must be an integer >= 1, got {buffer!r}")
    host_bytes = daemon["host_bytes"]
    if host_bytes is not None:
        host_bytes = parse_bytes(host_bytes)
        if host_bytes < 1 << 20:
            raise ValueError(f"host_bytes: at least 1MiB, got {host_bytes}")
        if daemon["device_tier"] != "engine":
            raise ValueError("host_bytes: only with device_tier=engine (else host_tokens)")
    return DaemonSettings(
        HiCacheConfig(**merged),
        str(daemon["endpoint"]),
        lease,
        None if quarantine is None else float(quarantine),
        fraction,
        daemon["session_max_locks"],
        daemon["session_max_loads"],
        daemon["max_sessions"],
        daemon["device_tier"],
        host_bytes,
        engine_tokens,
        l3,
        l3_settings,
        metrics_port=port,
        metrics_host=str(daemon["metrics_host"]),
        events_topic=str(daemon["events_topic"]),
        events_buffer=buffer,
        shutdown_timeout=shutdown_timeout,
        busy_poll_us=busy_poll_us,
        keep_host=daemon["keep_host"],
        snapshot_seconds=every,
        keep_host_seconds=grace,
        insecure_local_tcp=daemon["insecure_local_tcp"],
        **curve,
        **events,
    )
