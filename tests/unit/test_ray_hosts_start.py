"""The host rig's Ray start is tried again only when a node's raylet timed out registering (no root needed)."""

from __future__ import annotations

import pytest

from testbed.ray_hosts import RAYLET_TIMED_OUT, tried


def builder(*failures: str):
    calls = []

    def build() -> str:
        calls.append(1)
        if len(calls) <= len(failures):
            raise RuntimeError(failures[len(calls) - 1])
        return "cluster"

    return build, calls


def test_a_raylet_that_timed_out_registering_is_started_again():
    build, calls = builder(f"`ray start` exited on host 2 (status 1):\nException: {RAYLET_TIMED_OUT}.")
    assert tried(build, 2) == "cluster" and len(calls) == 2


def test_other_failures_and_the_last_try_are_raised():
    build, calls = builder("the Ray head did not listen on 10.0.0.1:6379")
    with pytest.raises(RuntimeError, match="did not listen"):
        tried(build, 2)
    assert len(calls) == 1
    build, calls = builder(RAYLET_TIMED_OUT, RAYLET_TIMED_OUT)
    with pytest.raises(RuntimeError, match=RAYLET_TIMED_OUT):
        tried(build, 2)
    assert len(calls) == 2
