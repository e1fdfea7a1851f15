"""scripts/demo.py's pure parts: counts, series, progress, table, summary and plot; no daemon."""

import io
import json

import pytest

from scripts.demo import (
    Progress,
    RequestCount,
    RunResult,
    count_request,
    hit_ratio_series,
    parse_args,
    plot_hit_ratios,
    render_table,
    summary,
    unreconciled_loads,
)
from tests.optional import require_module


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def runs() -> tuple[RunResult, RunResult]:
    device_only = RunResult(
        "device only",
        [RequestCount(1000, 0, 0, 1000), RequestCount(1000, 600, 0, 400)],
        {"backup_tokens": 0, "load_tokens": 0, "evicted_device_tokens": 1234, "integrity": "ok"},
        model_s=12.5,
        seconds=20.0,
    )
    hicache = RunResult(
        "hicache",
        [RequestCount(1000, 0, 0, 1000), RequestCount(1000, 600, 300, 100)],
        {"backup_tokens": 4567, "load_tokens": 300, "evicted_device_tokens": 99, "integrity": "ok"},
        model_s=14.0,  # higher on a busy machine: the table must not lead with it
        seconds=21.0,
    )
    return device_only, hicache


def row(table: str, name: str) -> list[str]:
    (line,) = [x for x in table.splitlines() if x.startswith(name + "  ")]
    return line[len(name) :].split()


def test_count_request_counts_the_prompt_only():
    assert count_request(100, 60, 40, 30) == RequestCount(100, 40, 30, 40)
    # the whole prompt and part of the answer cached: the answer's hits are not prompt hits
    assert count_request(100, 150, 120, 40) == RequestCount(100, 100, 0, 0)
    assert count_request(100, 90, 70, 50) == RequestCount(100, 70, 30, 10)
    # what the daemon read from its disk for the request is part of its host hit, at most
    assert count_request(100, 90, 20, 70, 48) == RequestCount(100, 20, 22, 10, 48)
    assert count_request(100, 90, 20, 70, 500) == RequestCount(100, 20, 0, 10, 70)


def test_hit_ratio_series_cumulative_and_windowed():
    counts = [RequestCount(100, 0, 0, 100), RequestCount(100, 50, 50, 0)]
    counts.append(RequestCount(200, 200, 0, 0))
    cum = hit_ratio_series(counts)
    assert cum["device"] == [0.0, 0.25, 0.625]
    assert cum["host"] == [0.0, 0.25, 0.125]
    assert cum["total"] == [0.0, 0.5, 0.75]
    win = hit_ratio_series(counts, window=1)
    assert win["device"] == [0.0, 0.5, 1.0]
    assert win["total"] == [0.0, 1.0, 1.0]
    assert hit_ratio_series([]) == {"device": [], "host": [], "disk": [], "total": []}
    disk = hit_ratio_series([RequestCount(100, 10, 20, 40, 30)])
    assert (disk["disk"], disk["total"]) == ([0.3], [0.6])


def test_the_restarted_column_shows_the_disks_share():
    d, h = runs()
    r = RunResult(
        "restarted",
        [RequestCount(1000, 0, 100, 200, 700), RequestCount(1000, 600, 0, 100, 300)],
        {"integrity": "ok"},
    )
    table = render_table(d, h, r)
    lines = table.splitlines()
    assert "1.000" not in row(table, "hit ratio: disk")[:2]
    assert row(table, "hit ratio: disk") == ["0.000", "0.000", "0.500"]
    assert row(table, "hit ratio: total") == ["0.300", "0.450", "0.850"]
    assert row(table, "prompt tokens computed") == ["1,400", "1,100", "300"]
    assert row(table, "  of them prompt tokens") == ["0", "300", "1,100"]  # (host + disk)
    assert "0.500 of their prompt tokens from its disk" in lines[2]
    assert lines[4].split() == ["device", "only", "hicache", "restarted"]
    assert len({len(x) for x in lines[4:] if not x.startswith("#")}) == 1
    s = summary(d, h, None, r)
    assert s["restarted"] == {
        "recomputed": 300, "hit_ratio_disk": 0.5, "hit_ratio_total": 0.85, "integrity": "ok"
    }  # fmt: skip


def test_a_run_whose_daemon_counts_other_loads_than_the_engine_fails():
    d, h = runs()
    h.loaded = 300  # (as many as its stats' load_tokens)
    assert unreconciled_loads([d, h]) == []
    h.loaded = 299
    assert unreconciled_loads([d, h]) == ["hicache: load_tokens 300 != 299 loaded"]
    d.stats["integrity"] = "node 3: bad"
    assert unreconciled_loads([d]) == ["device only: integrity 'node 3: bad'"]


