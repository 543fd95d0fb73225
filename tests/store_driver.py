"""A worker process driven line by line from a test: one JSON command in, one JSON answer out.

Run by tests/test_colocated.py as ``python tests/store_driver.py`` with the
cluster in its environment: ``KVSPARSE_PEERS`` (colocated) or
``KVSPARSE_SERVERS`` (dist_sparse), plus ``KVSPARSE_RANK`` /
``KVSPARSE_NUM_WORKERS``. Either way the store is ``kvsparse.create('dist_sparse')``:
the training code is the same, only the environment differs. The store is
made once and kept across commands, so one set of processes serves many
hypothesis examples (each uses fresh key names).

Commands (every worker of a job gets the same command; each derives its own
gradients from the command's seed and its rank):

- ``{"cmd": "run", "program": P}``: P's tables and dense keys are initialized,
  then its steps run in order (see `run_program`); answers ``{}``.
- ``{"cmd": "dump", "tables": {name: [ids]}, "dense": [names]}``: the rows and
  dense values, as float32 bytes in hex.
- ``{"cmd": "save" | "load", "path": D}``, ``{"cmd": "rows"}``: kv.save (rank 0
  only) / kv.load (every rank), and the rows each table holds over all shards.
- ``{"cmd": "quit"}``: closes the store and exits.

A failure answers ``{"error": traceback}`` and the process goes on.
"""

from __future__ import annotations

import json
import sys
import traceback

import numpy as np

import kvsparse
from kvsparse import initializers, optimizers

OPTIMIZERS = [
    None,
    optimizers.SGD(learning_rate=0.5),
    optimizers.SGD(learning_rate=0.1, momentum=0.9),
    optimizers.Adagrad(learning_rate=0.1),
    optimizers.Adam(learning_rate=0.01),
    optimizers.Ftrl(learning_rate=0.1),
]
INITIALIZERS = [
    initializers.Zeros(),
    initializers.Constant(0.25),
    initializers.Uniform(-1.0, 1.0),
    initializers.Normal(0.0, 0.1),
]


def run_program(kv, program: dict) -> None:
    """Initializes program's keys, then runs its steps.

    program: {"tables": {name: [dim, initializer index, optimizer index, seed]},
    "dense": {name: [shape, seed]}, "steps": [step], "init": whether to create
    the keys (default true; false for keys loaded from a checkpoint)}, a step being
    {"op": "push", "keys": [names], "ids": {name: [[ids of rank 0], [rank 1], ...]},
    "seed": s} (one fused push; a dense key's gradient from the seed),
    {"op": "set_optimizer", "index": i}, or {"op": "barrier"}.
    """
    rank = kv.rank
    tables = program["tables"]
    for name, (dim, init, optimizer, seed) in tables.items():
        if not program.get("init", True):
            break  # the keys exist already (loaded from a checkpoint)
        table = kvsparse.SparseTable(
            dim=dim, initializer=INITIALIZERS[init], optimizer=OPTIMIZERS[optimizer], seed=seed
        )
        kv.init(name, table)
    for name, (shape, seed) in program["dense"].items():
        if not program.get("init", True):
            break
        kv.init(name, np.random.default_rng(seed).standard_normal(shape).astype(np.float32))
    for step in program["steps"]:
        if step["op"] == "set_optimizer":
            kv.set_optimizer(OPTIMIZERS[step["index"]])
        elif step["op"] == "barrier":
            kv.barrier()
        elif step["op"] == "push":
            rng = np.random.default_rng([step["seed"], rank])
            values = []
            for name in step["keys"]:
                if name in tables:
                    ids = np.array(step["ids"][name][rank], np.int64)
                    grads = rng.standard_normal((ids.size, tables[name][0])).astype(np.float32)
                    values.append((ids, grads))
                else:
                    shape = program["dense"][name][0]
                    values.append(rng.standard_normal(shape).astype(np.float32))
            kv.push(step["keys"], values)
        else:
            raise ValueError(f"unknown step {step}")


def answer(kv, command: dict):
    what = command["cmd"]
    if what == "run":
        run_program(kv, command["program"])
        return {}
    if what == "dump":
        found = {}
        for name, ids in command["tables"].items():
            rows = kv.row_sparse_pull(name, row_ids=np.array(ids, np.int64))
            found[name] = rows.astype(np.float32).tobytes().hex()
        for name in command["dense"]:
            found[name] = kv.pull(name).astype(np.float32).tobytes().hex()
        return found
    if what == "save":
        return {"seq": kv.save(command["path"]) if kv.rank == 0 else None}
    if what == "load":
        return {"seq": kv.load(command["path"])}
    if what == "rows":
        return {name: table["rows"] for name, table in kv.stats()["tables"].items()}
    raise ValueError(f"unknown command {what!r}")


def main() -> int:
    kv = kvsparse.create("dist_sparse", timeout=60)
    kind = type(kv._backend).__name__
    print(json.dumps({"ready": kind, "rank": kv.rank}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        try:
            reply = answer(kv, command)
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            reply = {"error": traceback.format_exc()}
        print(json.dumps(reply), flush=True)
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
