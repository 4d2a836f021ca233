"""The state-table contract (dstl_ray.state.table) on both tables, ``heap`` and ``rocksdb``:
value, list and map state with the same semantics (clearing, an empty list and a map's last
removal leave the key absent), key-group range iteration, views that later changes do not
reach, replay of change records; a hypothesis model test against a dict. RocksDB only: keys
carry their key group as a big-endian prefix, so a key-group range is one contiguous range;
the working directory goes on close; disk errors are LocalStateError."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rocksdict import Options, Rdict

import dstl_ray as d
from dstl_ray.errors import LocalStateError, StateError
from dstl_ray.keygroups import KeyGroupRange
from dstl_ray.state import rocksdb_local
from dstl_ray.state.heap import HeapStateTable
from dstl_ray.state.records import Op, StateKind, encode, join_items
from dstl_ray.state.rocksdb import RocksDBStateTable
from dstl_ray.state.rocksdb_keys import key_group_bounds
from dstl_ray.state.table import StateTable

from ..ckpt_util import MAXP, client, workdirs

KGS = KeyGroupRange(0, 7)
VALUE, LIST, MAP = 0, 1, 2
KINDS = (StateKind.VALUE, StateKind.LIST, StateKind.MAP)


def make(name: str, local_dir: str) -> StateTable:
    t: StateTable = (RocksDBStateTable(KGS, local_dir) if name == "rocksdb"
                     else HeapStateTable())
    for k in KINDS:
        t.add_state(k)
    return t


@pytest.fixture(params=["heap", "rocksdb"])
def table(request, tmp_path) -> Iterator[StateTable]:
    t = make(request.param, str(tmp_path))
    yield t
    t.close()


def dump(t: StateTable, sid: int, kgs=KGS) -> dict[tuple[int, bytes], object]:
    return {(kg, k): v for kg, k, v in t.items(sid, kgs)}


def test_value_state(table):
    assert table.get_value(VALUE, 1, b"k") is None
    table.set_value(VALUE, 1, b"k", b"v1")
    table.set_value(VALUE, 1, b"k", b"v2")
    table.set_value(VALUE, 2, b"k", b"other kg")
    assert table.get_value(VALUE, 1, b"k") == b"v2"
    assert table.get_value(VALUE, 2, b"k") == b"other kg"
    table.clear(VALUE, 1, b"k")
    assert table.get_value(VALUE, 1, b"k") is None
    assert dump(table, VALUE) == {(2, b"k"): b"other kg"}


@given(st.lists(st.tuples(st.integers(0, 7), st.sampled_from([b"a", b"b", b"ab"]),
                         st.one_of(st.none(), st.binary(max_size=3))), max_size=20))
@settings(max_examples=40, deadline=None)
def test_set_values_equals_set_value_and_clear_in_order(tmp_path_factory, entries):
    """A columnar update of a value state (ValueState.update_at) lands as the calls one by
    one would, on both tables: later entries of a key win, None clears."""
    for name in ("heap", "rocksdb"):
        bulk, each = (make(name, str(tmp_path_factory.mktemp(name))) for _ in range(2))
        try:
            bulk.set_values(VALUE, entries)
            for kg, k, v in entries:
                each.clear(VALUE, kg, k) if v is None else each.set_value(VALUE, kg, k, v)
            assert dump(bulk, VALUE) == dump(each, VALUE)
        finally:
            bulk.close()
            each.close()


def test_entries_count_keys_of_values_and_lists_and_entries_of_maps(table):
    assert table.entries() == 0
    table.set_value(VALUE, 1, b"a", b"1")
    table.set_value(VALUE, 2, b"b", b"2")
    table.set_list(LIST, 1, b"a", [b"x", b"y"])  # one list: one entry
    table.put_map_value(MAP, 3, b"m", b"u1", b"1")
    table.put_map_value(MAP, 3, b"m", b"u2", b"2")  # two map entries of one key
    assert table.entries() == 5
    table.clear(VALUE, 2, b"b")
    if isinstance(table, RocksDBStateTable):  # an estimate: a delete counts against two
        assert 3 <= table.entries() <= 5
    else:
        assert table.entries() == 4


def test_list_state(table):
    assert table.get_list(LIST, 0, b"k") == []
    for x in (b"a", b"", b"c"):
        table.add_to_list(LIST, 0, b"k", x)
    assert table.get_list(LIST, 0, b"k") == [b"a", b"", b"c"]
    table.set_list(LIST, 0, b"k", [b"z"])
    assert table.get_list(LIST, 0, b"k") == [b"z"]
    table.set_list(LIST, 0, b"k", [])  # an empty list is no list
    assert table.get_list(LIST, 0, b"k") == []
    assert list(table.keys(LIST)) == []
    table.add_to_list(LIST, 0, b"k", b"again")
    table.clear(LIST, 0, b"k")
    assert dump(table, LIST) == {}


def test_map_state_keys_that_prefix_each_other_stay_apart(table):
    # b"a" + user key b"b" must never be mistaken for key b"ab"
    table.put_map_value(MAP, 3, b"a", b"b", b"1")
    table.put_map_value(MAP, 3, b"ab", b"", b"2")
    table.put_map_value(MAP, 3, b"a", b"", b"3")
    assert table.get_map(MAP, 3, b"a") == {b"b": b"1", b"": b"3"}
    assert table.get_map(MAP, 3, b"ab") == {b"": b"2"}
    assert table.get_map_value(MAP, 3, b"a", b"b") == b"1"
    assert table.get_map_value(MAP, 3, b"a", b"x") is None
    table.remove_map_value(MAP, 3, b"a", b"b")
    table.remove_map_value(MAP, 3, b"a", b"")  # the last entry: the key is gone
    assert table.get_map(MAP, 3, b"a") == {}
    assert sorted(table.keys(MAP)) == [b"ab"]
    table.clear(MAP, 3, b"ab")
    assert dump(table, MAP) == {}


def test_states_do_not_see_each_other(table):
    table.set_value(VALUE, 0, b"k", b"v")
    table.add_to_list(LIST, 0, b"k", b"l")
    table.put_map_value(MAP, 0, b"k", b"u", b"m")
    table.clear(LIST, 0, b"k")
    assert table.get_value(VALUE, 0, b"k") == b"v"
    assert table.get_map(MAP, 0, b"k") == {b"u": b"m"}


def test_items_go_key_group_by_key_group_over_the_range_asked(table):
    for kg in (7, 0, 4, 2):
        table.set_value(VALUE, kg, b"k%d" % kg, b"v")
    got = list(table.items(VALUE, KeyGroupRange(2, 6)))
    assert [(kg, k) for kg, k, _ in got] == [(2, b"k2"), (4, b"k4")]


def test_view_is_not_reached_by_later_changes(table):
    table.set_value(VALUE, 1, b"k", b"old")
    table.add_to_list(LIST, 1, b"k", b"x")
    table.put_map_value(MAP, 1, b"k", b"u", b"old")
    view = table.view()
    table.set_value(VALUE, 1, b"k", b"new")
    table.add_to_list(LIST, 1, b"k", b"y")
    table.put_map_value(MAP, 1, b"k", b"u", b"new")
    table.set_value(VALUE, 5, b"late", b"v")
    assert dict(view[VALUE][1]) == {b"k": b"old"}
    assert dict(view[LIST][1]) == {b"k": [b"x"]}
    assert dict(view[MAP][1]) == {b"k": {b"u": b"old"}}
    assert view[VALUE].get(5) is None and list(view[VALUE]) == [1]


def test_replay_of_records_equals_the_calls(table, tmp_path):
    recs = [encode(Op.VALUE_SET, VALUE, b"k", b"v"),
            encode(Op.LIST_ADD, LIST, b"k", b"a"), encode(Op.LIST_ADD, LIST, b"k", b"b"),
            encode(Op.LIST_SET, LIST, b"j", join_items([b"x", b"y"])),
            encode(Op.LIST_SET, LIST, b"k", join_items([])),
            encode(Op.MAP_PUT, MAP, b"k", b"1", b"u1"), encode(Op.MAP_PUT, MAP, b"k", b"2", b"u2"),
            encode(Op.MAP_REMOVE, MAP, b"k", b"", b"u1"),
            encode(Op.VALUE_SET, VALUE, b"gone", b"v"), encode(Op.VALUE_CLEAR, VALUE, b"gone")]
    table.apply_records(recs, 6, None)
    assert dump(table, VALUE) == {(6, b"k"): b"v"}
    assert dump(table, LIST) == {(6, b"j"): [b"x", b"y"]}
    assert dump(table, MAP) == {(6, b"k"): {b"u2": b"2"}}
    with pytest.raises(d.FormatError, match="unknown state id"):
        table.apply_records([encode(Op.VALUE_SET, 9, b"k", b"v")], 6, None)


# ------------------------------------------------------------------ model test

KEYS = st.sampled_from([b"", b"a", b"ab", b"b", b"\x00", b"\xff\xff"])
VALS = st.binary(max_size=4)
KG = st.integers(KGS.start, KGS.end)
OPS = st.one_of(
    st.tuples(st.just("put"), KG, KEYS, VALS),
    st.tuples(st.just("list_add"), KG, KEYS, VALS),
    st.tuples(st.just("list_set"), KG, KEYS, st.lists(VALS, max_size=3)),
    st.tuples(st.just("map_put"), KG, KEYS, KEYS, VALS),
    st.tuples(st.just("map_remove"), KG, KEYS, KEYS),
    st.tuples(st.just("clear"), st.sampled_from([VALUE, LIST, MAP]), KG, KEYS),
)


def run_model(t: StateTable, ops: list[tuple]) -> list[dict]:
    """Apply ``ops`` to ``t`` and to a dict model, checking every read on the way; returns
    the model: per state {(kg, key): value}."""
    model: list[dict] = [{}, {}, {}]
    for op in ops:
        name, args = op[0], op[1:]
        if name == "put":
            kg, k, v = args
            t.set_value(VALUE, kg, k, v)
            model[VALUE][kg, k] = v
            assert t.get_value(VALUE, kg, k) == v
        elif name == "list_add":
            kg, k, v = args
            t.add_to_list(LIST, kg, k, v)
            model[LIST].setdefault((kg, k), []).append(v)
            assert t.get_list(LIST, kg, k) == model[LIST][kg, k]
        elif name == "list_set":
            kg, k, items = args
            t.set_list(LIST, kg, k, items)
            if items:
                model[LIST][kg, k] = list(items)
            else:
                model[LIST].pop((kg, k), None)
            assert t.get_list(LIST, kg, k) == items
        elif name == "map_put":
            kg, k, uk, v = args
            t.put_map_value(MAP, kg, k, uk, v)
            model[MAP].setdefault((kg, k), {})[uk] = v
            assert t.get_map_value(MAP, kg, k, uk) == v
        elif name == "map_remove":
            kg, k, uk = args
            t.remove_map_value(MAP, kg, k, uk)
            m = model[MAP].get((kg, k))
            if m is not None:
                m.pop(uk, None)
                if not m:
                    del model[MAP][kg, k]
            assert t.get_map_value(MAP, kg, k, uk) is None
            assert t.get_map(MAP, kg, k) == model[MAP].get((kg, k), {})
        else:
            sid, kg, k = args
            t.clear(sid, kg, k)
            model[sid].pop((kg, k), None)
    return model


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(OPS, max_size=40), lo=KG, hi=KG, name=st.sampled_from(["heap", "rocksdb"]))
def test_tables_behave_like_a_dict(tmp_path_factory, ops, lo, hi, name):
    lo, hi = min(lo, hi), max(lo, hi)
    t = make(name, str(tmp_path_factory.getbasetemp()))
    try:
        model = run_model(t, ops)
        view = t.view()
        for sid in (VALUE, LIST, MAP):
            assert dump(t, sid) == model[sid]
            assert sorted(t.keys(sid)) == sorted(k for _, k in model[sid])
            # a key-group range: only its key groups, in order
            got = list(t.items(sid, KeyGroupRange(lo, hi)))
            assert [kg for kg, _, _ in got] == sorted(kg for kg, _, _ in got)
            assert {(kg, k): v for kg, k, v in got} == {
                (kg, k): v for (kg, k), v in model[sid].items() if lo <= kg <= hi}
            assert {(kg, k): v for kg, per in view[sid].items() for k, v in per.items()
                    } == model[sid]
    finally:
        t.close()


# ------------------------------------------------------------------ rocksdb only


def test_rocksdb_key_group_range_is_one_contiguous_range(tmp_path):
    t = make("rocksdb", str(tmp_path))
    try:
        for kg in KGS:
            t.set_value(VALUE, kg, b"k", b"v")
            t.add_to_list(LIST, kg, b"k", b"x")
            t.put_map_value(MAP, kg, b"k", b"u", b"m")
        lower, upper = key_group_bounds(KeyGroupRange(2, 4))
        raw = [k for k, _ in t._db.items() if lower <= k < upper]  # type: ignore[attr-defined]
        assert {int.from_bytes(k[:2], "big") for k in raw} == {2, 3, 4}
        assert len(raw) == 9  # 3 key groups x (value, list, one map entry)
        t._db.delete_range(lower, upper)  # type: ignore[attr-defined]
        assert sorted(kg for kg, _, _ in t.items(MAP, KGS)) == [0, 1, 5, 6, 7]
    finally:
        t.close()


def test_rocksdb_working_directory_goes_on_close_and_use_after_close_fails(tmp_path):
    t = make("rocksdb", str(tmp_path))
    t.set_value(VALUE, 0, b"k", b"v")
    view = t.view()
    path = t.path  # type: ignore[attr-defined]
    assert os.path.isdir(path) and path.startswith(str(tmp_path))
    t.close()
    assert not os.path.exists(path)
    with pytest.raises(LocalStateError, match="closed"):
        t.get_value(VALUE, 0, b"k")
    with pytest.raises(LocalStateError, match="closed"):
        dict(view[VALUE])
    t.close()  # twice is fine


def test_rocksdb_disk_errors_are_state_errors(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(LocalStateError, match="creating a working directory") as e:
        RocksDBStateTable(KGS, str(not_a_dir))
    assert isinstance(e.value, StateError) and str(not_a_dir) in str(e.value)
    # RocksDB's own error: the database is locked by another open table
    t = RocksDBStateTable(KGS, str(tmp_path))
    try:
        with pytest.raises(LocalStateError, match="opening") as e, \
                rocksdb_local.Io(t.path, "opening"):
            Rdict(f"{t.path}/db", Options(raw_mode=True))
        assert t.path in str(e.value)
    finally:
        t.close()
    assert os.listdir(tmp_path) == ["file"]  # nothing left behind


# ------------------------------------------------------------------ the backend


def backend(base: str, tmp_path, state_backend: str, **kw) -> d.ChangelogKeyedStateBackend:
    return d.ChangelogKeyedStateBackend(client("tables", base), "op",
                                        d.KeyGroupRange(0, MAXP - 1), MAXP,
                                        materialization_interval=None,
                                        state_backend=state_backend,
                                        local_dir=str(tmp_path / "local"), **kw)


def fill(b: d.ChangelogKeyedStateBackend, n: int, offset: int = 0) -> None:
    v, lst, m = b.value_state("v"), b.list_state("l"), b.map_state("m")
    for i in range(n):
        v.update(f"k{i}", i + offset)
        lst.add(f"k{i % 7}", i)
        m.put(f"k{i % 5}", i % 3, [i, "x"])
        if i % 11 == 0:
            m.remove(f"k{i % 5}", 0)
            v.clear(f"k{i // 2}")


def test_backend_on_rocksdb_equals_heap_through_materialization_and_restore(tmp_path):
    (tmp_path / "local").mkdir()
    base = f"file://{tmp_path}/dfs"
    dumps, snaps = {}, {}
    for name in ("heap", "rocksdb"):
        b = backend(base, tmp_path, name)
        fill(b, 200)
        b.materialize(force=True).result(timeout=30)
        fill(b, 50, offset=1000)  # changelog after the materialization
        assert b.value_state("v").value("k3") == 1003
        assert b.list_state("l").get("k0")[:2] == [0, 7]
        assert sorted(b.value_state("v").keys()) == sorted(b.dump()["v"])
        dumps[name], snaps[name] = b.dump(), b.snapshot().result(timeout=30)
        b.close()
    assert dumps["rocksdb"] == dumps["heap"]
    assert workdirs(tmp_path / "local") == []  # the working directory went on close
    # each snapshot restores on either table (the files do not know the table)
    for src_name, snap in snaps.items():
        for name in ("heap", "rocksdb"):
            src = d.RestoreSource(snap, base, "tables", f"test-{src_name}")
            r = backend(base, tmp_path, name, restore=[src])
            assert r.dump() == dumps["heap"], (src_name, name)
            r.close()
    assert workdirs(tmp_path / "local") == []


@pytest.mark.parametrize("name", ["heap", "rocksdb"])
def test_a_materialization_that_fails_to_start_does_not_block_later_ones(tmp_path, name,
                                                                         monkeypatch):
    """A copy (heap) or a submit that raises left a future that never ended, and every later
    materialization returned None."""
    (tmp_path / "local").mkdir()
    b = backend(f"file://{tmp_path}/dfs", tmp_path, name)
    fill(b, 20)
    calls = []

    def boom(*a, **k):
        calls.append(1)
        raise MemoryError("injected: the copy does not fit")

    with monkeypatch.context() as m:
        if name == "heap":
            m.setattr(HeapStateTable, "materialization_source", boom)
        else:
            m.setattr(b, "_pool", type("P", (), {"submit": staticmethod(boom)})())
        with pytest.raises(MemoryError):
            b.materialize(force=True)
    assert calls
    f = b.materialize(force=True)
    assert f is not None and f.result(timeout=30) is not None
    b.close()


def test_backend_refuses_an_unknown_state_backend(tmp_path):
    with pytest.raises(StateError, match="state_backend must be one of heap, rocksdb"):
        backend(f"file://{tmp_path}/dfs", tmp_path, "lmdb")



RECORDS = st.one_of(
    st.tuples(st.just(Op.VALUE_SET), st.just(VALUE), KEYS, VALS),
    st.tuples(st.just(Op.VALUE_CLEAR), st.just(VALUE), KEYS, st.just(b"")),
    st.tuples(st.just(Op.LIST_ADD), st.just(LIST), KEYS, VALS),
    st.tuples(st.just(Op.LIST_SET), st.just(LIST), KEYS,
              st.lists(VALS, max_size=3).map(join_items)),
    st.tuples(st.just(Op.LIST_CLEAR), st.just(LIST), KEYS, st.just(b"")),
    st.tuples(st.just(Op.MAP_PUT), st.just(MAP), KEYS, VALS),
    st.tuples(st.just(Op.MAP_REMOVE), st.just(MAP), KEYS, st.just(b"")),
    st.tuples(st.just(Op.MAP_CLEAR), st.just(MAP), KEYS, st.just(b"")),
)


@settings(max_examples=60, deadline=None)
@given(recs=st.lists(st.tuples(RECORDS, KEYS), max_size=40), kg=KG)
def test_replayed_records_give_the_same_state_on_both_tables(tmp_path_factory, recs, kg):
    """The rocksdb table's batched replay (value sets inline, the rest through
    decode_record) against the heap's, with the writer's state ids mapped (the log wrote
    VALUE, LIST, MAP as ids 2, 0, 1)."""
    sid_map = [LIST, MAP, VALUE]  # record id -> local id
    to_record = {VALUE: 2, LIST: 0, MAP: 1}
    encoded = []
    for (op, sid, key, payload), ukey in recs:
        rsid = to_record[sid]
        if op in (Op.MAP_PUT, Op.MAP_REMOVE):
            encoded.append(encode(op, rsid, key, payload, ukey))
        else:
            encoded.append(encode(op, rsid, key, payload))
    heap = make("heap", "")
    rdb = make("rocksdb", str(tmp_path_factory.mktemp("replay")))
    try:
        heap.apply_records(encoded, kg, sid_map)
        rdb.apply_records(encoded, kg, sid_map)
        for sid in (VALUE, LIST, MAP):
            assert dump(rdb, sid) == dump(heap, sid)
        for (_op, _sid, key, _payload), ukey in recs:  # and point reads find them
            assert rdb.get_value(VALUE, kg, key) == heap.get_value(VALUE, kg, key)
            assert rdb.get_list(LIST, kg, key) == heap.get_list(LIST, kg, key)
            assert rdb.get_map(MAP, kg, key) == heap.get_map(MAP, kg, key)
            assert (rdb.get_map_value(MAP, kg, key, ukey)
                    == heap.get_map_value(MAP, kg, key, ukey))
    finally:
        rdb.close()
