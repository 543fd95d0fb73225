"""The names of the environment variables kvsparse reads, and their defaults.

One place for every name, so that a reader of a variable and the launcher that sets it
cannot disagree. Only `kvsparse.config` reads them.
"""

from __future__ import annotations

import sys

# What `kvsparse launch` sets for its workers; read first.
SERVERS = "KVSPARSE_SERVERS"
RANK = "KVSPARSE_RANK"
NUM_WORKERS = "KVSPARSE_NUM_WORKERS"
TIMEOUT = "KVSPARSE_TIMEOUT"
STALENESS = "KVSPARSE_STALENESS"
# Colocated mode (`kvsparse launch --colocated`): every worker's shard address,
# in rank order; worker r binds the r-th and the workers are the servers.
PEERS = "KVSPARSE_PEERS"
# `kvsparse launch --colocated --restart-workers`: how many times this worker process was
# started again after it died (unset or 0: its first start); a restarted worker restores its
# shard from KVSPARSE_CHECKPOINT_DIR and resumes (`kvsparse.store.colocated`).
RESTARTED = "KVSPARSE_RESTARTED"
# Seconds a colocated shard holds the requests that wait for a worker that left, for it
# to come back restarted, before they fail with WorkerLeft (0: fail as soon as it left).
REJOIN_WINDOW = "KVSPARSE_REJOIN_WINDOW"
# `kvsparse launch --colocated` over tcp: the number of an inherited file descriptor, a tcp
# socket the launcher bound and listens on at this worker's shard address, which the
# worker's shard serves (ZMQ_USE_FD) instead of binding the port again: the port is held
# from before the job starts to its end, restarts included, so no other process can take it.
SHARD_FD = "KVSPARSE_SHARD_FD"
# For server processes only.
BIND = "KVSPARSE_BIND"
SERVER_ID = "KVSPARSE_SERVER_ID"
# For workers and servers alike.
KEYS = "KVSPARSE_KEYS"  # CurveZMQ key directory (`kvsparse keys DIR`)
RETRY_WINDOW = "KVSPARSE_RETRY_WINDOW"  # seconds a worker keeps retrying a restarted server
CHECKPOINT_DIR = "KVSPARSE_CHECKPOINT_DIR"
# kvsparse launch --save-every / --keep: rank 0 saves into CHECKPOINT_DIR.
SAVE_EVERY = "KVSPARSE_SAVE_EVERY"
SAVE_KEEP = "KVSPARSE_SAVE_KEEP"
NUM_THREADS = "KVSPARSE_NUM_THREADS"  # threads a batch of the C++ core may use
# What one peer may make a server do (`ServerLimits`, `kvsparse server --max-*`).
MAX_REPLY_BYTES = "KVSPARSE_MAX_REPLY_BYTES"
MAX_UNREAD_REPLY_BYTES = "KVSPARSE_MAX_UNREAD_REPLY_BYTES"
MAX_TABLES = "KVSPARSE_MAX_TABLES"
MAX_DIM = "KVSPARSE_MAX_DIM"
MAX_ROWS_PER_REQUEST = "KVSPARSE_MAX_ROWS_PER_REQUEST"
CHECKPOINT_ROOT = "KVSPARSE_CHECKPOINT_ROOT"
HEARTBEAT_TIMEOUT = "KVSPARSE_HEARTBEAT_TIMEOUT"
FAST_PATH = "KVSPARSE_FAST_PATH"
# A shard's memory budget (bytes; unset or 0: none) and the directory its disk tier
# spills cold rows to (`kvsparse server --memory-budget/--spill-dir`, kvsparse.shard.tier).
MEMORY_BUDGET = "KVSPARSE_MEMORY_BUDGET"
SPILL_DIR = "KVSPARSE_SPILL_DIR"
# Seconds workers retry a restarted server when `kvsparse launch --restart-servers`
# or `kvsparse.ray` start them and the user gives no --retry-window.
DEFAULT_RETRY_WINDOW = 120.0
# 30 s, not less: a server's heartbeat queued behind a big reply (1 GiB at ~1 Gbit/s is
# ~10 s) is answered only once the reply arrived (any traffic from the peer counts).
DEFAULT_HEARTBEAT_TIMEOUT = 30.0
# ipc:// addresses: a Unix socket's path fits in sockaddr_un.sun_path with its NUL
# (108 bytes on Linux, 104 on macOS and the BSDs).
IPC_PREFIX = "ipc://"
IPC_PATH_MAX_BYTES = 107 if sys.platform.startswith("linux") else 103
# Variables that make MXNet's ps-lite start (DMLC_ROLE, PORT) or that tell
# TensorFlow to build a cluster (TF_CONFIG): no process that kvsparse starts
# inherits them (kvsparse.cluster.process).
FOREIGN_ROLE_VARIABLES = ("DMLC_ROLE", "PORT", "TF_CONFIG")
_DMLC_VARIABLES = (
    "DMLC_ROLE",
    "DMLC_NUM_SERVER",
    "DMLC_NUM_WORKER",
    "DMLC_PS_ROOT_URI",
    "DMLC_PS_ROOT_PORT",
    "DMLC_WORKER_ID",
    "DMLC_SERVER_ID",
    "DMLC_TASK_ID",
)
# Seconds node 0's rendezvous waits for every launcher to join (``--rendezvous-wait``): hosts
# of a batch job start within seconds of each other, but an image pull or a slow NFS mount
# can take minutes; torchrun waits 600 s.
DEFAULT_RENDEZVOUS_WAIT = 300.0
