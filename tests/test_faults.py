"""The fault-injection suite, short version (the long one: benchmarks/faults.py).

Every scenario is a real `kvsparse launch -s 2 -n 2 --restart-servers` job with the marker
worker of benchmarks/faults.py: each push lands on its own marker row, so the final
checkpoint counts every push (0 = lost, 1 = applied once, 2 = applied twice). A run passes
when no push is applied twice, none is lost that the fault may not lose (only pushes
acknowledged after the last checkpoint before a server's kill may go with it), and the job
ends as the scenario expects: it finishes, or it stops naming the killed worker.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import REPO_ROOT

_spec = importlib.util.spec_from_file_location("faults", REPO_ROOT / "benchmarks" / "faults.py")
faults = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(faults)


@pytest.mark.parametrize("mode", sorted(faults.MODES))
@pytest.mark.parametrize("scenario", list(faults.SCENARIOS))
def test_fault_loses_and_duplicates_nothing_it_may_not(tmp_path, scenario, mode):
    result = faults.run(
        scenario,
        mode,
        steps=40,
        every=5,
        pace=0.05,
        at_step=23,
        hold=2.0,
        timeout=5.0,
        workdir=str(tmp_path),
    )
    report = json.dumps({k: v for k, v in result.items() if k != "output"}, indent=1)
    assert result["ok"], report + "\n" + result["output"]
    if faults.SCENARIOS[scenario] is not None:
        assert result["injected"] is not None, "the fault was never injected:\n" + report
    counts = result["counts"]
    # Every push a finished job acknowledged is in its final checkpoint, but what a
    # killed server took with it.
    if result["finished"]:
        assert counts["applied_once"] + counts["lost_exposed"] == counts["acknowledged"], report
