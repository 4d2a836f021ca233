"""State TTL per descriptor (Flink's StateTtlConfig: processing time, OnCreateAndWrite,
NeverReturnExpired, full-snapshot cleanup): writes refresh an entry's timestamp and reads do
not; an expired entry reads as absent (values, list elements, map entries); expired entries
never reach a materialized file and are never restored; states without TTL write exactly the
bytes they wrote before TTL existed. The clock is injected, so every test is deterministic.
Every test runs on both state tables, heap and rocksdb."""

from __future__ import annotations

import hashlib
import json

import pytest

import dstl_ray as d
from dstl_ray.errors import ConfigError, HandleError, StateError
from dstl_ray.format.materialized import MaterializedHandle, parse_states
from dstl_ray.state.records import StateKind, apply_records
from dstl_ray.state.snapshot import KeyedStateSnapshot, component_changes
from dstl_ray.state.ttl import StateTtlConfig
from dstl_ray.storage.registry import get_storage
from spark_glue.operator import ttl_spec
from spark_glue.views import KeyedState

from ..ckpt_util import MAXP, client, new_base

JOB = "ttl"
FULL = d.KeyGroupRange(0, MAXP - 1)
T0 = 1_700_000_000.0  # wall-clock seconds (stamps are ms since the epoch)


class Clock:
    """Processing time under the test's control."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


_TABLE = {"name": "heap"}


@pytest.fixture(autouse=True, params=["heap", "rocksdb"])
def state_backend(request, tmp_path):
    """Every test of this module on both state tables."""
    _TABLE.update(name=request.param, dir=str(tmp_path))
    yield request.param
    _TABLE["name"] = "heap"


def backend(base: str, clock: Clock, restore=()) -> d.ChangelogKeyedStateBackend:
    return d.ChangelogKeyedStateBackend(client(JOB, base), "op", FULL, MAXP,
                                        materialization_interval=None, ttl_clock=clock,
                                        restore=restore, state_backend=_TABLE["name"],
                                        local_dir=_TABLE.get("dir"))


def restore_from(base: str, snap: KeyedStateSnapshot, clock: Clock
                 ) -> d.ChangelogKeyedStateBackend:
    return backend(base, clock, [d.RestoreSource(snap, base, JOB, "test")])


def raw_keys(b: d.ChangelogKeyedStateBackend, name: str) -> set[bytes]:
    """Serialized keys the backend's table of ``name`` holds (expired or not)."""
    sid = b._names[name]
    return {k for _kg, k, _v in b._table.items(sid, FULL)}


# ------------------------------------------------------------------ update on write, reads


def test_write_refreshes_and_read_does_not():
    clock = Clock()
    b = backend(new_base(), clock)
    v = b.value_state("v", ttl=10)
    v.update("a", 1)
    v.update("b", 1)
    for t in (3, 6, 9.999):  # reads of "b" along the way never prolong it
        clock.t = T0 + t
        assert v.value("b") == 1
    clock.t = T0 + 9
    v.update("a", 2)  # a write restarts a's TTL
    clock.t = T0 + 10  # stamp + ttl <= now: expired exactly at 10 s (Flink's TtlUtils)
    assert v.value("b") is None and v.value("b", "gone") == "gone"
    assert v.value("a") == 2
    clock.t = T0 + 18.999
    assert v.value("a") == 2
    clock.t = T0 + 19
    assert v.value("a") is None
    b.close()


