"""Serving: lookups without training servers.

- `EmbeddingLookup` (`lookup`): an export directory read into this process.
- `kvsparse serve` (`main`, `server`): a replica process that serves a
  checkpoint directory over ZeroMQ and HTTP, and with ``--follow`` applies
  each new checkpoint atomically (`state`, `follow`); `Client` looks rows up
  from one or more replicas.

Example:
    >>> from kvsparse.serving import Client, EmbeddingLookup
"""

from kvsparse.serving.client import Client
from kvsparse.serving.lookup import EmbeddingLookup, LookupTable

__all__ = ["Client", "EmbeddingLookup", "LookupTable"]
