"""The HTTP side of a serving replica, on aiohttp (`kvsparse serve --http-port P`).

Why aiohttp (3.14, pinned in .ci/requirements.txt, extra ``serve``): it is a
production HTTP/1.1 server (keep-alive, request size limits, a C-accelerated
parser) and a whole stack in one package, and it runs on an asyncio loop that
we own, in a thread of the replica's process beside the ZeroMQ workers:
``AppRunner`` + ``TCPSite`` start and stop it without taking over the main
thread or its signals. uvicorn would need a hand-written ASGI app and runs
its server as the program's main loop (its signal handlers have to be turned
off to run it in a thread). The standard library's http.server is a
development server, one request at a time.

Routes:

- ``POST /v1/lookup`` with ``Content-Type: application/json``: body
  ``{"table": "user", "ids": [[1, 2], [3, 4]], "default": "zeros"}``
  (``default`` optional: 'zeros' or 'initializer'); the answer is JSON
  ``{"table", "shape": ids.shape + [dim], "dim", "version": seq, "rows": nested lists}``.
- ``POST /v1/lookup?table=user[&default=initializer][&shape=2,2]`` with
  ``Content-Type: application/octet-stream``: the body is the ids as raw
  little-endian int64 (flat; ``shape`` reshapes them, default ``[n]``); the
  answer is the rows as raw little-endian float32, with headers
  ``X-Kvsparse-Shape: 2,2,16``, ``X-Kvsparse-Dim`` and ``X-Kvsparse-Version``.
- ``GET /healthz``: JSON `ServingServer.status` (version, freshness, the
  last refused checkpoint): 200 while a checkpoint is served (``"status":
  "degraded"`` when the newest one was refused and an older one is served),
  503 before any was loaded.
- ``GET /metrics``: Prometheus text (`kvsparse.serving.metrics`).

A bad request gets a JSON ``{"error": class, "message": ...}`` with 400
(malformed JSON, non-integer ids, bad shape or default), 404 (unknown
table), 413 (more ids than ``--max-batch``, or a body too large) or 415
(another content type); the replica goes on serving.

Lookups run on the event loop thread: the C++ batch releases the GIL, so the
ZeroMQ workers go on meanwhile; a lookup of 4,096 ids takes well under a
millisecond.

Threads: `HttpServer.start` and `stop` from one thread; the app runs on its own.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Optional

import numpy as np
from aiohttp import web

from kvsparse import errors
from kvsparse.serving.metrics import CONTENT_TYPE

_JSON = "application/json"
_RAW = "application/octet-stream"


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, errors.UnknownKey):
        return 404
    if isinstance(exc, errors.LimitExceeded):
        return 413
    return 400


def _error(exc: BaseException, status: Optional[int] = None) -> web.Response:
    body = {"error": type(exc).__name__, "message": str(exc)}
    return web.json_response(body, status=status or _status_of(exc))


def _ids_of_json(value) -> np.ndarray:
    """An int64 array of the JSON ids (nested lists of integers, or one integer)."""
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise errors.KeyTypeError(
            f"ids must be an integer or nested lists of them, got {value!r:.80}"
        )
    try:
        ids = np.array(value)
    except (ValueError, OverflowError) as exc:
        raise errors.KeyTypeError(f"ids: {exc}") from None
    if ids.size == 0:
        return ids.astype(np.int64)
    if ids.dtype.kind not in "iu" or ids.dtype == np.uint64:
        raise errors.KeyTypeError(
            "ids must be int64 integers in nested lists of equal lengths "
            f"(read as {ids.dtype}: a float, string, bool or ragged list)"
        )
    return ids.astype(np.int64, copy=False)


def _shape_of_query(text: Optional[str], count: int) -> tuple:
    if text is None or text == "":
        return (count,)
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise errors.InvalidArgument(
            f"shape must be comma-separated integers, got {text!r}"
        ) from None
    if any(d < 0 for d in shape) or int(np.prod(shape, dtype=object)) != count:
        raise errors.ShapeError(f"shape {text!r} does not hold the {count} ids of the body")
    return shape


class HttpServer:
    """The aiohttp app of a `ServingServer`, on a thread with its own event loop.

    Args:
        server: the ServingServer (its lookup, status and metrics).
        host, port: where to listen (port 0: a free one).
    """

    def __init__(self, server, host: str, port: int):
        self._server = server
        self._host = host
        self._port = int(port)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._runner: Optional[web.AppRunner] = None
        max_batch = server.config.max_batch
        # JSON spends up to ~21 bytes an id; the raw body 8. aiohttp answers 413 beyond this.
        self._max_body = max(1 << 20, 24 * max_batch + 4096)

    def app(self) -> web.Application:
        """The aiohttp application (its routes)."""
        app = web.Application(client_max_size=self._max_body)
        app.router.add_post("/v1/lookup", self._lookup)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        return app

    def start(self) -> str:
        """Starts listening; returns the URL (``http://host:port``)."""
        started = threading.Event()
        failure: list = []
        url: list = []

        def run():
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
                loop.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
                loop.run_until_complete(site.start())
                host, port = site._server.sockets[0].getsockname()[:2]  # the port 0 picked
                url.append(f"http://{host}:{port}")
            except BaseException as exc:  # noqa: BLE001 - handed to start()
                failure.append(exc)
                started.set()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._runner.cleanup())
                loop.close()

        self._thread = threading.Thread(target=run, name="kvsparse-serve-http", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        return url[0]

    def stop(self) -> None:
        """Stops the app and its thread."""
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)

    # -- handlers ---------------------------------------------------------------------------

    async def _lookup(self, request: web.Request) -> web.Response:
        metrics = self._server.metrics
        try:
            content_type = request.content_type
            if content_type == _JSON:
                response = await self._lookup_json(request)
            elif content_type == _RAW:
                response = await self._lookup_raw(request)
            else:
                metrics.refused("http", errors.InvalidArgument("content type"))
                return _error(
                    errors.InvalidArgument(
                        f"Content-Type must be {_JSON} or {_RAW}, got {content_type!r}"
                    ),
                    415,
                )
        except errors.KVSparseError as exc:
            metrics.refused("http", exc)
            return _error(exc)
        except web.HTTPRequestEntityTooLarge as exc:
            metrics.refused("http", errors.LimitExceeded(str(exc)))
            return _error(errors.LimitExceeded(f"request body too large: {exc.text}"), 413)
        return response

    def _run_lookup(self, table, ids, default):
        rows, version = self._server.lookup(table, ids, default, "http")
        return rows, (None if version is None else version.get("seq"))

    async def _lookup_json(self, request: web.Request) -> web.Response:
        text = await request.text()
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise errors.InvalidArgument(f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise errors.InvalidArgument("the JSON body must be an object with table and ids")
        table, default = body.get("table"), body.get("default", "zeros")
        if not isinstance(table, str) or not table:
            raise errors.InvalidArgument("table must be a non-empty string")
        if "ids" not in body:
            raise errors.InvalidArgument("the JSON body has no ids")
        ids = _ids_of_json(body["ids"])
        rows, seq = self._run_lookup(table, ids, default)
        answer = {
            "table": table,
            "shape": list(rows.shape),
            "dim": int(rows.shape[-1]),
            "version": seq,
            "rows": rows.tolist(),
        }
        return web.json_response(answer)

    async def _lookup_raw(self, request: web.Request) -> web.Response:
        table = request.query.get("table")
        if not table:
            raise errors.InvalidArgument("a raw lookup names its table: /v1/lookup?table=NAME")
        default = request.query.get("default", "zeros")
        body = await request.read()
        if len(body) % 8:
            raise errors.ShapeError(
                f"a raw body holds int64 ids: {len(body)} bytes is no multiple of 8"
            )
        ids = np.frombuffer(body, "<i8")
        ids = ids.reshape(_shape_of_query(request.query.get("shape"), ids.size))
        rows, seq = self._run_lookup(table, ids, default)
        headers = {
            "X-Kvsparse-Shape": ",".join(map(str, rows.shape)),
            "X-Kvsparse-Dim": str(rows.shape[-1]),
            "X-Kvsparse-Version": "" if seq is None else str(seq),
        }
        data = np.ascontiguousarray(rows, "<f4").tobytes()
        return web.Response(body=data, content_type=_RAW, headers=headers)

    async def _healthz(self, request: web.Request) -> web.Response:
        status = self._server.status()
        return web.json_response(status, status=503 if status["version"] is None else 200)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = self._server.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


__all__ = ["HttpServer"]