def test_never_return_expired_value_list_map():
    clock = Clock()
    b = backend(new_base(), clock)
    v, lst, m = b.value_state("v", 5), b.list_state("l", 5), b.map_state("m", 5)
    v.update("k", "old")
    lst.add("k", 1)
    m.put("k", "x", 1)
    m.put("k", "y", 2)
    clock.t = T0 + 3
    lst.add("k", 2)  # per element: the first element keeps its own stamp
    m.put("k", "y", 3)  # per entry: only y is refreshed
    clock.t = T0 + 5
    assert v.value("k") is None
    assert lst.get("k") == [2]
    assert m.get("k", "x") is None and m.get("k", "x", "d") == "d"
    assert m.items("k") == {"y": 3}
    assert b.dump() == {"v": {}, "l": {"k": [2]}, "m": {"k": {"y": 3}}}
    assert list(v.keys()) == [] and list(lst.keys()) == ["k"]
    lst.update("k", [7, 8])  # a whole-list write stamps every element
    clock.t = T0 + 9.9
    assert lst.get("k") == [7, 8] and m.items("k") == {}
    clock.t = T0 + 10
    assert lst.get("k") == [] and list(lst.keys()) == [] and list(m.keys()) == []
    b.close()


def test_ttl_config_validation_and_options():
    assert StateTtlConfig(1.5).ttl_ms == 1500
    assert d.ValueStateDescriptor("v", 2).ttl == StateTtlConfig(2)
    for bad in (0, -1, float("inf"), float("nan"), True, "10", 0.0001):
        with pytest.raises(StateError):
            StateTtlConfig(bad)
    with pytest.raises(StateError, match="OnCreateAndWrite"):
        StateTtlConfig(1, update_type="OnReadAndWrite")
    with pytest.raises(StateError, match="NeverReturnExpired"):
        StateTtlConfig(1, state_visibility="ReturnExpiredIfNotCleanedUp")
    with pytest.raises(ConfigError, match="'s'"):
        ttl_spec({"s": -3})
    assert ttl_spec({"b": 1, "a": StateTtlConfig(2)}) == (("a", StateTtlConfig(2)),
                                                          ("b", StateTtlConfig(1)))


def test_ttl_cannot_be_turned_on_or_off_for_a_state():
    b = backend(new_base(), Clock())
    b.value_state("v").update("k", 1)
    with pytest.raises(StateError, match="without a TTL"):
        b.value_state("v", ttl=5)
    b.value_state("t", ttl=5).update("k", 1)
    with pytest.raises(StateError, match="with a TTL"):
        b.value_state("t")
    b.value_state("t", ttl=50)  # a new duration is fine (it applies from now on)
    b.close()


# ------------------------------------------------------------------ materialization


def test_expired_entries_never_reach_the_materialized_file():
    base, clock = new_base(), Clock()
    b = backend(base, clock)
    v, lst, m = b.value_state("v", 10), b.list_state("l", 10), b.map_state("m", 10)
    plain = b.value_state("p")
    v.update("dead", "D" * 20)
    lst.add("k", "dead-item")
    m.put("k", "dead-entry", 1)
    clock.t = T0 + 6
    v.update("live", "L" * 20)
    lst.add("k", "live-item")
    m.put("k", "live-entry", 2)
    plain.update("dead", "stays: no TTL")
    clock.t = T0 + 12
    h = b.materialize().result(timeout=30)
    if isinstance(h, MaterializedHandle):  # heap: the file's bytes (rocksdb compresses)
        data = get_storage(base).read_file(f"{base}/{JOB}/{h.path}")
        assert b"D" * 20 not in data and b"dead-item" not in data and b"dead-entry" not in data
        assert b"L" * 20 in data and b"live-item" in data and b"live-entry" in data
        assert b"stays: no TTL" in data
    # the file's own records, decoded: only live entries, and the spec names the TTL
    tables, kinds = [{} for _ in h.states], [StateKind(s[1]) for s in h.states]
    for kg, recs in component_changes(h, base, JOB, FULL):
        apply_records(list(recs), tables, kinds, kg)
    names = [s[0] for s in h.states]
    ser = d.TaggedSerializer().serialize
    assert {k for t in tables[names.index("v")].values() for k in t} == {ser("live")}
    items = [x for t in tables[names.index("l")].values() for v in t.values() for x in v]
    assert len(items) == 1 and items[0].endswith(ser("live-item"))
    entries = [uk for t in tables[names.index("m")].values() for v in t.values() for uk in v]
    assert entries == [ser("live-entry")]
    assert h.states[names.index("v")] == ("v", "value", 10_000)
    assert h.states[names.index("p")] == ("p", "value")
    # the live tables lost the expired entries at the same instant (memory is freed)
    assert raw_keys(b, "v") == {ser("live")}
    assert b.dump()["p"] == {"dead": "stays: no TTL"}
    b.close()


