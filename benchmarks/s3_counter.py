"""moto's S3 server with a counting middleware: requests and body bytes per kind, read over HTTP.

``python -m benchmarks.s3_counter -H 127.0.0.1 -p PORT`` serves moto's WSGI app
as ``python -m moto.server`` does (werkzeug, a thread per connection, moto's
request handler), so ``rayckpt.testing.s3_server.start_moto_server(...,
module="benchmarks.s3_counter")`` starts it like the plain server. Every request
is counted by kind (``GET_object`` / ``GET_list`` / ``HEAD`` / ``PUT`` / ``POST`` /
``DELETE``): requests, response body bytes as they leave the app (``bytes_out``),
request body bytes (``bytes_in``, from the headers), ranged GETs and the bodies'
sizes by power of two. ``GET /_counts`` (not a valid bucket name, so never an S3 request) returns the
running totals as JSON; a benchmark diffs two snapshots around an operation, so
both systems under test are counted by the server, the same way.
"""

from __future__ import annotations

import argparse
import json
import threading
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

COUNTS_PATH = "/_counts"


class CountingApp:
    """WSGI middleware: counts each request to ``app`` by kind, with the bytes of its bodies."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.counts: dict[str, dict[str, int]] = {}

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == COUNTS_PATH:
            with self.lock:
                body = json.dumps(self.counts).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        kind = request_kind(environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", ""))
        decoded = environ.get("HTTP_X_AMZ_DECODED_CONTENT_LENGTH")  # aws-chunked uploads: the payload's bytes
        bytes_in = int(decoded or environ.get("CONTENT_LENGTH") or 0)
        ranged = bool(environ.get("HTTP_RANGE"))
        return CountedBody(self, kind, bytes_in, ranged, self.app(environ, start_response))

    def record(self, kind: str, bytes_in: int, bytes_out: int, ranged: bool) -> None:
        with self.lock:
            c = self.counts.setdefault(kind, {"requests": 0, "bytes_in": 0, "bytes_out": 0, "ranged": 0})
            c["requests"] += 1
            c["bytes_in"] += bytes_in
            c["bytes_out"] += bytes_out
            c["ranged"] += int(ranged)
            # Response sizes by power of two: "out<2^k" counts bodies of 2^(k-1) up to 2^k - 1 bytes.
            size_class = f"out<2^{bytes_out.bit_length()}"
            c[size_class] = c.get(size_class, 0) + 1


class CountedBody:
    """A response body that counts its bytes as the server sends them; recorded once, on ``close``."""

    def __init__(self, app: CountingApp, kind: str, bytes_in: int, ranged: bool, inner: Iterable[bytes]) -> None:
        self.app, self.kind, self.bytes_in, self.ranged, self.inner = app, kind, bytes_in, ranged, inner
        self.sent = 0
        self.done = False

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.sent += len(chunk)
            yield chunk

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
        if not self.done:
            self.done = True
            self.app.record(self.kind, self.bytes_in, self.sent, self.ranged)


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
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(args.host, args.port, CountingApp(app), threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
