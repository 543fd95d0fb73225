"""The shard wing: one shard's tables, optimizer state and checkpoint files.

The same code serves a `local` store in the worker's process and a
`kvsparse server` process behind a socket: `state.ShardState` holds the
tables; the `checkpoint` package writes and reads a shard's files, the job's
manifests and the inference export, and runs a CHECKPOINT request
(`checkpoint.handle`). It imports only the core, the specs, the placement
rules and the errors.
"""