def test_table_leads_with_tokens_computed_and_ends_with_wall_clock():
    d, h = runs()
    table = render_table(d, h)
    lines = table.splitlines()
    assert lines[0] == "prompt tokens computed: 1,400 vs 1,100 (1.27x fewer)"
    assert row(table, "prompt tokens") == ["2,000", "2,000"]
    assert row(table, "prompt tokens computed") == ["1,400", "1,100"]
    assert row(table, "hit ratio: device") == ["0.300", "0.300"]
    assert row(table, "hit ratio: host") == ["0.000", "0.150"]
    assert row(table, "hit ratio: total") == ["0.300", "0.450"]
    assert row(table, "backups to host (tokens)") == ["0", "4,567"]
    assert row(table, "loads from host (tokens)") == ["0", "300"]
    assert row(table, "device evictions (tokens)") == ["1,234", "99"]
    assert row(table, "integrity check") == ["ok", "ok"]
    assert row(table, "model seconds") == ["12.5", "14.0"]
    # model time comes after a heading that says it depends on machine load
    wall = next(i for i, x in enumerate(lines) if x.startswith("# wall-clock"))
    assert "machine load" in lines[wall]
    assert wall < next(i for i, x in enumerate(lines) if x.startswith("model seconds"))
    assert wall > next(i for i, x in enumerate(lines) if x.startswith("hit ratio: total"))
    # the columns line up: device only, then hicache
    assert lines[3].split() == ["device", "only", "hicache"]
    widths = {len(x) for x in lines[3:] if not x.startswith("#")}
    assert len(widths) == 1


def test_summary_is_one_json_line_with_the_numbers():
    d, h = runs()
    s = summary(d, h, None)
    line = json.dumps(s)
    assert "\n" not in line and json.loads(line) == s
    assert s["prompt_tokens"] == 2000
    assert (s["recomputed_device_only"], s["recomputed_hicache"]) == (1400, 1100)
    assert s["recompute_reduction"] == 1.27
    assert (s["hit_ratio_device"], s["hit_ratio_host"]) == (0.3, 0.15)
    assert (s["model_seconds_device_only"], s["model_seconds_hicache"]) == (12.5, 14.0)
    assert s["integrity"] == {"device_only": "ok", "hicache": "ok"}


def test_no_recompute_at_all_does_not_divide_by_zero():
    d, h = runs()
    h.counts = [RequestCount(1000, 1000, 0, 0)]
    assert render_table(d, h).startswith("prompt tokens computed: 1,400 vs 0 (1400.00x fewer)")


@pytest.mark.parametrize("total", [1, 7, 10, 96, 1000])
def test_progress_off_a_terminal_prints_at_most_ten_lines(total):
    out, clock = io.StringIO(), FakeClock()
    p = Progress("hicache", total, stream=out, tty=False, clock=clock)
    p.update(0, 0.0)
    for done in range(1, total + 1):
        clock.now += 0.5
        p.update(done, done / total)
    p.close()
    lines = out.getvalue().splitlines()
    assert 1 <= len(lines) <= 10 and "\r" not in out.getvalue()
    assert f"{total}/{total} requests" in lines[-1]
    assert f"{0.5 * total:.1f}s" in lines[-1] and "hit ratio 1.000" in lines[-1]
    assert "#" * Progress.WIDTH in lines[-1]


def test_progress_on_a_terminal_redraws_one_line():
    out, clock = io.StringIO(), FakeClock()
    p = Progress("device only", 4, stream=out, tty=True, clock=clock)
    for done in range(5):
        p.update(done, 0.25)
    p.close()
    text = out.getvalue()
    assert text.count("\r") == 5 and text.count("\n") == 1 and text.endswith("\n")
    assert text.rstrip("\n").split("\r")[-1].startswith("device only  [" + "#" * Progress.WIDTH)


def test_arguments():
    a = parse_args([])
    assert a.plot == "hicache-demo.png" and not a.no_plot
    a = parse_args(["--plot", "x.png", "--no-plot"])
    assert a.plot == "x.png" and a.no_plot


def test_plot_writes_a_png(tmp_path):
    require_module("matplotlib", what="the demo's plot")
    d, h = runs()
    path = tmp_path / "demo.png"
    plot_hit_ratios(d, h, str(path), window=1, restarted=h)
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(b"\x89PNG\r\n\x1a\n")