def test_savepoint_leaves_out_expired_entries():
    base, clock = new_base(), Clock()
    b = backend(base, clock)
    b.value_state("v", 1).update("gone", "G" * 16)
    clock.t = T0 + 1
    snap = b.savepoint(f"{base}/sp").result(timeout=30)
    (h,) = snap.components
    assert b"G" * 16 not in get_storage(base).read_file(f"{base}/sp/{h.path}")
    b.close()


# ------------------------------------------------------------------ restore


def _write_mixed(b: d.ChangelogKeyedStateBackend, clock: Clock) -> None:
    """At T0: entries that expire at T0+10; at T0+8: entries that live until T0+18."""
    v, lst, m = b.value_state("v", 10), b.list_state("l", 10), b.map_state("m", 10)
    v.update("old", 1)
    lst.add("k", "old")
    m.put("k", "old", 1)
    clock.t = T0 + 8
    v.update("new", 2)
    lst.add("k", "new")
    m.put("k", "new", 2)


@pytest.mark.parametrize("materialized", [False, True], ids=["changelog", "materialized"])
def test_expired_entries_are_dropped_at_restore(materialized):
    base, clock = new_base(), Clock()
    b = backend(base, clock)
    _write_mixed(b, clock)
    if materialized:  # nothing expired yet: the file holds both generations
        b.materialize().result(timeout=30)
    snap = b.snapshot(checkpoint_id=1).result(timeout=30)
    kinds = {type(c).__name__ for c in snap.components}
    mat = "RocksDBHandle" if _TABLE["name"] == "rocksdb" else "MaterializedHandle"
    assert kinds == ({mat} if materialized else {"ChangelogComponent"})
    b.close()
    # restored before anything expired: all of it
    r = restore_from(base, snap, Clock(T0 + 9))
    assert r.dump() == {"v": {"old": 1, "new": 2}, "l": {"k": ["old", "new"]},
                        "m": {"k": {"old": 1, "new": 2}}}
    r.close()
    # restored after the first generation expired: never returned; once this run confirmed
    # the TTL (get_state), the next materialization leaves it out of the tables and files
    r = restore_from(base, snap, Clock(T0 + 12))
    assert r.dump() == {"v": {"new": 2}, "l": {"k": ["new"]}, "m": {"k": {"new": 2}}}
    assert r.value_state("v", 10).value("old") is None
    assert r.list_state("l", 10).get("k") == ["new"]
    assert r.map_state("m", 10).items("k") == {"new": 2}
    r.value_state("other").update("z", 1)  # a change, so there is something to materialize
    r.materialize().result(timeout=30)
    ser = d.TaggedSerializer().serialize
    assert raw_keys(r, "v") == {ser("new")}
    sid = r._names["l"]
    assert [len(v) for _kg, _k, v in r._table.items(sid, FULL)] == [1]
    # the TTL came back with the spec: the restored entries still expire on time
    r._ttl_clock = Clock(T0 + 18)
    assert r.value_state("v", 10).value("new") is None
    r.close()


def test_state_ttl_spec_round_trips_and_bad_specs_are_refused():
    spec = [["v", "value"], ["t", "map", {"ttl_ms": 1500}]]
    assert parse_states(spec) == (("v", "value"), ("t", "map", 1500))
    for bad in (["t", "map", {"ttl_ms": 0}], ["t", "map", {"ttl_ms": True}],
                ["t", "map", {"ttl": 5}], ["t", "map", 5], ["t", "map", {}, 1]):
        with pytest.raises(HandleError):
            parse_states([bad])


# ------------------------------------------------------------------ no TTL: same bytes


