"""What every peer worker shares: phases of a run, per-batch dedup, the result file."""

from __future__ import annotations

import json
import time

import numpy as np

from kvsparse import _core

PHASES = ("step", "pull", "push")


def phase_batches(warmup: int, steps: int) -> dict:
    """Batch indices of each phase; every phase gets fresh batches of the same workload.

    warmup: [0, warmup); step (pull + push): the next `steps`; pull only: the next;
    push only: the next.
    """
    return {
        "warmup": range(0, warmup),
        "step": range(warmup, warmup + steps),
        "pull": range(warmup + steps, warmup + 2 * steps),
        "push": range(warmup + 2 * steps, warmup + 3 * steps),
    }


def num_batches(warmup: int, steps: int) -> int:
    return warmup + 3 * steps


def presummed(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique ids, gradient rows summed per unique id), computed outside the timing.

    Peers get their batches already deduplicated with gradients summed, as a framework's
    sparse backward hands them over (MXNet's row_sparse gradient), so their timings hold
    only the store's work. kvsparse is timed from raw ids and per-position gradients.
    """
    unique, inverse = np.unique(ids, return_inverse=True)
    return unique, _core.sum_rows(
        np.ascontiguousarray(grads), inverse.astype(np.int64), unique.size
    )


def run_phases(warmup: int, steps: int, pull, push, probe=None, counters=None) -> dict:
    """Times pull(b)+push(b) per step, then pull alone, then push alone, over fresh batches.

    pull(b) and push(b) take a batch index and must return only once the work is done.
    probe: optional callable returning {name: counter}; counters (a dict) then receives
    {phase: {name: mean increase per batch}}.
    Returns {phase: [seconds per batch]}.
    """
    plan = phase_batches(warmup, steps)
    for b in plan["warmup"]:
        pull(b)
        push(b)
    times = {}
    for phase in PHASES:
        seconds = []
        before = probe() if probe else None
        for b in plan[phase]:
            start = time.perf_counter()
            if phase in ("step", "pull"):
                pull(b)
            if phase in ("step", "push"):
                push(b)
            seconds.append(time.perf_counter() - start)
        if probe:
            after = probe()
            counters[phase] = {k: (after[k] - before[k]) / len(seconds) for k in after}
        times[phase] = seconds
    return times


_STARTED = time.monotonic()


def log(message: str) -> None:
    """A line with the seconds since this process imported this module (in the peer's log)."""
    print(f"[{time.monotonic() - _STARTED:7.2f} s] {message}", flush=True)


def write_result(path: str, times: dict, **extra) -> None:
    with open(path, "w") as f:
        json.dump({"times": times, **extra}, f)
