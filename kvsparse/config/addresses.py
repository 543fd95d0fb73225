"""Server addresses: parsing, normalizing, and the address a server binds.

``tcp://host:port`` (``host:port`` is accepted too, IPv6 hosts in brackets)
and ``ipc:///absolute/path`` for a server on this host. Thread-safe: nothing
here keeps state.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Optional

from kvsparse.config.names import IPC_PATH_MAX_BYTES, IPC_PREFIX, SERVERS
from kvsparse.config.values import _get, _parse_int
from kvsparse.errors import InvalidArgument


def _parse_port(text: str, variable: str) -> int:
    port = _parse_int(text, variable, minimum=1)
    if port > 65535:
        raise InvalidArgument(f"{variable}={text!r} is not a TCP port (1..65535)")
    return port


def _split_host_port(text: str, variable: str, shown: str) -> tuple[str, str]:
    """'host:port' or '[v6]:port' -> (host, port text); errors quote `shown`."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1 : end + 2] != ":":
            raise InvalidArgument(f"{variable}: {shown!r} is not 'host:port'")
        return text[1:end], text[end + 2 :]
    host, sep, port = text.rpartition(":")
    if not sep or not host or ":" in host:
        raise InvalidArgument(
            f"{variable}: {shown!r} is not 'host:port' (write IPv6 hosts as '[::1]:port')"
        )
    return host, port


def format_address(host: str, port: int) -> str:
    """``tcp://host:port``, with brackets around an IPv6 host. Thread-safe.

    Example:
        >>> format_address('::1', 7000)
        'tcp://[::1]:7000'
    """
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def parse_server_address(text, variable: str = "server address") -> str:
    """Checks a server address and returns it as ``tcp://host:port`` or ``ipc:///path``.

    Args:
        text: ``tcp://host:port``, ``host:port``, ``tcp://[v6]:port``, or
            ``ipc:///absolute/path`` (a Unix socket: a server on this host).
        variable: what to name in the error (an environment variable, say).

    Raises:
        InvalidArgument: not a str, another scheme, no host or a bad port; for
            ipc, a path that is empty, relative, holds a comma or a NUL, or is
            longer than a Unix socket path may be (`IPC_PATH_MAX_BYTES`).

    Thread-safe.

    Example:
        >>> parse_server_address('localhost:7000')
        'tcp://localhost:7000'
        >>> parse_server_address('ipc:///tmp/kvsparse/server-0')
        'ipc:///tmp/kvsparse/server-0'
    """
    return _parse_address(text, variable, bind=False)


def parse_bind_address(text, variable: str = "bind address") -> str:
    """Checks an address a server may bind and returns it normalized.

    As `parse_server_address`, and also ``tcp://*:port`` (every interface)
    and port 0 (a free port, printed by the server once bound).

    Raises:
        InvalidArgument: as `parse_server_address`.

    Thread-safe.

    Example:
        >>> parse_bind_address('*:0')
        'tcp://*:0'
    """
    return _parse_address(text, variable, bind=True)


def ipc_path(address: str) -> Optional[str]:
    """The socket file of an ``ipc://`` address (as normalized here), None for tcp.

    Thread-safe.

    Example:
        >>> ipc_path('ipc:///tmp/kvsparse/server-0'), ipc_path('tcp://h:1')
        ('/tmp/kvsparse/server-0', None)
    """
    return address[len(IPC_PREFIX) :] if address.startswith(IPC_PREFIX) else None


