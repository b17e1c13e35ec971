"""``gather`` / ``scatter`` / ``plan_at_root`` in one process: the local world, a coordinator with
only ``all_gather`` (the fallback), and a collective that breaks. Real groups: tests/multiproc."""

from __future__ import annotations

import errno
import logging
import re

import pytest

from rayckpt.engine.coordinator import LocalCoordinator, gather, gather_or_raise, plan_at_root, scatter
from rayckpt.errors import (
    CorruptCheckpointError,
    IncompatibleStateError,
    PeerLostError,
    RayckptError,
    SaveFailedError,
    describe_error,
)


class AllGatherOnly:
    """A world of one that only has ``all_gather`` (what older custom coordinators implement)."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.calls = 0

    def all_gather(self, obj):
        self.calls += 1
        return [obj]


class Broken(AllGatherOnly):
    def all_gather(self, obj):
        raise RuntimeError("[gloo] Connection closed by peer")


def test_the_local_world_plans_its_own_part():
    assert plan_at_root(LocalCoordinator(), "p", lambda: 5, lambda vs: [v * 2 for v in vs], RayckptError) == 10
    assert gather(LocalCoordinator(), "x") == ["x"] and scatter(LocalCoordinator(), ["y"]) == "y"


def test_a_coordinator_with_only_all_gather_falls_back_to_it():
    coord = AllGatherOnly()
    assert plan_at_root(coord, "p", lambda: 5, lambda vs: [v + 1 for v in vs], RayckptError) == 6
    assert coord.calls == 2  # the gather and the scatter


def test_a_rayckpt_error_in_a_world_of_one_is_raised_as_itself():
    def local():
        raise IncompatibleStateError("key 'w': shape [3] but the checkpoint has [4]")

    with pytest.raises(IncompatibleStateError, match=r"^key 'w': shape \[3\]"):
        plan_at_root(LocalCoordinator(), "load (planning)", local, lambda vs: vs, RayckptError)


def test_a_failing_plan_is_the_callers_error_naming_rank_0_and_the_cause():
    def plan(values):
        raise ValueError("no chunk covers rows [0, 4)")

    with pytest.raises(RayckptError) as err:
        plan_at_root(LocalCoordinator(), "load (planning)", lambda: 1, plan, RayckptError)
    msg = str(err.value)
    assert msg.startswith("load (planning) failed on 1 of 1 rank(s):\n  rank 0: ValueError: no chunk covers")
    assert isinstance(err.value.__cause__, ValueError)


def test_a_failure_reaches_the_ranks_as_its_cause_chain_in_words_and_its_frames_go_to_the_debug_log(caplog):
    def commit():
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/manifest.json")
        except OSError as exc:
            raise RuntimeError("writing the manifest") from exc

    with caplog.at_level(logging.DEBUG, logger="rayckpt.engine.coordinator"):
        with pytest.raises(SaveFailedError) as err:
            gather_or_raise(LocalCoordinator(), "save (commit)", commit, SaveFailedError)
    assert str(err.value) == (
        "save (commit) failed on 1 of 1 rank(s):\n  rank 0: RuntimeError: writing the manifest; caused by "
        "OSError: [Errno 28] No space left on device: '/ckpt/manifest.json'"
    )
    assert not re.search(r'File "|line \d+, in', str(err.value))
    assert isinstance(err.value.__cause__, RuntimeError)  # the frames stay on the raised error's chain
    assert "in commit" in caplog.text and "Traceback" in caplog.text  # and in the debug log


@pytest.mark.parametrize(
    "exc, text",
    [
        (ValueError("bad\n  value"), "ValueError: bad value"),  # one line
        (KeyError(), "KeyError"),
        (CorruptCheckpointError("a.arrow:\n  block 3 differs"), "CorruptCheckpointError: a.arrow:\n  block 3 differs"),
    ],
)
def test_describe_error_is_the_type_and_the_message(exc, text):
    assert describe_error(exc) == text


def test_describe_error_follows_the_cause_chain_to_a_rayckpt_error_or_four_links():
    def chained(*links: BaseException) -> BaseException:
        for cause, exc in zip(links[1:], links):
            exc.__cause__ = cause
        return links[0]

    assert describe_error(chained(OSError("a"), RayckptError("b"), OSError("c"))) == (
        "OSError: a; caused by RayckptError: b"  # a rayckpt error names its own cause
    )
    five = chained(*(ValueError(str(n)) for n in range(5)))
    assert describe_error(five) == "; caused by ".join(f"ValueError: {n}" for n in range(4))
    try:
        try:
            raise KeyError("x")
        except KeyError:
            raise ValueError("while handling") from None  # a suppressed context is not named
    except ValueError as exc:
        assert describe_error(exc) == "ValueError: while handling"
    try:
        try:
            raise KeyError("x")
        except KeyError:
            raise ValueError("while handling")  # noqa: B904 - the context is named
    except ValueError as exc:
        assert describe_error(exc) == "ValueError: while handling; caused by KeyError: 'x'"


def test_a_broken_collective_raises_the_lost_error_naming_gather_scatter_and_rank():
    with pytest.raises(PeerLostError, match=r"^save \(planning\) failed: the gather/scatter collective failed on "):
        plan_at_root(Broken(), "save (planning)", lambda: 1, lambda vs: vs, SaveFailedError, PeerLostError)
