"""CurveZMQ (``kvsparse keys``, ``--keys``), the message size limit and the default bind."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest
import zmq
from conftest import REPO_ROOT, ServerProcess, subprocess_env

import kvsparse
from kvsparse import errors, initializers, optimizers
from kvsparse.server.server import DEFAULT_MAX_MESSAGE_SIZE, Server
from kvsparse.wire import protocol, security
from kvsparse.wire.protocol import Op

pytestmark = pytest.mark.skipif(
    not zmq.has("curve"), reason="this pyzmq's libzmq was built without CURVE"
)


def cli(*args, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "kvsparse", *map(str, args)],
        capture_output=True,
        text=True,
        env=subprocess_env(env),
        cwd=str(REPO_ROOT),
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keys") / "cluster"
    result = cli("keys", directory)
    assert result.returncode == 0, result.stderr
    return str(directory)


@pytest.fixture(scope="module")
def curve_server(keys):
    server = ServerProcess(extra_args=("--keys", keys))
    try:
        yield server
    finally:
        server.stop()
        server.stderr.close()


def test_keys_command_writes_two_pairs_with_private_secrets(keys, tmp_path):
    names = sorted(os.listdir(keys))
    assert names == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    for name in ("client.key_secret", "server.key_secret"):
        assert stat.S_IMODE(os.stat(os.path.join(keys, name)).st_mode) == 0o600
    public, secret = zmq.auth.load_certificate(os.path.join(keys, "server.key_secret"))
    assert len(public) == 40 and len(secret) == 40
    again = cli("keys", keys)
    assert again.returncode == 1 and "already exist" in again.stderr
    # --force on a copy, so that the module's servers keep the keys they loaded.
    other = tmp_path / "other"
    assert cli("keys", other).returncode == 0
    assert cli("keys", other, "--force").returncode == 0


def test_client_with_the_keys_works_and_traffic_is_curve(keys, curve_server):
    kv = kvsparse.create(
        "dist_sparse", servers=[curve_server.address], rank=0, num_workers=1, keys=keys, timeout=10
    )
    try:
        assert kv._backend.session.security_mechanism(0) == zmq.CURVE
        kv.init("secure", kvsparse.SparseTable(dim=4))
        kv.push("secure", (np.array([3, 5]), np.ones((2, 4), np.float32)))
        rows = kv.row_sparse_pull("secure", row_ids=np.array([3, 5]))
        np.testing.assert_array_equal(rows, np.ones((2, 4), np.float32))
    finally:
        kv.close()


def test_client_without_keys_gets_a_clear_error_naming_the_server(curve_server):
    with pytest.raises(errors.ServerUnavailable, match="requires CurveZMQ keys") as info:
        kvsparse.create(
            "dist_sparse", servers=[curve_server.address], rank=0, num_workers=1, timeout=30
        )
    assert info.value.address == curve_server.address
    assert curve_server.address in str(info.value)


def test_a_peer_closing_every_connection_in_its_handshake_is_named_not_waited_out():
    # What a CurveZMQ server does to a client without keys when it reads the client's
    # greeting first (the client then sees only the close; which side reads first is a
    # race): here every time, with a listener that closes each connection it accepts.
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    done = threading.Event()

    def close_each():
        while not done.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:  # the 0.2 s timeout: look at done again
                continue
            connection.close()

    closer = threading.Thread(target=close_each, daemon=True)
    closer.start()
    try:
        with pytest.raises(errors.ServerUnavailable) as info:
            # Before: NoAnswer after the whole timeout, whatever its length.
            kvsparse.create("dist_sparse", servers=[address], rank=0, num_workers=1, timeout=60)
    finally:
        done.set()
        closer.join(5)
        listener.close()
    message = str(info.value)
    assert info.value.address == address
    assert "closed the connection during the security handshake (3 times in a row)" in message
    assert "requires CurveZMQ keys: set KVSPARSE_KEYS" in message
    assert "not a kvsparse server" in message


def test_keys_refused_either_way_are_named_every_time(keys, curve_server):
    # Which side of a refused handshake reads the other's greeting first is a race; each
    # way must end in the error that says what to do (before: about one in four waited
    # for further reconnections, sometimes past the timeout).
    plain = ServerProcess()
    cases = [
        (curve_server.address, None, "requires CurveZMQ keys"),  # no keys, a CurveZMQ server
        (plain.address, keys, "does not use these CurveZMQ keys"),  # keys, a plain server
    ]
    try:
        for _ in range(8):
            for address, client_keys, expected in cases:
                with pytest.raises(errors.ServerUnavailable, match=expected):
                    kvsparse.create(
                        "dist_sparse",
                        servers=[address],
                        rank=0,
                        num_workers=1,
                        keys=client_keys,
                        timeout=30,
                    )
    finally:
        plain.stop()
        plain.stderr.close()


def test_client_with_unknown_keys_is_refused_by_the_authenticator(keys, curve_server, tmp_path):
    stranger = tmp_path / "stranger"
    security.make_keys(stranger)
    # It trusts the real server key but holds a client key the server does not know.
    (stranger / "server.key").write_bytes((open(os.path.join(keys, "server.key"), "rb")).read())
    with pytest.raises(errors.ServerUnavailable, match="refused this client's CurveZMQ key"):
        kvsparse.create(
            "dist_sparse",
            servers=[curve_server.address],
            rank=0,
            num_workers=1,
            keys=str(stranger),
            timeout=30,
        )


def test_plain_socket_gets_no_data_from_a_curve_server(curve_server):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(curve_server.address)
        sock.send(protocol.Header(op=Op.PING, request_id=1).pack())
        assert sock.poll(1500) == 0  # nothing comes back: the handshake never completed
    finally:
        sock.close(0)


def test_launch_with_keys_runs_workers_over_curve(keys, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, numpy as np, zmq, kvsparse\n"
        "kv = kvsparse.create('dist_sparse')\n"
        "assert kv._backend.session.security_mechanism(0) == zmq.CURVE, 'not CURVE'\n"
        "kv.init('t', kvsparse.SparseTable(dim=2))\n"
        "kv.push('t', (np.array([1]), np.full((1, 2), 7, np.float32)))\n"
        "print('pulled', kv.row_sparse_pull('t', row_ids=np.array([1])).tolist(),"
        f" os.environ['KVSPARSE_KEYS'] == {keys!r})\n"
    )
    result = cli("launch", "--keys", keys, "-s", "1", "-n", "1", "--", sys.executable, script)
    assert result.returncode == 0, result.stderr
    assert "[worker 0] pulled [[7.0, 7.0]] True" in result.stdout


def test_launch_refuses_a_directory_without_keys(tmp_path):
    result = cli("launch", "--keys", tmp_path, "--", sys.executable, "-c", "pass")
    assert result.returncode == 1
    assert "key file" in result.stderr and "missing" in result.stderr


def test_oversized_message_drops_only_its_sender(server_factory):
    server = ServerProcess(extra_args=("--max-message-size", "4096"))
    try:
        good = kvsparse.create(
            "dist_async", servers=[server.address], rank=0, num_workers=1, timeout=10
        )
        good.init("small", kvsparse.SparseTable(dim=8))
        big = kvsparse.create(
            "dist_async", servers=[server.address], rank=0, num_workers=1, timeout=1
        )
        big.init("small", kvsparse.SparseTable(dim=8))  # the same table: kept as is
        # A client that does not check the size before sending (one older than the limit in
        # the HELLO reply): the server drops its connection, and only its.
        big._backend.session._frame_limits.clear()
        ids = np.arange(1000)
        with pytest.raises(errors.ServerUnavailable, match="max-message-size"):
            big.push("small", (ids, np.ones((1000, 8), np.float32)))  # 32 kB of rows
        big.close()
        good.push("small", (np.array([1]), np.ones((1, 8), np.float32)))
        np.testing.assert_array_equal(
            good.row_sparse_pull("small", row_ids=np.array([1])), np.ones((1, 8))
        )
        # 3.2 kB of keys in, 12.8 kB of rows out: the limit is on what the server receives.
        assert good.row_sparse_pull("small", row_ids=ids[:400]).shape == (400, 8)
        good.close()
    finally:
        server.stop()
        server.stderr.close()


def test_a_push_over_the_message_limit_is_refused_before_it_is_sent():
    # It was sent, dropped by the server with the connection, and failed as
    # ServerUnavailable ~32 s later; its size is known before sending.
    server = ServerProcess(extra_args=("--max-message-size", "4096"))
    try:
        kv = kvsparse.create(
            "dist_sparse", servers=[server.address], rank=0, num_workers=1, timeout=30
        )
        kv.init("t", kvsparse.SparseTable(dim=8, initializer=initializers.Zeros()))
        kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
        ids = np.arange(1000)
        with pytest.raises(errors.LimitExceeded) as refused:
            kv.push("t", (ids, np.ones((1000, 8), np.float32)))  # 32 kB of rows
        message = str(refused.value)
        assert "32000 bytes" in message and "4096 bytes" in message, message
        assert "--max-message-size" in message and server.address in message
        assert kv.clock == 0  # refused before anything went out, not after a silence
        # The store keeps working: a push that fits is applied, and only it.
        kv.push("t", (np.array([1]), np.ones((1, 8), np.float32)))
        np.testing.assert_array_equal(
            kv.row_sparse_pull("t", row_ids=np.array([1, 2])), [[-1.0] * 8, [0.0] * 8]
        )
        kv.close()
    finally:
        server.stop()
        server.stderr.close()


def test_server_defaults_loopback_and_a_documented_size_limit():
    server = Server()
    try:
        assert server.address.startswith("tcp://127.0.0.1:")
        assert server.socket.getsockopt(zmq.MAXMSGSIZE) == DEFAULT_MAX_MESSAGE_SIZE
    finally:
        server.close()
    help_text = cli("server", "--help").stdout
    assert "--max-message-size" in help_text and str(DEFAULT_MAX_MESSAGE_SIZE) in help_text
    assert "--keys" in help_text
