"""moto's S3 server with a counting middleware: requests and body bytes per kind, read over HTTP."""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

COUNTS_PATH = "/_counts"
COUNTERS = ("requests", "bytes_in", "bytes_out", "ranged", "in_place", "aborted", "service_us")
#: How long a snapshot waits for the requests in flight to finish.
SETTLE_TIMEOUT_S = 30.0


class CountingApp:
    """WSGI middleware: counts each request to ``app`` by kind, with the bytes of its bodies."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Condition()
        self.counts: dict[str, dict[str, int]] = {}
        self.in_flight = 0

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == COUNTS_PATH:
            with self.lock:
                # Requests still finishing (a body written, not yet recorded) belong before the snapshot.
                self.lock.wait_for(lambda: self.in_flight == 0, timeout=SETTLE_TIMEOUT_S)
                body = json.dumps(self.counts).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        started = time.perf_counter()
        with self.lock:
            self.in_flight += 1
        kind = request_kind(environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", ""))
        decoded = environ.get("HTTP_X_AMZ_DECODED_CONTENT_LENGTH")  # aws-chunked uploads: the payload's bytes
        bytes_in = int(decoded or environ.get("CONTENT_LENGTH") or 0)
        ranged = bool(environ.get("HTTP_RANGE"))
        try:
            body = None
            if kind == "GET_object" and ranged:
                body = range_in_place(environ, start_response)
            in_place = body is not None
            if body is None:
                body = self.app(environ, start_response)
        except BaseException:
            self.record(kind, bytes_in, 0, ranged, True, started, False)
            raise
        return CountedBody(self, kind, bytes_in, ranged, body, started, in_place)

    def record(
        self, kind: str, bytes_in: int, bytes_out: int, ranged: bool, aborted: bool, started: float, in_place: bool
    ) -> None:
        with self.lock:
            c = self.counts.setdefault(kind, dict.fromkeys(COUNTERS, 0))
            c["in_place"] += int(in_place)
            c["service_us"] += int((time.perf_counter() - started) * 1e6)
            c["requests"] += 1
            c["bytes_in"] += bytes_in
            c["bytes_out"] += bytes_out
            c["ranged"] += int(ranged)
            c["aborted"] += int(aborted)
            self.in_flight -= 1
            self.lock.notify_all()
            # Response sizes by power of two: "out<2^k" counts bodies of 2^(k-1) up to 2^k - 1 bytes.
            size_class = f"out<2^{bytes_out.bit_length()}"
            c[size_class] = c.get(size_class, 0) + 1


class CountedBody:
    """A response body that counts its bytes once the server has written them; recorded once, as aborted
    if the server stopped before the end (the client hung up: a timeout, then a retry)."""

    def __init__(
        self,
        app: CountingApp,
        kind: str,
        bytes_in: int,
        ranged: bool,
        inner: Iterable[bytes],
        started: float,
        in_place: bool,
    ) -> None:
        self.app, self.kind, self.bytes_in, self.ranged, self.inner = app, kind, bytes_in, ranged, inner
        self.started, self.in_place = started, in_place
        self.sent = 0
        self.complete = False
        self.done = False

    def __iter__(self) -> Iterator[bytes]:
        # Recorded when the server asks past the last chunk, or when it drops the iterator (a write to a
        # closed connection raises out of werkzeug's loop, which then need not reach ``close``).
        try:
            for chunk in self.inner:
                yield chunk
                self.sent += len(chunk)  # back here: the server wrote it
            self.complete = True
        finally:
            self._record()

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
        self._record()

    def _record(self) -> None:
        if not self.done:
            self.done = True
            self.app.record(
                self.kind, self.bytes_in, self.sent, self.ranged, not self.complete, self.started, self.in_place
            )


def range_in_place(environ: dict[str, Any], start_response: Any) -> list[bytes] | None:
    """A plain ranged GetObject answered from the stored object's bytes in that range (206, with the headers
    moto sends for a part of an object: ETag, Last-Modified, Content-Range, no checksum); None where moto's
    own path must answer (a query string, a condition other than a matching If-Match, a suffix,
    unsatisfiable or whole-object range, no such key)."""
    from urllib.parse import unquote

    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    spec = environ.get("HTTP_RANGE", "")
    if environ.get("QUERY_STRING") or not spec.startswith("bytes=") or "," in spec:
        return None
    if any(k in environ for k in ("HTTP_IF_NONE_MATCH", "HTTP_IF_MODIFIED_SINCE", "HTTP_IF_UNMODIFIED_SINCE")):
        return None
    first, _, last = spec[len("bytes=") :].partition("-")
    if not first.isdigit() or not (last.isdigit() or last == ""):
        return None
    bucket, _, name = environ.get("PATH_INFO", "").lstrip("/").partition("/")
    try:
        key = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, unquote(name))
    except Exception:  # noqa: BLE001 - no such bucket or key: moto answers with its error
        return None
    if key is None or int(first) >= key.size:
        return None
    if environ.get("HTTP_IF_MATCH", key.etag) != key.etag:
        return None  # moto answers 412
    begin, end = int(first), min(int(last) if last else key.size - 1, key.size - 1)
    if begin == 0 and end == key.size - 1:
        return None  # the whole object: moto's path sends its checksum, which clients asking for one check
    with key.lock:
        key._value_buffer.seek(begin)
        data = key._value_buffer.read(end - begin + 1)
    headers = [
        ("Content-Type", key.metadata.get("Content-Type") or "binary/octet-stream"),
        ("Content-Length", str(len(data))),
        ("Content-Range", f"bytes {begin}-{end}/{key.size}"),
        ("Accept-Ranges", "bytes"),
        ("ETag", key.etag),
        ("Last-Modified", key.last_modified_RFC1123),
    ]
    start_response("206 Partial Content", headers)
    return [data]


def request_kind(method: str, path: str) -> str:
    """``GET_object`` (a key's bytes) or ``GET_list`` (a bucket-level GET: listings); other methods by name.
    Path-style addressing (``/bucket/key``), which both pyarrow and botocore use for an IP endpoint."""
    if method != "GET":
        return method
    parts = [p for p in path.split("/") if p]
    return "GET_object" if len(parts) >= 2 else "GET_list"


def read_counts(host_port: str) -> dict[str, dict[str, int]]:
    """The server's running totals (``GET /_counts``)."""
    with urllib.request.urlopen(f"http://{host_port}{COUNTS_PATH}", timeout=30) as r:
        return json.loads(r.read())


def counts_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """What happened between two snapshots, per kind (kinds and size classes with nothing in it left out)."""
    out = {}
    for kind, c in after.items():
        b = before.get(kind, {})
        d = {k: v - b.get(k, 0) for k, v in c.items()}
        if d["requests"]:
            out[kind] = {k: v for k, v in d.items() if v or not k.startswith("out<")}
    return out


def largest_class(counts: dict[str, int]) -> int:
    """The upper bound (bytes) of the largest size class in one kind's counts: the largest body < this."""
    bits = [int(k.removeprefix("out<2^")) for k, v in counts.items() if k.startswith("out<") and v]
    return 2 ** max(bits) if bits else 0


def main(argv: list[str] | None = None) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, required=True)
    args = parser.parse_args(argv)
    app = CountingApp(DomainDispatcherApplication(create_backend_app))

    class Handler(MotoRequestHandler):
        # TCP_NODELAY: werkzeug writes a response's headers and body separately; with Nagle's algorithm
        # the body waits for the client's delayed ACK (40 ms on Linux) on every request.
        disable_nagle_algorithm = True

    run_simple(args.host, args.port, app, threaded=True, request_handler=Handler)


if __name__ == "__main__":
    main()
