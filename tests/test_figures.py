"""One table of figures (hicache/observe/figures.py): what STATS reports is exactly what the
table names, and /metrics and ``hicache info`` show every figure where the table says."""

from __future__ import annotations

import os

import pytest

from hicache.client.info_view import sections
from hicache.daemon.config import build_parser, resolve
from hicache.daemon.observe import families
from hicache.daemon.server import Daemon
from hicache.observe import FIGURES, L3_FIGURES, STRUCTURES

SMALL = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8", "--keep-host", "false"]


def _report(folder, *extra: str) -> dict:
    os.makedirs(folder, mode=0o700, exist_ok=True)
    args = [*SMALL, "--endpoint", f"ipc://{folder}/d.sock", *extra]
    daemon = Daemon(resolve(build_parser().parse_args(args), environ={}))
    try:
        return daemon.handlers.report(check=True)
    finally:
        daemon.close()


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    """A daemon with everything on (host tier, third tier, KV events), and one for engines."""
    folder = tmp_path_factory.mktemp("figures")
    full = _report(folder / "a", "--device-tokens", "512", "--host-tokens", "1024",
                   "--l3", "memory://figures", "--l3-model", "m",
                   "--events-endpoint", f"ipc://{folder}/a/events.sock")  # fmt: skip
    engine = _report(folder / "b", "--device-tier", "engine", "--host-bytes", "1MiB")
    return [full, engine]


def test_stats_reports_what_the_table_names_and_nothing_else(reports):
    names = {f.name for f in FIGURES}
    for report in reports:
        unknown = set(report) - names - set(STRUCTURES)
        assert not unknown, f"figures missing from hicache/observe/figures.py: {unknown}"
    seen = set().union(*reports)
    assert names <= seen, f"figures no daemon reports: {names - seen}"
    assert {f.name for f in L3_FIGURES} <= set(reports[0]["l3"])


def test_metrics_export_every_figure_the_table_exports(reports):
    for report in reports:
        exported = {family.name for family in families(report)}
        for f in (*FIGURES, *(L3_FIGURES if "l3" in report else ())):
            if f.metric and (f.always or f.name in report):
                # (prometheus-client drops _total from a counter family's own name)
                assert f"hicache_{f.metric}".removesuffix("_total") in exported, f.name


def test_info_shows_every_figure_in_its_section(reports):
    for report in reports:
        groups = sections(report)
        for f in FIGURES:
            if f.section and f.name in report:
                assert f.name in groups[f.section], (f.section, f.name)
        for f in L3_FIGURES:
            if "l3" in report:
                assert f.name in groups["l3"], f.name