def reachable_only_locally(address: str) -> bool:
    """True for an ``ipc://`` address or a tcp one bound to a loopback interface. Thread-safe.

    Example:
        >>> reachable_only_locally("tcp://127.0.0.1:7000"), reachable_only_locally("tcp://*:1")
        (True, False)
    """
    if ipc_path(address) is not None:
        return True
    host = address.partition("://")[2].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parse_address(text, variable: str, bind: bool) -> str:
    """A connect address, or with bind=True a bind address (host '*' and port 0 allowed)."""
    if not isinstance(text, str):
        raise InvalidArgument(f"{variable}: a server address must be a str, got {text!r}")
    address = text.strip()
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "tcp", address
    if scheme.lower() == "ipc":
        return IPC_PREFIX + _parse_ipc_path(rest, variable, text)
    if scheme.lower() != "tcp":
        raise InvalidArgument(
            f"{variable}: {text!r} has an unknown scheme {scheme!r}: kvsparse servers speak "
            "tcp://host:port, or ipc:///absolute/path between processes of one host"
        )
    if not rest:
        raise InvalidArgument(f"{variable}: {text!r} has no host:port")
    host, port_text = _split_host_port(rest, variable, text)
    if any(c.isspace() for c in host) or "/" in host or (host == "*" and not bind):
        raise InvalidArgument(f"{variable}: {text!r} has a malformed host {host!r}")
    try:
        port = int(port_text, 10)
    except ValueError:
        port = -1
    if not (0 if bind else 1) <= port <= 65535:
        raise InvalidArgument(f"{variable}: {text!r} has no valid TCP port (1..65535)")
    return f"tcp://*:{port}" if host == "*" else format_address(host, port)


def _parse_ipc_path(path: str, variable: str, shown: str) -> str:
    """The path of an ipc:// address, checked before ZeroMQ sees it; errors quote `shown`."""
    if not path:
        raise InvalidArgument(
            f"{variable}: {shown!r} has no socket path (write ipc:///absolute/path)"
        )
    if not path.startswith("/"):
        # ZeroMQ would take a relative path against each process's working directory,
        # and '@name' (Linux's abstract namespace) or '*' (a random file) would differ
        # between the server and its workers.
        raise InvalidArgument(
            f"{variable}: {shown!r} has a relative socket path {path!r}; write an absolute "
            "one, ipc:///absolute/path (three slashes)"
        )
    if "," in path or "\0" in path:
        raise InvalidArgument(
            f"{variable}: {shown!r}: a socket path may not hold a comma (it separates the "
            f"addresses in {SERVERS}) nor a NUL character"
        )
    size = len(path.encode("utf-8", "surrogateescape"))
    if size > IPC_PATH_MAX_BYTES:
        raise InvalidArgument(
            f"{variable}: {shown!r}: the socket path is {size} bytes, longer than the "
            f"{IPC_PATH_MAX_BYTES} bytes a Unix socket path may have (sun_path); use a "
            "shorter directory, e.g. under /tmp"
        )
    return path


def _bind_host(host: str) -> str:
    """The interface a server binds for an address that workers connect to.

    A loopback or IP literal is bound as is. Any other host name is bound on
    all interfaces, as TensorFlow's gRPC servers and ps-lite do: the name
    workers use (a DNS or Kubernetes service name) need not be an address of
    this machine's interfaces.
    """
    if host == "localhost":
        return "127.0.0.1"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return "*"
    return host


def _bind_address_for(address: str) -> str:
    if ipc_path(address) is not None:
        return address  # a socket file: the server binds the very path its workers use
    rest = address[len("tcp://") :]
    host, port = _split_host_port(rest, "address", address)
    host = _bind_host(host)
    return f"tcp://{host}:{port}" if host == "*" else format_address(host, int(port))


def peer_bind_address(address: str) -> str:
    """The address a colocated worker binds for its shard at address (a peer's address).

    As for a server (`server_bind_address`): a loopback or IP literal as is,
    another host name on all interfaces, an ipc path as is. Thread-safe.

    Example:
        >>> peer_bind_address("tcp://localhost:7001")
        'tcp://127.0.0.1:7001'
    """
    return _bind_address_for(parse_server_address(address, "peer address"))


def _address_list(environ: Mapping, name: str) -> Optional[tuple]:
    """(addresses, name) from the comma-separated variable name, or None if unset."""
    text = _get(environ, name)
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if any(not p for p in parts):
        raise InvalidArgument(f"{name}={text!r} has an empty entry")
    return [parse_server_address(p, name) for p in parts], name


def split_tcp_address(address: str, what: str) -> tuple[str, int]:
    """(host, port) of ``tcp://host:port`` (or ``host:port``); errors name `what`. Thread-safe.

    Example:
        >>> split_tcp_address('tcp://[::1]:29400', '--rendezvous')
        ('::1', 29400)
    """
    text = address[len("tcp://") :] if address.startswith("tcp://") else address
    host, port = _split_host_port(text, what, address)
    return host, _parse_port(port, what)
