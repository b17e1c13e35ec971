"""``BoundedMap``: the one bounded mapping behind rayckpt's caches and histories."""

from __future__ import annotations

import pytest

from rayckpt.bounded import BoundedMap


def test_past_its_limit_the_least_recently_used_go_first():
    m: BoundedMap[str, int] = BoundedMap(3)
    for i, key in enumerate("abc"):
        assert m.put(key, i) == []
    assert m.get("a") == 0  # a is now the most recent
    assert m.put("d", 3) == [("b", 1)]
    assert list(m) == ["c", "a", "d"] and len(m) == 3 and m.held == 3
    assert "b" not in m and m.get("b", -1) == -1


def test_peek_index_and_iteration_leave_the_order_alone():
    m: BoundedMap[str, int] = BoundedMap(2)
    m.put("a", 1)
    m.put("b", 2)
    assert m.peek("a") == 1 and m["a"] == 1 and m.items() == [("a", 1), ("b", 2)]
    assert m.put("c", 3) == [("a", 1)]
    with pytest.raises(KeyError):
        m["a"]


def test_a_weight_bounds_the_total_and_the_newest_entry_always_stays():
    m: BoundedMap[str, list[int]] = BoundedMap(5, weight=len)
    m.put("a", [1, 2])
    m.put("b", [1, 2, 3])
    assert m.held == 5
    assert m.put("a", [1]) == []  # replacing a key replaces its weight: 3 + 1
    assert m.held == 4
    assert m.put("big", list(range(9))) == [("b", [1, 2, 3]), ("a", [1])]
    assert list(m) == ["big"] and m.held == 9
    assert m.pop("big") == list(range(9)) and m.held == 0 and m.pop("big") is None


def test_a_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="a BoundedMap keeps at least one entry, got limit=0"):
        BoundedMap(0)
