"""The C++ engine benchmark (benchmarks/engine_cpp/) builds, runs every engine and phase,
and reads back exactly the bytes it wrote: a tiny run, no timing checked.

Needs RocksDB's headers and library (not a kvsparse dependency): skipped without them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROCKSDB_HEADER = Path("/usr/include/rocksdb/db.h")
if not ROCKSDB_HEADER.exists():
    pytest.skip(
        f"RocksDB headers missing ({ROCKSDB_HEADER}): apt-get install -y librocksdb-dev",
        allow_module_level=True,
    )

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import engine_cpp_compare  # noqa: E402

ENGINES = engine_cpp_compare.default_engines().split(",")
TINY = [
    "--engines", ",".join(ENGINES), "--rows", "20000", "--record-bytes", "144",
    "--write-batch", "3000", "--read-batches", "512,2048", "--read-keys", "4096",
    "--steps", "3", "--step-keys", "2048", "--threads", "4", "--verify",
]  # fmt: skip


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    return engine_cpp_compare.build(force=True, build_dir=tmp_path_factory.mktemp("build"))


def run(program: Path, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    argv = [str(program), *TINY, "--dir", str(tmp_path / "data"), "--json", str(out), *extra]
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.exists(), completed.stderr
    return completed.returncode, json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny_run(program, tmp_path_factory) -> tuple[int, dict, Path]:
    tmp_path = tmp_path_factory.mktemp("run")
    return (*run(program, tmp_path), tmp_path)


def test_every_engine_and_phase_reports_positive_figures_and_reads_back_what_it_wrote(tiny_run):
    returncode, report, tmp_path = tiny_run
    assert returncode == 0
    assert report["ok"] and report["missing"] == 0 and report["mismatches"] == 0
    assert set(report["engines"]) == set(ENGINES)
    for name, engine in report["engines"].items():
        assert "error" not in engine, (name, engine)
        assert engine["load"]["records"] == 20000
        assert engine["load"]["records_per_s"] > 0 and engine["load"]["mb_per_s"] > 0
        assert engine["load"]["write_amplification"] > 0
        assert [(p["distribution"], p["batch"]) for p in engine["read"]] == [
            ("uniform", 512),
            ("uniform", 2048),
            ("zipf", 512),
            ("zipf", 2048),
        ]
        for phase in engine["read"]:
            assert phase["records"] == 4096
            assert phase["records_per_s"] > 0 and phase["mb_per_s"] > 0
            assert phase["page_cache"] in ("drop_caches", "fadvise_dontneed")
            # RocksDB's block cache holds this tiny table after the first phase.
            assert phase["engine_reads_per_lookup"] >= 0
        assert engine["read"][0]["engine_reads_per_lookup"] > 0
        assert [p["distribution"] for p in engine["mixed"]] == ["uniform", "zipf"]
        for phase in engine["mixed"]:
            assert phase["records_read"] == 3 * 2048 and phase["records_written"] == 3 * 1024
            assert phase["records_per_s"] > 0 and phase["write_amplification"] > 0
        # Every record read was compared byte for byte: the load's, then the rewritten ones.
        assert engine["records_checked"] == 4 * 4096 + 2 * 3 * 2048
        if name == "disk":
            assert engine["memory"]["ram_bytes_per_key_after_load"] == 0
        else:
            assert engine["memory"]["ram_bytes_per_key_after_load"] > 0
        assert engine["disk_bytes_at_end"] >= 20000 * 144
    # The scratch directories are removed.
    assert not any((tmp_path / "data").iterdir())


def test_a_record_that_differs_from_what_was_written_fails_the_run(program, tmp_path):
    returncode, report = run(program, tmp_path, "--inject-mismatch")
    assert returncode == 1
    assert not report["ok"]
    assert report["mismatches"] == len(ENGINES)  # the first record checked, per engine
    for engine in report["engines"].values():
        assert engine["mismatches"] == 1


def test_ratios_divide_kvsparse_by_rocksdb_and_every_engine_by_the_disk(tiny_run):
    _, report, _ = tiny_run
    ratios = engine_cpp_compare.ratios(report)
    load = report["engines"]
    first = ratios["load"]
    assert first["segment/rocksdb"] == pytest.approx(
        load["segment"]["load"]["records_per_s_with_settle"]
        / load["rocksdb"]["load"]["records_per_s_with_settle"]
    )
    assert first["rocksdb/disk"] == pytest.approx(
        load["rocksdb"]["load"]["records_per_s_with_settle"]
        / load["disk"]["load"]["records_per_s_with_settle"]
    )
    assert set(ratios) == {
        "load",
        "read uniform x512",
        "read uniform x2048",
        "read zipf x512",
        "read zipf x2048",
        "mixed uniform x2048",
        "mixed zipf x2048",
    }