def test_states_without_ttl_write_the_same_bytes_as_before():
    """Hashes of the changelog records, state spec and materialized file a fixed sequence of
    changes produced before TTL existed (the commit this branch starts from): a state
    without TTL must keep writing exactly those bytes."""
    base = new_base()
    c = d.StateChangelogClient("golden", transport=d.DirectTransport("golden", base))
    b = d.ChangelogKeyedStateBackend(c, "op", FULL, MAXP, materialization_interval=None)
    v, lst, m = b.value_state("v"), b.list_state("l"), b.map_state("m")
    for i in range(20):
        v.update(f"k{i}", {"n": i, "s": "x" * i})
        lst.add(f"k{i % 5}", i)
        m.put(f"k{i % 7}", i, [i, float(i)])
    v.clear("k3")
    lst.update("k1", ["a", "b"])
    m.remove("k2", 2)
    lst.clear("k4")
    snap = b.snapshot(checkpoint_id=1).result(timeout=30)
    recs = []
    for comp in snap.components:
        for kg, rs in component_changes(comp, base, "golden", comp.key_group_range):
            recs += [kg.to_bytes(4, "little") + r for r in rs]
    blob = b"".join(len(r).to_bytes(4, "little") + r for r in recs)
    assert len(recs) == 64
    assert hashlib.sha256(blob).hexdigest() == \
        "69117b671649481ceaf11ddd411f023555fdc4d909e258b6616e58d59b7e1da2"
    assert json.dumps(snap.components[-1].to_dict()["states"]) == \
        '[["v", "value"], ["l", "list"], ["m", "map"]]'
    h = b.materialize(force=True).result(timeout=30)
    data = get_storage(base).read_file(f"{base}/golden/{h.path}")
    assert len(data) == 2169
    assert hashlib.sha256(data).hexdigest() == \
        "69f52cc8c9ea49ca60a31ef7756bc4346c0b3eae18ee2f08cd32dd974f826ea4"
    b.close()


def test_a_ttl_state_beside_plain_ones_leaves_their_records_unchanged():
    """The same changes to plain states, with and without a TTL state next to them: the
    plain states' records are identical (a TTL only stamps its own state's values)."""
    def records(with_ttl: bool) -> list[bytes]:
        base = new_base()
        b = backend(base, Clock())
        v = b.value_state("v")
        t = b.value_state("t", 5) if with_ttl else b.value_state("t")
        for i in range(10):
            v.update(f"k{i}", i)
            t.update(f"k{i}", i)
        snap = b.snapshot(checkpoint_id=1).result(timeout=30)
        b.close()
        out = []
        for comp in snap.components:
            for _kg, rs in component_changes(comp, base, JOB, FULL):
                out += [r for r in rs if r[2] == 0]  # state id 0: "v"
        return sorted(out)

    assert records(True) == records(False) and len(records(False)) == 10


# ------------------------------------------------------------------ the Spark operator's state


def test_a_keys_state_expires_between_micro_batches():
    """KeyedStatefulOperator(state_ttl=...) hands its tasks the TTLs; the update function's
    KeyedState applies them. Batch 1 writes key a; by batch 2 (31 s later, TTL 30 s) it is
    gone, while key b, written again in between, lives on; after a restore (a task retry)
    the expired key stays gone."""
    base, clock = new_base(), Clock()
    ttl = dict(ttl_spec({"last": 30, "seen": 30}))

    def update(bk: d.ChangelogKeyedStateBackend, key: str, row: int) -> tuple:
        st = KeyedState(bk, key, ttl)
        prev = st.value("last").get()
        st.value("last").set(row)
        st.list("seen").add(row)
        return prev, st.list("seen").get()

    b = backend(base, clock)
    assert update(b, "a", 1) == (None, [1])
    assert update(b, "b", 1) == (None, [1])
    b.snapshot(checkpoint_id=0).result(timeout=30)
    clock.t = T0 + 20
    assert update(b, "b", 2) == (1, [1, 2])
    snap = b.snapshot(checkpoint_id=1).result(timeout=30)
    clock.t = T0 + 31
    assert update(b, "a", 3) == (None, [3])  # a expired between the batches
    assert update(b, "b", 4) == (2, [2, 4])  # b's first element expired, its value not
    b.close()
    r = restore_from(base, snap, Clock(T0 + 31))  # a retried batch 2 restores checkpoint 1
    assert r.dump() == {"last": {"b": 2}, "seen": {"b": [2]}}
    r.close()


