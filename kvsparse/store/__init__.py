"""The store wing: the KVStore API users call, and the backends it runs on.

- `kvstore.KVStore`: the API; checks every call and hands it to a backend.
- `backend.Backend`: the interface both backends implement (a typing.Protocol).
- `local.LocalBackend`: one shard in this process (``create('local')``); the
  remote backend is `kvsparse.client.remote.RemoteBackend` (shards on servers).
- `keys.KeyRegistry`: the keys a store has initialized (`keys.KeyInfo` each).
- `batching`: one key's values turned into a backend's items (ids planned by
  shard, gradients summed), every check before anything is sent.
- `checkpoints`: save / load / export orchestration, the optimizer-state file.
- `factory`: ``kvsparse.create`` and ``create_remote_store``.

Arrows: store -> shard (local backend, checkpoint actions), store -> client
(remote backend); nothing below imports the store.
"""
