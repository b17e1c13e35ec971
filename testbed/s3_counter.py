"""moto's S3 server with a counting middleware: requests and body bytes per kind, read over HTTP."""

from __future__ import annotations

import argparse
import json
import threading
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

COUNTS_PATH = "/_counts"
COUNTERS = ("requests", "bytes_in", "bytes_out", "ranged", "in_place", "aborted")
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
        with self.lock:
            self.in_flight += 1
        decoded = environ.get("HTTP_X_AMZ_DECODED_CONTENT_LENGTH")  # aws-chunked uploads: the payload's bytes
        request = {"kind": request_kind(environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", ""))}
        request |= {"bytes_in": int(decoded or environ.get("CONTENT_LENGTH") or 0)}
        request |= {"ranged": bool(environ.get("HTTP_RANGE")), "in_place": False}
        try:
            body = None
            if request["kind"] == "GET_object" and request["ranged"]:
                body = range_in_place(environ, start_response)
            request["in_place"] = body is not None
            if body is None:
                body = self.app(environ, start_response)
        except BaseException:
            self.record(request, 0, aborted=True)
            raise
        return CountedBody(self, request, body)

    def record(self, request: dict[str, Any], bytes_out: int, aborted: bool) -> None:
        """One request done: its ``request_kind``, body bytes in, whether ranged and answered in place."""
        with self.lock:
            c = self.counts.setdefault(request["kind"], dict.fromkeys(COUNTERS, 0))
            for key in ("bytes_in", "ranged", "in_place"):
                c[key] += int(request[key])
            c["requests"] += 1
            c["bytes_out"] += bytes_out
            c["aborted"] += int(aborted)
            self.in_flight -= 1
            self.lock.notify_all()


class CountedBody:
    """A response body that counts its bytes once the server has written them; recorded once, as aborted
    if the server stopped before the end (the client hung up: a timeout, then a retry)."""

    def __init__(self, app: CountingApp, request: dict[str, Any], inner: Iterable[bytes]) -> None:
        self.app, self.request, self.inner = app, request, inner
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
            self.app.record(self.request, self.sent, aborted=not self.complete)


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
    """What happened between two snapshots, per kind (kinds with no request left out)."""
    out = {}
    for kind, c in after.items():
        d = {k: v - before.get(kind, {}).get(k, 0) for k, v in c.items()}
        if d["requests"]:
            out[kind] = d
    return out


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
