"""Where a server's CHECKPOINT requests may read and write.

A CHECKPOINT request names a directory; the server saves, loads or exports
there with its own permissions. Without keys anyone who reaches the port may
send one, so the paths a server accepts follow these rules:

- With a checkpoint root (``kvsparse server --checkpoint-root DIR`` or
  ``KVSPARSE_CHECKPOINT_ROOT``): every path must lie inside DIR once symlinks
  and ``..`` are resolved; a relative path is taken inside DIR. Anything
  else is refused with `kvsparse.errors.CheckpointError`.
- Without a root, a server that only its own host can reach (bound to a
  loopback address or an ``ipc://`` socket) or that authenticates its clients
  (``--keys``) accepts any path, as before: the peers are the user's own
  processes (a single-host job, ``kvsparse launch``) or hold the keys.
- Without a root, a server that other hosts can reach without keys (bound to
  ``0.0.0.0``, ``*`` or a routable address) refuses every CHECKPOINT path and
  says to start it with ``--checkpoint-root`` (or ``--keys``).

Example:
    >>> paths = CheckpointPaths("/ckpt", address="tcp://0.0.0.0:7000", authenticated=False)
    >>> paths.resolve("run1")  # doctest: +SKIP
    '/ckpt/run1'
"""

from __future__ import annotations

import os

from kvsparse import config, errors


class CheckpointPaths:
    """The rule (see the module docstring) that turns a requested checkpoint path into one to use.

    Args:
        root: the checkpoint root, an existing directory, or None.
        address: the address the server bound (tcp://host:port or ipc://path).
        authenticated: the server speaks CurveZMQ and accepts only its clients' keys.

    Raises:
        InvalidArgument: root is not an existing directory.

    Immutable after construction: safe to share between threads.
    """

    def __init__(self, root: str | None, *, address: str, authenticated: bool):
        self._address = address
        self._root = None
        if root is not None:
            real = os.path.realpath(root)
            if not os.path.isdir(real):
                raise errors.InvalidArgument(
                    f"checkpoint root {root!r} is not an existing directory (--checkpoint-root)"
                )
            self._root = real
        self._unconfined = root is None and (
            authenticated or config.reachable_only_locally(address)
        )

    @property
    def root(self) -> str | None:
        """The checkpoint root with its symlinks resolved, or None."""
        return self._root

    def resolve(self, path) -> str:
        """The path to read or write for a requested one.

        Raises:
            InvalidArgument: path is not a non-empty str.
            CheckpointError: path lies outside the root (after symlinks and ``..``),
                or this server takes no checkpoint paths (see the module docstring).
        """
        if not isinstance(path, str) or not path or "\0" in path:
            raise errors.InvalidArgument("checkpoint path must be a non-empty str")
        if self._root is None:
            if self._unconfined:
                return path
            raise errors.CheckpointError(
                f"this server ({self._address}) takes requests from other hosts without "
                "--keys, so it reads and writes checkpoints only under a checkpoint root: "
                "restart it with --checkpoint-root DIR (or KVSPARSE_CHECKPOINT_ROOT=DIR), or "
                "with --keys"
            )
        resolved = os.path.realpath(os.path.join(self._root, path))
        if os.path.commonpath([self._root, resolved]) != self._root:
            raise errors.CheckpointError(
                f"checkpoint path {path!r} lies outside this server's checkpoint root "
                f"{self._root} (kvsparse server --checkpoint-root), once symlinks and '..' "
                "are followed; give a path inside it (a relative path is taken inside it)"
            )
        return resolved


__all__ = ["CheckpointPaths"]
