"""Serving: lookups in exported tables without servers (see `lookup`).

Example:
    >>> from kvsparse.serving import EmbeddingLookup
"""

from kvsparse.serving.lookup import EmbeddingLookup, LookupTable

__all__ = ["EmbeddingLookup", "LookupTable"]
