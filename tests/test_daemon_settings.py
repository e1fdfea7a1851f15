"""Daemon settings precedence, stale segment cleanup, and the CLI's INFO sections."""

import fcntl
import json
import os
import subprocess
import sys

import pytest

from hicache.client.info_view import sections
from hicache.daemon.config import build_parser, resolve
from hicache.daemon.keep import InstanceLock, remove_stale


def settings(argv, environ=None):
    return resolve(build_parser().parse_args(argv), environ or {})


def test_precedence_default_toml_env_flags(tmp_path):
    toml = tmp_path / "hicache.toml"
    toml.write_text(
        'page_size = 8\ndevice_tokens = 512\nwrite_policy = "write_back"\n'
        'endpoint = "ipc:///tmp/from-toml.sock"\n'
    )
    s = settings([])
    assert s.config.page_size == 16 and s.config.num_layers == 4  # the embedded default
    s = settings(["--config", str(toml)])
    assert (s.config.page_size, s.config.device_tokens) == (8, 512)
    assert s.config.write_policy == "write_back" and s.endpoint == "ipc:///tmp/from-toml.sock"
    s = settings(["--config", str(toml)], {"HICACHE_DEVICE_TOKENS": "1024"})
    assert s.config.device_tokens == 1024
    s = settings(
        ["--config", str(toml), "--device-tokens", "2048"], {"HICACHE_DEVICE_TOKENS": "1024"}
    )
    assert s.config.device_tokens == 2048
    env = {"HICACHE_ENDPOINT": "tcp://*:5555", "HICACHE_LEASE_SECONDS": "2.5"}
    with pytest.raises(ValueError, match="every local user"):  # loopback tcp: asked for, or not
        settings([], env)
    s = settings([], {**env, "HICACHE_INSECURE_LOCAL_TCP": "true"})
    assert s.endpoint == "tcp://*:5555" and s.lease_seconds == 2.5 and s.insecure_local_tcp


@pytest.mark.parametrize(
    ("argv", "environ", "field"),
    [
        (["--page-size", "x"], {}, "page_size"),
        (["--write-policy", "sometimes"], {}, "write_policy"),
        ([], {"HICACHE_HOST_RATIO": "0.5"}, "host_ratio"),
        (["--lease-seconds", "0"], {}, "lease_seconds"),
        (["--busy-poll-us", "-1"], {}, "busy_poll_us"),
        ([], {"HICACHE_BUSY_POLL_US": "1e9"}, "busy_poll_us"),
    ],
)
def test_bad_settings_name_the_field(argv, environ, field):
    with pytest.raises(ValueError, match=field):
        settings(argv, environ)


@pytest.mark.parametrize("value", ['"abc"', '"200"', "true", "[1]", "{a = 1}"])
@pytest.mark.parametrize("field", ["busy_poll_us", "shutdown_timeout", "lease_seconds"])
def test_a_toml_number_of_the_wrong_type_names_the_field(tmp_path, field, value):
    toml = tmp_path / "hicache.toml"
    toml.write_text(f"{field} = {value}\n")
    with pytest.raises(ValueError, match=f"{field}: expected a number"):
        settings(["--config", str(toml)])


def test_a_file_that_is_not_toml_is_named(tmp_path):
    toml = tmp_path / "broken.toml"
    toml.write_text("busy_poll_us = \n")
    with pytest.raises(ValueError, match="broken.toml: not TOML"):
        settings(["--config", str(toml)])


def test_a_config_file_that_is_not_text_is_named(tmp_path):
    toml = tmp_path / "image.toml"
    toml.write_bytes(b"\x89PNG\x00\x01binary")
    with pytest.raises(ValueError, match="image.toml: not TOML"):
        settings(["--config", str(toml)])


def test_a_bad_variable_is_named():
    with pytest.raises(ValueError, match="page_size: 'x'.*HICACHE_PAGE_SIZE"):
        settings([], {"HICACHE_PAGE_SIZE": "x"})


