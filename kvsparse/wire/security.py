"""Optional CurveZMQ: encrypted traffic and only known clients, with ZeroMQ's own tools.

``kvsparse keys DIR`` (`make_keys`) writes two key pairs in ZeroMQ's
certificate format (`zmq.auth.create_certificates`)::

    DIR/server.key          the server's public key (every client needs it)
    DIR/server.key_secret   the server's secret key (servers only)
    DIR/client.key          a client's public key (the servers accept it)
    DIR/client.key_secret   the client's secret key (workers only)

A server started with ``--keys DIR`` (or ``KVSPARSE_KEYS=DIR``) speaks
CurveZMQ only: every byte on the wire is encrypted, and a ZAP authenticator
(`zmq.auth.thread.ThreadAuthenticator`) accepts only clients whose public
key is a ``*.key`` file in DIR (add more clients' ``.key`` files there to
allow them). A worker with ``KVSPARSE_KEYS=DIR`` (``kvsparse launch --keys
DIR`` sets it; `kvsparse.config.curve_keys` reads it) authenticates with
DIR's client pair. A client without the
keys, or with keys the server does not know, gets
`kvsparse.errors.ServerUnavailable` naming the server and saying that the
handshake was refused; it never gets any data.

Copy only what each machine needs: servers need ``server.key_secret`` and
the clients' ``.key`` files; workers need ``server.key`` and
``client.key_secret``. Without keys, servers listen on 127.0.0.1 unless told
otherwise: do not expose an unauthenticated server to a network.

Every function here may be called from several threads at once (each
configures only the socket it is given).

Example:
    >>> from kvsparse.wire import security
    >>> paths = security.make_keys('/tmp/kvsparse-keys')   # doctest: +SKIP
    >>> sorted(paths)                                     # doctest: +SKIP
    ['client_public', 'client_secret', 'server_public', 'server_secret']
"""

from __future__ import annotations

import os

import zmq
import zmq.auth

from kvsparse import errors

_SERVER = "server"
_CLIENT = "client"


def curve_available() -> bool:
    """True if the libzmq that pyzmq bundles was built with CURVE (libsodium)."""
    return bool(zmq.has("curve"))


def _require_curve() -> None:
    if not curve_available():
        raise errors.InvalidArgument(
            f"this pyzmq's libzmq {zmq.zmq_version()} has no CURVE support; install a pyzmq "
            "wheel built with libsodium to use --keys"
        )


def _paths(directory: str) -> dict:
    directory = os.fspath(directory)
    return {
        "server_public": os.path.join(directory, _SERVER + ".key"),
        "server_secret": os.path.join(directory, _SERVER + ".key_secret"),
        "client_public": os.path.join(directory, _CLIENT + ".key"),
        "client_secret": os.path.join(directory, _CLIENT + ".key_secret"),
    }


def make_keys(directory, *, overwrite: bool = False) -> dict:
    """Writes a server and a client CurveZMQ key pair into directory.

    Args:
        directory: created if missing (mode 0700).
        overwrite: replace existing key files (default: refuse).

    Returns:
        {'server_public', 'server_secret', 'client_public', 'client_secret'}: file paths.

    Raises:
        InvalidArgument: CURVE is not available, keys exist and overwrite is False,
            or the files cannot be written (a read-only or missing parent, say).

    Example:
        >>> make_keys('/tmp/kvsparse-keys')['server_public']   # doctest: +SKIP
        '/tmp/kvsparse-keys/server.key'
    """
    _require_curve()
    paths = _paths(directory)
    if not overwrite:
        existing = [p for p in paths.values() if os.path.exists(p)]
        if existing:
            raise errors.InvalidArgument(
                f"key files already exist: {', '.join(existing)} (`kvsparse keys --force` "
                "replaces them; from Python, make_keys(..., overwrite=True))"
            )
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        zmq.auth.create_certificates(directory, _SERVER)
        zmq.auth.create_certificates(directory, _CLIENT)
        for name in ("server_secret", "client_secret"):
            os.chmod(paths[name], 0o600)
    except OSError as exc:
        raise errors.InvalidArgument(f"cannot write CurveZMQ keys in {directory}: {exc}") from None
    return paths


def _load(path: str, secret: bool):
    if not os.path.isfile(path):
        raise errors.InvalidArgument(
            f"CurveZMQ key file {path} is missing (make keys with `kvsparse keys DIR`)"
        )
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise errors.InvalidArgument(f"cannot read CurveZMQ key file {path}: {exc}") from None
    if secret and secret_key is None:
        raise errors.InvalidArgument(f"{path} holds no secret key")
    return public, secret_key


def secure_server_socket(socket: zmq.Socket, context: zmq.Context, directory: str):
    """Makes a (not yet bound) server socket CurveZMQ-only, with known clients only.

    Args:
        socket: the server's ROUTER socket, before bind.
        context: its context (the authenticator runs there).
        directory: a `make_keys` directory: server.key_secret, and the
            allowed clients' public ``*.key`` files.

    Returns:
        The running ThreadAuthenticator (stop() it after closing the socket).

    Raises:
        InvalidArgument: no CURVE, or missing/bad key files.
    """
    _require_curve()
    public, secret = _load(_paths(directory)["server_secret"], secret=True)
    from zmq.auth.thread import ThreadAuthenticator

    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    try:
        authenticator.configure_curve(domain="*", location=os.fspath(directory))
    except BaseException:
        authenticator.stop()
        raise
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True
    return authenticator


def secure_client_socket(socket: zmq.Socket, directory: str) -> None:
    """Makes a (not yet connected) client socket use DIR's client pair and trust DIR's server.

    Raises:
        InvalidArgument: no CURVE, or missing/bad key files.
    """
    _require_curve()
    paths = _paths(directory)
    server_public, _ = _load(paths["server_public"], secret=False)
    public, secret = _load(paths["client_secret"], secret=True)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_serverkey = server_public


def check_keys(directory) -> None:
    """Raises InvalidArgument unless directory holds both key pairs of `make_keys`."""
    _require_curve()
    paths = _paths(directory)
    _load(paths["server_secret"], secret=True)
    _load(paths["client_secret"], secret=True)
    _load(paths["server_public"], secret=False)


__all__ = [
    "check_keys",
    "curve_available",
    "make_keys",
    "secure_client_socket",
    "secure_server_socket",
]
