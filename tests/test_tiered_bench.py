"""The disk tier's capacity benchmark, short version (issue 33; the long one:
``python benchmarks/tiered.py capacity``).

Real servers with a 4 MiB budget take blocks of new ids at dim 16 under SGD and Adagrad
until refused (or a capped table size), then a few Zipf steps; the JSON must hold every
figure the issue asks for, with sane values. No timing is checked.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import tiered  # noqa: E402
import tiered_capacity  # noqa: E402

SMOKE = [
    "--budget", "4MiB", "--dims", "16", "--sgd-batch", "4096", "--adagrad-batch", "2048",
    "--zipf-batch", "2048", "--zipf-warmup", "1", "--zipf-steps", "3", "--config-seconds", "30",
]  # fmt: skip


def run_capacity(tmp_path, *extra) -> dict:
    output = tmp_path / "capacity.json"
    assert tiered.main(["capacity", *SMOKE, *extra, "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    for config in report["configs"]:  # a configuration that failed says why, with its log
        assert config.get("status") != "failed", (config.get("reason"), config.get("log"))
    return report


def test_the_capacity_phase_reports_every_figure_of_each_configuration(tmp_path):
    report = run_capacity(tmp_path)
    assert report["load_before"]["load_average"]
    assert [(c["dim"], c["optimizer"]) for c in report["configs"]] == [
        (16, "sgd"),
        (16, "adagrad"),
    ]
    for config in report["configs"]:
        fill = config["fill"]
        assert fill["outcome"] in ("refused", "cap_reached")
        assert fill["rows_held"] > 0
        assert fill["table_over_budget"] == pytest.approx(
            fill["rows_held"] * fill["row_bytes"] / (4 << 20)
        )
        assert 0 < fill["table_over_budget"] <= 30 + 1e-9
        if fill["outcome"] == "refused":
            assert "one request needs" in fill["refusal"]["message"]
        if fill["rows_on_disk"]:
            assert fill["ram_per_disk_row"] > 0
        assert fill["rss"]["idle_server_rss"] > 0
        assert math.isfinite(fill["rss"]["max_growth_over_budget"])
        zipf = config["zipf"]
        assert zipf["outcome"] in ("done", "refused")
        if zipf["missed_rows"]:
            # Every missed row is read at least once.
            assert zipf["reads_per_miss"] >= 1.0
        name = f"dim16_{config['optimizer']}"
        assert report["targets"][name]["table_over_budget"] == fill["table_over_budget"]


def test_the_fill_stops_at_max_ratio_before_any_refusal(tmp_path):
    # 0.25x of 4 MiB at 64 B a row (dim 16, SGD): 16,384 rows, below the refusal at ~49k.
    report = run_capacity(tmp_path, "--optimizers", "sgd", "--max-ratio", "0.25")
    (config,) = report["configs"]
    assert config["fill"]["outcome"] == "cap_reached"
    assert config["fill"]["table_over_budget"] == pytest.approx(0.25, rel=1e-3)
    assert "refusal" not in config["fill"]


def test_the_needed_bytes_are_read_from_a_refusal():
    message = "one request needs 16384 more rows in memory at once (59.2 MiB in all with ..."
    assert tiered_capacity.needed_bytes(message) == int(59.2 * (1 << 20))
    assert tiered_capacity.needed_bytes("no figure") is None


@pytest.mark.parametrize("dim, budget", [(64, "64MiB"), (16, "16MiB")])
def test_w1_against_all_ram_with_and_without_the_next_steps_ids_sent_ahead(tmp_path, dim, budget):
    """`tiered.py` proper (W1 steps, a table 3-6x its budget, at W1's width and at the
    DLRM's): all-RAM, tiered, and tiered with each step's `row_sparse_prefetch` of the
    next step's ids. Each configuration ends with every row stored and its figures; the
    prefetching one brings rows in ahead."""
    output = tmp_path / "w1.json"
    argv = [
        "--budget", budget, "--dim", str(dim), "--rows", "400k", "--batch-size", "8192",
        "--steps", "3",
        "--configs", "all_ram,tiered,tiered_ahead", "--no-engines", "--no-disk-limit",
        "--no-cgroup", "--spill-root", str(tmp_path), "--output", str(output),
    ]  # fmt: skip
    assert tiered.main(argv) == 0
    report = json.loads(output.read_text())
    assert report["workload"]["dim"] == dim and report["workload"]["row_bytes"] == dim * 8
    assert report["workload"]["table_over_budget"] > 2.5
    for name in ("all_ram", "tiered", "tiered_ahead"):
        config = report["configs"][name]
        assert config.get("status") != "failed", (
            config.get("reason"),
            config.get("server_log_tail"),
        )
        for phase in config["phases"]:
            assert phase["rows_stored"] == 400_000
            assert phase["steps_per_s"] > 0
            if name != "all_ram":
                assert phase["tier_delta"]["row_lookups"] > 0
    assert set(report["targets"]) >= {
        "zipf_tiered_over_all_ram",
        "zipf_tiered_ahead_over_all_ram",
        "tiered_max_rss_over_budget",
    }
    # The rows the prefetches brought in were read before their pulls asked: the pulls of
    # the prefetching server find more of their rows in memory.
    ahead = phase_of(report, "tiered_ahead", "zipf1.1")
    plain = phase_of(report, "tiered", "zipf1.1")
    assert ahead["hit_rate"] > plain["hit_rate"], (ahead["hit_rate"], plain["hit_rate"])


def phase_of(report: dict, config: str, distribution: str) -> dict:
    return next(p for p in report["configs"][config]["phases"] if p["distribution"] == distribution)
