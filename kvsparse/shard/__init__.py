"""The shard wing: one shard's tables, optimizer state and checkpoint files.

The same code serves a `local` store in the worker's process and a
`kvsparse server` process behind a socket: `state.ShardState` holds the
tables, `checkpoint` writes and reads a shard's files and the job's
manifests. It imports only the core, the specs and the errors.
"""
