"""crossbar.weakid.WeakIdDict: per-connection state keyed weakly by identity."""

from __future__ import annotations

import gc

import pytest
from mitmproxy.test import tflow

from crossbar.weakid import WeakIdDict


class Key:
    """Equal to every other Key, with one hash: only identity may tell two apart."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key)

    def __hash__(self) -> int:
        return 1


def test_entries_are_by_identity_not_equality() -> None:
    a, b = Key(), Key()
    d: WeakIdDict[Key, str] = WeakIdDict()
    d[a] = "a"
    assert d.get(b) is None and b not in d and d.get(a) == "a" and a in d
    d[b] = "b"
    d[a] = "a2"  # replaced in place
    assert (d[a], d[b], len(d)) == ("a2", "b", 2)
    assert sorted(d.values()) == ["a2", "b"] and set(map(id, d)) == {id(a), id(b)}


def test_missing_keys() -> None:
    d: WeakIdDict[Key, int] = WeakIdDict()
    k = Key()
    with pytest.raises(KeyError):
        _ = d[k]
    with pytest.raises(KeyError):
        del d[k]
    assert d.pop(k, 7) == 7
    assert d.setdefault(k, 3) == 3 and d.setdefault(k, 4) == 3
    assert d.pop(k) == 3 and not d


def test_an_entry_goes_with_its_key_and_never_answers_for_a_later_object() -> None:
    d: WeakIdDict[Key, int] = WeakIdDict()
    k = Key()
    d[k] = 1
    dead_id = id(k)
    del k
    gc.collect()
    assert not d and d.values() == [] and list(d) == []
    # objects made now may reuse the freed id: none of them finds the old value
    later = [Key() for _ in range(1000)]
    assert all(d.get(obj) is None for obj in later)
    reused = next((obj for obj in later if id(obj) == dead_id), later[0])
    d[reused] = 2  # also clears what the dead key left behind
    assert d[reused] == 2 and len(d._entries) == 1


def test_keys_collected_with_mitmproxys_flows_leave_only_the_live_entry() -> None:
    d: WeakIdDict[object, int] = WeakIdDict()
    flows = [tflow.tflow() for _ in range(50)]
    for n, flow in enumerate(flows):
        d[flow.client_conn] = n
    keep = flows[0].client_conn
    del flow
    flows.clear()
    gc.collect()  # mitmproxy's flows and connections sit in reference cycles
    assert d.values() == [0] and d[keep] == 0
    d[keep] = 1
    assert len(d._entries) == 1
