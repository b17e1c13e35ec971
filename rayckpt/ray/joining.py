"""Which Ray cluster a driver joins, found out before ``ray.init`` so a dead one is never waited on.

``ray.init(address=None)`` joins the cluster whose address ``ray start`` left in
Ray's temp directory (``ray_current_cluster``). A head that died without ``ray
stop`` (killed, crashed, its host rebooted) leaves that file behind, and
``ray.init`` then retries the dead address for minutes, printing only connection
warnings. ``cluster_address`` asks the address first (does a gRPC server answer
there, a few seconds at most): a stale file is skipped with one WARNING naming it, and a dead
address the caller named is refused with an error that says what to do.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)

#: The longest wait for a cluster's address to answer.
PROBE_TIMEOUT_S = 3.0
#: The file ``ray start`` writes its address to, in Ray's temp directory.
ADDRESS_FILE = "ray_current_cluster"


class ClusterUnreachableError(ConnectionError):
    """The Ray cluster to join does not answer at its address; the message says what to do."""


def address_file() -> str:
    """Where ``ray start`` left the address of the cluster last started on this machine (Ray's own rule:
    ``$RAY_TMPDIR/ray``, else ``$TMPDIR/ray``, else ``/tmp/ray``)."""
    tmp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(tmp, "ray", ADDRESS_FILE)


#: An HTTP/2 client's connection preface and an empty SETTINGS frame: a Ray GCS (a gRPC server) answers
#: with a SETTINGS frame of its own.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4


def answers(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a gRPC server (a Ray GCS) answers at ``address`` (``HOST:PORT``) within ``timeout_s``.

    A TCP connect alone is not enough: a proxy, or another program on a reused port,
    may accept it. The server must answer an HTTP/2 connection preface with its
    SETTINGS frame.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            conn.sendall(_HTTP2_HELLO)
            head = b""
            while len(head) < 9:  # a frame header: length (3 bytes), type, flags, stream id (4 bytes)
                got = conn.recv(9 - len(head))
                if not got:
                    return False
                head += got
            return head[3] == _SETTINGS
    except OSError:
        return False


def cluster_address(address: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """What to pass to ``ray.init(address=...)`` for ``address`` as a user gives it (``--address``).

    - ``"local"``: ``"local"`` (a new local Ray).
    - ``None``: ``RAY_ADDRESS`` if set, else the address in ``ray_current_cluster``
      if it answers, else ``"local"``; a file whose address does not answer is
      skipped with one WARNING naming the address and the file.
    - ``"auto"``: as ``None``, but a file whose address does not answer fails; with no
      file, ``"auto"`` (Ray looks for a running cluster, or fails at once).
    - ``HOST:PORT`` (or ``RAY_ADDRESS``): itself, once it answers.

    Addresses with a scheme (``ray://``, ``http://``) are returned as they are.

    Args:
        address: The address asked for: ``None``, ``"auto"``, ``"local"`` or ``HOST:PORT``.
        timeout_s: The longest wait for an address to answer.

    Returns:
        The address for ``ray.init``: ``HOST:PORT``, a URL, or ``"local"``.

    Raises:
        ClusterUnreachableError: The address named (``HOST:PORT``, ``RAY_ADDRESS``) does
            not answer, or ``"auto"`` finds no live cluster.
    """
    if address == "local":
        return "local"
    named = address if address not in (None, "auto") else os.environ.get("RAY_ADDRESS") or None
    if named is not None:
        source = "RAY_ADDRESS" if named != address else "--address"
        if "://" in named or answers(named, timeout_s):
            return named
        raise ClusterUnreachableError(
            f"the Ray cluster at {named} (from {source}) does not answer within {timeout_s:g} s: start it "
            "(ray start --head), name a live one, or pass --address local for a new local Ray"
        )
    path = address_file()
    try:
        with open(path) as f:
            last = f.read().strip()
    except OSError:
        last = ""
    if last and answers(last, timeout_s):
        return last
    if address == "auto":
        if not last:
            return "auto"  # Ray's own search: a running cluster on this machine, or its error at once
        raise ClusterUnreachableError(
            f"--address auto: the cluster last started on this machine ({last}, from {path}) does not answer; "
            "start one (ray start --head), remove that file, or pass --address local for a new local Ray"
        )
    if last:
        logger.warning(
            "rayckpt: the Ray cluster last started on this machine (%s, from %s) does not answer: it stopped "
            "without `ray stop`; starting a new local Ray instead (remove that file, or pass --address, to choose)",
            last,
            path,
        )
    return "local"
