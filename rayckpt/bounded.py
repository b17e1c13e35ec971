"""A mapping that keeps only its most recently used entries: every bounded cache and history in rayckpt."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedMap(Generic[K, V]):
    """Entries by key, least recently used first; past ``limit`` the oldest are dropped.

    ``get`` and ``put`` make a key the most recent; ``peek``, ``[key]``, ``in`` and
    iteration leave the order alone. With ``weight``, the limit bounds the entries' total
    weight instead of their number, and the newest entry stays even if it alone
    weighs more. Not thread-safe: its owner holds a lock where threads share it.

    Args:
        limit: the most entries (or total weight) kept; at least 1.
        weight: an entry's weight (default: 1 each).

    Raises:
        ValueError: ``limit`` is below 1.
    """

    def __init__(self, limit: int, weight: Callable[[V], int] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"a BoundedMap keeps at least one entry, got limit={limit}")
        self.limit = limit
        self._weight = weight
        self._entries: OrderedDict[K, V] = OrderedDict()
        #: The entries' total weight (their number without ``weight``).
        self.held = 0

    def _weigh(self, value: V) -> int:
        return 1 if self._weight is None else self._weight(value)

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value of ``key`` (made the most recent), else ``default``."""
        if key not in self._entries:
            return default
        self._entries.move_to_end(key)
        return self._entries[key]

    def peek(self, key: K, default: V | None = None) -> V | None:
        """The value of ``key`` without changing the order, else ``default``."""
        return self._entries.get(key, default)

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Set ``key`` as the most recent entry; returns the entries dropped to stay within ``limit``."""
        self.pop(key)
        self._entries[key] = value
        self.held += self._weigh(value)
        dropped = []
        while self.held > self.limit and len(self._entries) > 1:
            old = self._entries.popitem(last=False)
            self.held -= self._weigh(old[1])
            dropped.append(old)
        return dropped

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Remove ``key`` and return its value, else ``default``."""
        if key not in self._entries:
            return default
        value = self._entries.pop(key)
        self.held -= self._weigh(value)
        return value

    def __getitem__(self, key: K) -> V:
        """The value of ``key`` without changing the order; ``KeyError`` if it is not held."""
        return self._entries[key]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._entries))

    def items(self) -> list[tuple[K, V]]:
        """The entries, least recently used first (a copy: the map may change while it is read)."""
        return list(self._entries.items())

    def values(self) -> list[V]:
        return list(self._entries.values())