def test_a_longer_ttl_given_after_a_restore_keeps_entries_the_old_one_expired():
    """The TTL of this run counts, not the checkpoint's: restored 20 s after a write with
    ttl 10, an entry read with ttl 100 is live, also after a materialization. (Purging at
    restore with the checkpoint's TTL dropped it.)"""
    base, clock = new_base(), Clock()
    b = backend(base, clock)
    b.value_state("v", 10).update("a", 1)
    snap = b.snapshot(checkpoint_id=1).result(timeout=30)
    b.close()
    r = restore_from(base, snap, Clock(T0 + 20))
    v = r.value_state("v", 100)
    assert v.value("a") == 1
    r.materialize().result(timeout=30)
    assert v.value("a") == 1
    r.close()


def test_a_purge_never_changes_what_a_reader_holds(state_backend):
    """(heap: the rocksdb table's reads return copies.) The task thread reads without the backend's lock while a materialization purges:
    a list or map it iterates is never shortened under it (a list shortened in place
    made a read skip live elements; a map shrunk in place raised)."""
    if state_backend != "heap":
        pytest.skip("heap only: the rocksdb table's reads return copies")
    base, clock = new_base(), Clock()
    b = backend(base, clock)
    lst, m = b.list_state("l", 10), b.map_state("m", 10)
    lst.add("k", "old")
    m.put("k", "old", 1)
    clock.t = T0 + 5
    lst.add("k", "e1")
    lst.add("k", "e2")
    m.put("k", "new", 2)
    sl, sm = b._names["l"], b._names["m"]
    tables = b._table._tables
    held_list = next(iter(tables[sl].values()))[next(iter(next(iter(tables[sl].values()))))]
    held_map = next(iter(tables[sm].values()))[next(iter(next(iter(tables[sm].values()))))]
    held_list_items, held_map_items = list(held_list), dict(held_map)
    clock.t = T0 + 12  # "old" expired
    b.materialize().result(timeout=30)
    assert list(held_list) == held_list_items and dict(held_map) == held_map_items
    assert lst.get("k") == ["e1", "e2"] and m.items("k") == {"new": 2}
    b.close()


def test_a_ttl_too_large_for_the_metadata_is_refused():
    """ttl_ms is stored as a signed 64-bit number: a larger one made checkpoints that
    could not be restored."""
    with pytest.raises(StateError, match="64-bit"):
        d.StateTtlConfig(1e17)
    assert d.StateTtlConfig(9e15).ttl_ms < (1 << 63)


@pytest.mark.parametrize("part", ["materialized", "changelog"])
def test_values_without_the_stamps_their_spec_promises_fail_the_restore(part):
    """A forged or corrupt spec says "TTL" for values written without stamps: the restore
    fails with a RestoreError naming the file, not a read later (a struct error)."""
    import dataclasses

    base, clock = new_base(), Clock()
    b = d.ChangelogKeyedStateBackend(client(JOB, base), "op", FULL, MAXP,
                                     materialization_interval=None, ttl_clock=clock)
    b.value_state("v").update("k", "x")  # 2 serialized bytes, no stamp
    if part == "materialized":
        b.materialize(force=True).result(timeout=30)
    snap = b.snapshot(checkpoint_id=1).result(timeout=30)
    b.close()
    comp = snap.components[0]
    forged = dataclasses.replace(comp, states=(("v", "value", 10_000),))
    bad = dataclasses.replace(snap, components=(forged,))
    with pytest.raises(d.RestoreError, match="timestamp") as ei:
        restore_from(base, bad, clock)
    assert ei.value.path and ei.value.path.startswith(f"{base}/{JOB}/")
