"""A dictionary keyed weakly by object identity: per-connection state that goes with its connection.

`weakref.WeakKeyDictionary` makes a weak reference for every lookup and hashes and compares keys
through their own methods; mitmproxy's connections define both in Python (by their `id`), so a
lookup ran three Python functions, and the request path makes several per request. `WeakIdDict`
keys by `id()` and keeps one reference per entry, checked on every lookup, so an entry never
answers for a later object that happens to get the same id.

An entry whose key dies is forgotten at once by lookups (its reference is dead) and removed from
memory at the next insertion: the reference's callback only notes it, because the collector may
run it in the middle of another operation on the dictionary, on any thread.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, overload

_MISSING: Any = object()


class WeakIdDict[K, V]:
    """Values per live key object; a key's entry goes when the key is collected."""

    __slots__ = ("_dead", "_entries")

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[K], V]] = {}
        self._dead: list[tuple[int, weakref.ref[K]]] = []  # appended by the references' callbacks

    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get[D](self, key: K, default: D) -> V | D: ...

    def get(self, key: K, default: Any = None) -> Any:
        entry = self._entries.get(id(key))
        if entry is None or entry[0]() is not key:
            return default
        return entry[1]

    def __getitem__(self, key: K) -> V:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __contains__(self, key: K) -> bool:
        return self.get(key, _MISSING) is not _MISSING

    def __setitem__(self, key: K, value: V) -> None:
        if self._dead:
            self._purge()
        at = id(key)
        entry = self._entries.get(at)
        if entry is not None and entry[0]() is key:
            self._entries[at] = (entry[0], value)
            return
        dead = self._dead  # the callback holds the list, not the dictionary; appending is one step
        self._entries[at] = (weakref.ref(key, lambda ref: dead.append((at, ref))), value)

    def setdefault(self, key: K, default: V) -> V:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            self[key] = value = default
        return value

    def pop(self, key: K, default: Any = _MISSING) -> Any:
        at = id(key)
        entry = self._entries.get(at)
        if entry is None or entry[0]() is not key:
            if default is _MISSING:
                raise KeyError(key)
            return default
        del self._entries[at]
        return entry[1]

    def __delitem__(self, key: K) -> None:
        self.pop(key)

    def values(self) -> list[V]:
        """The values of live keys (a list: safe to keep while the dictionary changes)."""
        return [value for ref, value in list(self._entries.values()) if ref() is not None]

    def __len__(self) -> int:
        return len(self.values())

    def __iter__(self) -> Iterator[K]:
        keys = [ref() for ref, _ in list(self._entries.values())]
        return iter([key for key in keys if key is not None])

    def _purge(self) -> None:
        dead = self._dead
        while dead:
            at, ref = dead.pop()
            entry = self._entries.get(at)
            if entry is not None and entry[0] is ref:  # not a later key's entry under the same id
                del self._entries[at]
