"""The store wing: the KVStore API users call, and the backends it runs on.

`kvstore.KVStore` checks and batches every call and hands it to a backend:
`local.LocalBackend` (one shard in this process) or the remote backend of
`kvsparse.client` (shards on servers). Arrows: store -> shard (local),
store -> client (remote); nothing below imports the store.
"""