def test_a_value_out_of_range_says_which_source_set_it(tmp_path):
    """A range error names the variable or the file the value came from (a flag over them
    is the user's own words: nothing added)."""
    toml = tmp_path / "site.toml"
    toml.write_text("busy_poll_us = 20000\nlease_seconds = 0\n")
    with pytest.raises(ValueError, match=r"busy_poll_us: .*20000 \(from HICACHE_BUSY_POLL_US\)$"):
        settings([], {"HICACHE_BUSY_POLL_US": "20000"})
    with pytest.raises(ValueError, match=r"lease_seconds: .* \(from .*site.toml\)$"):
        settings(["--config", str(toml), "--busy-poll-us", "10"])
    with pytest.raises(ValueError, match=r"busy_poll_us: .*20000$"):  # the flag won
        settings(["--config", str(toml), "--busy-poll-us", "20000", "--lease-seconds", "1"])
    env = {"HICACHE_BUSY_POLL_US": "5", "HICACHE_METRICS_PORT": "70000"}
    with pytest.raises(ValueError, match=r"metrics_port: .* \(from HICACHE_METRICS_PORT\)$"):
        settings(["--config", str(toml), "--lease-seconds", "1"], env)


def test_print_config_shows_the_result():
    out = subprocess.run(
        [sys.executable, "-m", "hicache.daemon", "--print-config", "--num-layers", "7"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)["num_layers"] == 7
    bad = subprocess.run(
        [sys.executable, "-m", "hicache.daemon", "--page-size", "0"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "page_size" in bad.stderr


def test_stale_segments_are_told_by_their_lock_not_their_pid(tmp_path):
    uid = os.getuid()
    # a live daemon of another PID namespace: its pid means nothing here, its lock is held
    alive = [tmp_path / f"hicache-{uid}-999999999-aaaa-{pool}" for pool in ("lock", "device")]
    # a dead daemon that was pid 1 in its container (pid 1 is always "alive" here): lock free
    dead = [tmp_path / f"hicache-{uid}-1-bbbb-{pool}" for pool in ("lock", "device", "host")]
    legacy = tmp_path / f"hicache-{uid}-{os.getpid()}-cccc-device"  # no lock file at all
    other = tmp_path / "hicache-99999-1-zz-device"  # another user's: never touched
    for path in (*alive, *dead, legacy, other):
        path.write_bytes(b"x")
    held = os.open(alive[0], os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        removed = remove_stale(str(tmp_path))
    finally:
        os.close(held)
    assert sorted(removed) == sorted(p.name for p in (*dead, legacy))
    order = [removed.index(p.name) for p in dead]
    assert order[0] == max(order)  # an instance's lock file goes last
    assert all(p.exists() for p in (*alive, other))
    lock = InstanceLock("dddd", str(tmp_path))  # held by this process: alive
    try:  # the first instance's lock was released above: it is gone now, this one is not
        assert sorted(remove_stale(str(tmp_path))) == sorted(p.name for p in alive)
        assert os.path.exists(lock.path)
    finally:
        lock.close()
    assert not os.path.exists(lock.path)


def test_info_sections_group_the_stats():
    stats = {
        k: 0
        for k in (
            "device_capacity_tokens",
            "host_capacity_tokens",
            "page_size",
            "device_free_tokens",
            "device_cached_tokens",
            "device_owned_tokens",
            "device_protected_tokens",
            "device_evictable_tokens",
            "evicted_device_tokens",
            "host_free_tokens",
            "host_cached_tokens",
            "evicted_host_tokens",
            "backup_tokens",
            "backup_bytes",
            "load_tokens",
            "load_bytes",
            "inflight_transfers",
            "backup_failed_tokens",
            "transfer_errors",
            "sessions",
            "uptime_s",
            "boot_epoch",
            "pid",
        )
    }
    stats.update(
        hit_device_tokens=30,
        hit_host_tokens=10,
        miss_tokens=60,
        endpoint="ipc://x",
        device_capacity_tokens=1024,
        token_bytes=2048,
    )
    info = sections(stats)
    assert list(info) == [
        "server",
        "config",
        "memory",
        "device_pool",
        "host_pool",
        "hits",
        "engines",
        "transfers",
        "l3",
        "disk",
        "sessions",
    ]
    assert info["engines"]["engine_hit_ratio"] == 0.0  # (no engine reported figures)
    assert info["l3"] == {"enabled": 0} and info["disk"] == {"enabled": 0}
    disk = {**stats, "config": {"disk": "/nvme/hc"}}
    assert sections(disk)["disk"] == {"enabled": 1, "opened": 0}  # (opens at its first use)
    assert sections({**stats, "l3": {"url": "redis://h:1", "hit_pages": 3}})["l3"] == {
        "enabled": 1,
        "url": "redis://h:1",
        "hit_pages": 3,
    }
    assert info["hits"]["hit_ratio_device"] == 0.3 and info["hits"]["hit_ratio"] == 0.4
    assert info["memory"]["device_capacity_human"] == "2.00M"
