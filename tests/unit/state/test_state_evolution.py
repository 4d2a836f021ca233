"""Typed state on a real backend, across restores (dstl_ray.state.evolution), on both state
tables: a typed state's values round-trip and its schema is in every snapshot's spec; a
restore that declares a compatible new type reads the old values in the new shape, and its
next snapshot starts from a materialization taken after the migration (no checkpoint mixes
encodings); an incompatible change fails naming the state and both schemas; an untyped state
gains a type when every value converts; a dropped state is gone, and stays gone, from
snapshots, restores and readers; an undeclared typed state keeps its type."""

from __future__ import annotations

import datetime as dt
import decimal

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.reader import StateInfo
from dstl_ray.errors import SchemaError
from dstl_ray.format.materialized import DROPPED, spec_dropped, spec_schema
from dstl_ray.state.snapshot import ChangelogComponent, KeyedStateSnapshot

from ..ckpt_util import MAXP, client, new_base

JOB = "typed"
FULL = d.KeyGroupRange(0, MAXP - 1)
SESSION = "struct<start: timestamp, n: int, total: decimal(10,2)>"
T = dt.datetime(2026, 11, 26, 7, 0, tzinfo=dt.UTC)


@pytest.fixture(params=["heap", "rocksdb"])
def table(request, tmp_path):
    return request.param, str(tmp_path)


def backend(table, base: str, restore=()) -> d.ChangelogKeyedStateBackend:
    return d.ChangelogKeyedStateBackend(client(JOB, base), "op", FULL, MAXP,
                                        materialization_interval=None, restore=restore,
                                        state_backend=table[0], local_dir=table[1])


def snapshot_of(b: d.ChangelogKeyedStateBackend) -> KeyedStateSnapshot:
    return b.snapshot(checkpoint_id=-1).result(timeout=30)


def restored(table, base: str, snap: KeyedStateSnapshot) -> d.ChangelogKeyedStateBackend:
    return backend(table, base, [d.RestoreSource(snap, base, JOB, "test")])


def specs(snap: KeyedStateSnapshot) -> list[tuple]:
    return [s for c in snap.components for s in c.states]


def first_run(table, base: str) -> KeyedStateSnapshot:
    """Typed value, list and map states, partly materialized, partly in the changelog."""
    b = backend(table, base)
    try:
        v = b.value_state("session", schema=SESSION)
        v.update("u1", {"start": T, "n": 2, "total": decimal.Decimal("3.50")})
        b.list_state("days", schema="date").add("u1", dt.date(2026, 11, 25))
        b.materialize_now()
        v.update("u2", {"start": T, "n": 1, "total": 7})
        b.map_state("amounts", schema="double").put("u2", "eur", 1.25)
        b.value_state("plain").update("u1", "untyped")
        snap = snapshot_of(b)
    finally:
        b.close()
    return snap


def test_typed_values_round_trip_and_the_schema_is_in_every_snapshot(table):
    base = new_base()
    snap = first_run(table, base)
    by_name = {s[0]: s for s in specs(snap)}
    assert spec_schema(by_name["session"]) == \
        "struct<start:timestamp,n:int,total:decimal(10,2)>"
    assert spec_schema(by_name["days"]) == "date" and spec_schema(by_name["plain"]) is None
    b = restored(table, base, snap)
    try:
        got = b.dump()
        assert got["session"] == {
            "u1": {"start": T, "n": 2, "total": decimal.Decimal("3.50")},
            "u2": {"start": T, "n": 1, "total": decimal.Decimal("7.00")}}
        assert got["days"] == {"u1": [dt.date(2026, 11, 25)]}
        assert got["amounts"] == {"u2": {"eur": 1.25}} and got["plain"] == {"u1": "untyped"}
        # undeclared in this run: the state keeps its type (never silently untyped)
        assert b.value_state("session").value("u1")["n"] == 2
    finally:
        b.close()


def test_a_compatible_change_reads_old_values_in_the_new_shape_and_materializes_first(table):
    base = new_base()
    snap = first_run(table, base)
    new = "struct<start: timestamp, n: bigint, tag: string>"  # widened, added, removed
    b = restored(table, base, snap)
    try:
        b.schemas.declare({"session": new, "amounts": "double"})
        v = b.value_state("session")
        assert v.value("u1") == {"start": T, "n": 2, "tag": None}
        v.update("u3", {"start": T, "n": 2**40, "tag": "new"})
        snap2 = snapshot_of(b)
    finally:
        b.close()
    # the snapshot's base is a new materialization, taken after the migration, in the new
    # schema (the changelog before it held the old encoding)
    mats = [c for c in snap2.components if not isinstance(c, ChangelogComponent)]
    before = {getattr(c, "path", None) or id(c) for c in snap.components}
    assert mats and all(getattr(c, "path", None) not in before for c in mats)
    for s in specs(snap2):
        if s[0] == "session":
            assert spec_schema(s) == "struct<start:timestamp,n:bigint,tag:string>"
    b = restored(table, base, snap2)
    try:
        assert b.dump()["session"] == {"u1": {"start": T, "n": 2, "tag": None},
                                       "u2": {"start": T, "n": 1, "tag": None},
                                       "u3": {"start": T, "n": 2**40, "tag": "new"}}
    finally:
        b.close()


def test_the_snapshot_after_a_migration_names_no_changelog_written_before_it(table):
    base = new_base()
    b = backend(table, base)
    try:
        v = b.value_state("n", schema="int")
        for i in range(20):
            v.update(f"k{i}", i)  # in the changelog only (no materialization)
        snap = snapshot_of(b)
    finally:
        b.close()
    assert all(isinstance(c, ChangelogComponent) for c in snap.components)
    b = restored(table, base, snap)
    try:
        b.schemas.declare({"n": "bigint"})
        snap2 = snapshot_of(b)
        mats = [c for c in snap2.components if not isinstance(c, ChangelogComponent)]
        logs = [c for c in snap2.components if isinstance(c, ChangelogComponent)]
        assert mats and all(spec_schema(s) == "bigint" for c in mats for s in c.states)
        assert not logs  # nothing changed since the migration's materialization
    finally:
        b.close()
    b = restored(table, base, snap2)
    try:
        assert b.dump()["n"] == {f"k{i}": i for i in range(20)}
    finally:
        b.close()


@pytest.mark.parametrize(("new", "why"), [
    ("struct<start: timestamp, n: smallint, total: decimal(10,2)>", "n narrows int to smallint"),
    ("struct<start: timestamp, n: int, total: decimal(10,2), id: string not null>",
     "field id is added NOT NULL"),
    ("string", "changes struct<"),
])
def test_an_incompatible_change_fails_naming_the_state_and_both_schemas(table, new, why):
    base = new_base()
    snap = first_run(table, base)
    b = restored(table, base, snap)
    try:
        with pytest.raises(SchemaError) as e:
            b.schemas.declare({"session": new})
        msg = str(e.value)
        assert "'session'" in msg and "struct<start:timestamp,n:int,total:decimal(10,2)>" in msg
        assert why in msg
        # nothing changed: the stored values still read with their own type
        assert b.value_state("session").value("u1")["n"] == 2
    finally:
        b.close()


def test_an_untyped_state_gains_a_type_when_every_value_converts(table):
    base = new_base()
    b = backend(table, base)
    try:
        b.value_state("count").update("a", 3)
        b.value_state("count").update("b", 4)
        b.value_state("bad").update("a", 1)
        b.value_state("bad").update("b", "two")
        snap = snapshot_of(b)
    finally:
        b.close()
    b = restored(table, base, snap)
    try:
        b.schemas.declare({"count": "bigint"})
        assert b.value_state("count").value("a") == 3
        with pytest.raises(SchemaError, match="'bad'.*untyped to bigint"):
            b.schemas.declare({"bad": "bigint"})
        assert b.value_state("bad").value("b") == "two"  # checked before anything changed
        snap2 = snapshot_of(b)
    finally:
        b.close()
    assert {s[0]: spec_schema(s) for s in specs(snap2)}["count"] == "bigint"


def test_a_typed_ttl_state_keeps_its_stamps_through_a_migration(table):
    base = new_base()
    clock = [1_700_000_000.0]
    b = d.ChangelogKeyedStateBackend(client(JOB, base), "op", FULL, MAXP,
                                     materialization_interval=None, ttl_clock=lambda: clock[0],
                                     state_backend=table[0], local_dir=table[1])
    try:
        b.value_state("t", ttl=10, schema="int").update("a", 1)
        snap = snapshot_of(b)
    finally:
        b.close()
    clock[0] += 5
    b = d.ChangelogKeyedStateBackend(client(JOB, base), "op", FULL, MAXP,
                                     materialization_interval=None, ttl_clock=lambda: clock[0],
                                     restore=[d.RestoreSource(snap, base, JOB, "t")],
                                     state_backend=table[0], local_dir=table[1])
    try:
        t = b.value_state("t", ttl=10, schema="bigint")
        assert t.value("a") == 1
        snap2 = snapshot_of(b)  # after the migration's materialization
    finally:
        b.close()
    b = d.ChangelogKeyedStateBackend(client(JOB, base), "op", FULL, MAXP,
                                     materialization_interval=None, ttl_clock=lambda: clock[0],
                                     restore=[d.RestoreSource(snap2, base, JOB, "t")],
                                     state_backend=table[0], local_dir=table[1])
    try:
        t = b.value_state("t", ttl=10, schema="bigint")
        assert t.value("a") == 1
        clock[0] += 6  # 11 s after the write: expired (the migration kept the stamp)
        assert t.value("a") is None
    finally:
        b.close()


def test_a_dropped_state_is_gone_from_snapshots_restores_and_readers(table):
    base = new_base()
    snap = first_run(table, base)
    b = restored(table, base, snap)
    try:
        assert b.schemas.drop("amounts") and not b.schemas.drop("never-was")
        snap2 = snapshot_of(b)
    finally:
        b.close()
    dropped = [s for s in specs(snap2) if spec_dropped(s)]
    assert {s[0] for s in dropped} == {"amounts", "never-was"}  # (each drop recorded)
    assert all(s[3] == DROPPED for s in dropped)
    b = restored(table, base, snap2)
    try:
        got = b.dump()
        assert "amounts" not in got and got["session"]["u1"]["n"] == 2
        # a state of that name later is a new, empty state
        assert b.map_state("amounts").items("u2") == {}
        b.map_state("amounts").put("u9", "usd", 2.0)
        snap3 = snapshot_of(b)
    finally:
        b.close()
    b = restored(table, base, snap3)
    try:
        assert b.dump()["amounts"] == {"u9": {"usd": 2.0}}
    finally:
        b.close()


def test_readers_use_the_schema_of_the_checkpoint(table, tmp_path):
    base = f"file://{tmp_path}/dfs"
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=2)
    c = client(JOB, base)
    (b,) = coord.restore(c, "op", 1, materialization_interval=None, state_backend=table[0],
                         local_dir=table[1])
    b.value_state("session", schema=SESSION).update(
        "u1", {"start": T, "n": 2, "total": decimal.Decimal("1.10")})
    cc = coord.trigger_checkpoint().result(timeout=30)
    b.value_state("session", schema=SESSION).update(
        "u1", {"start": T, "n": 3, "total": decimal.Decimal("2.20")})
    cc2 = coord.trigger_checkpoint().result(timeout=30)
    coord.shutdown()
    from dstl_ray.checkpoint.change_feed import read_change_feed
    from dstl_ray.checkpoint.reader import operator_states, read_state
    from dstl_ray.checkpoint.recovery import load_checkpoint

    assert read_state(cc2.metadata_url, "session") == {
        "u1": {"start": T, "n": 3, "total": decimal.Decimal("2.20")}}
    info = operator_states(load_checkpoint(cc2.metadata_url), "op")["session"]
    assert info == StateInfo("session", info.kind, None,
                             "struct<start:timestamp,n:int,total:decimal(10,2)>")
    feed = list(read_change_feed(cc.metadata_url, cc2.metadata_url, "session", "op", 1, 0))
    assert [(x.key, x.value["n"]) for x in feed] == [("u1", 3)]


def test_a_drop_happens_once_per_lineage_and_a_handle_after_it_fails(table):
    """drop(once=True), as the operator's restores call it: a checkpoint that records the
    drop keeps a state of that name created since (a task retry, a restart with the same
    drop_state); a drop of a name no state has is recorded too; a handle taken before a
    drop fails instead of writing into the dropped state's place."""
    base = new_base()
    b = backend(table, base)
    try:
        old = b.value_state("x")
        old.update("k", 1)
        assert b.schemas.drop("x", once=True)
        with pytest.raises(d.StateError, match="'x' was dropped"):
            old.update("k", 2)
        b.value_state("x").update("k", 3)  # a new "x", created after the drop
        assert not b.schemas.drop("never", once=True)  # recorded all the same
        snap = snapshot_of(b)
    finally:
        b.close()
    assert {s[0] for s in specs(snap) if spec_dropped(s)} == {"x", "never"}
    b = restored(table, base, snap)
    try:
        assert not b.schemas.drop("x", once=True)  # this lineage dropped it already
        assert not b.schemas.drop("never", once=True)
        assert b.dump()["x"] == {"k": 3}
        assert b.schemas.drop("x")  # without once: dropped again
        assert "x" not in b.dump()
    finally:
        b.close()


def test_the_snapshot_waits_for_a_materialization_that_started_after_a_migration(table):
    """A materialization in flight when a state is retyped holds the old encoding: the
    snapshot waits for it, then for one of its own, whose spec has the new type."""
    import concurrent.futures
    import threading

    gate = threading.Event()

    class Gated(concurrent.futures.ThreadPoolExecutor):
        def submit(self, fn, *a, **kw):
            def held():
                gate.wait(30)
                return fn(*a, **kw)
            return super().submit(held)

    base = new_base()
    pool = Gated(max_workers=2)
    b = d.ChangelogKeyedStateBackend(client(JOB, base), "op", FULL, MAXP,
                                     materialization_interval=None, executor=pool,
                                     state_backend=table[0], local_dir=table[1])
    try:
        b.value_state("n", schema="int").update("a", 1)
        first = b.materialize(force=True)  # held at the gate, with "n" as int
        b.schemas.declare({"n": "bigint"})
        out = concurrent.futures.ThreadPoolExecutor(1).submit(snapshot_of, b)
        assert not out.done()
        gate.set()
        first.result(timeout=30)
        snap = out.result(timeout=30)
        mats = [c for c in snap.components if not isinstance(c, ChangelogComponent)]
        assert [spec_schema(s) for c in mats for s in c.states] == ["bigint"]
    finally:
        gate.set()
        b.close()
        pool.shutdown()
    b = restored(table, base, snap)
    try:
        assert b.dump()["n"] == {"a": 1}
    finally:
        b.close()


def test_a_columnar_update_that_fails_midway_logs_what_the_table_took(table):
    """``update_at`` logs its changes a chunk at a time: a value that cannot be encoded fails
    the call, and what the table took before it is in the changelog too (a restore of the
    next snapshot holds exactly the backend's state)."""
    base = new_base()
    b = backend(table, base)
    try:
        n = b.value_state("n", schema="bigint")
        keys = [f"k{i}" for i in range(10)]
        with pytest.raises(d.DstlError):
            n.update_at(n.refs(keys), [1, 2, 3, "three", 5, 6, 7, 8, 9, 10])
        want = {k: v for k, v in b.dump()["n"].items()}
        assert want == {"k0": 1, "k1": 2, "k2": 3}
        snap = snapshot_of(b)
    finally:
        b.close()
    again = restored(table, base, snap)
    try:
        assert again.dump()["n"] == want
    finally:
        again.close()


def test_a_columnar_update_the_changelog_refuses_leaves_the_table_untouched(table):
    """A ref outside the backend's key groups fails the call before any of its chunk
    reaches the table: the table never holds a change the changelog does not."""
    base = new_base()
    b = d.ChangelogKeyedStateBackend(client(JOB, base), "op", d.KeyGroupRange(0, 7), MAXP,
                                     materialization_interval=None, state_backend=table[0],
                                     local_dir=table[1])
    try:
        n = b.value_state("n")
        keys = [k for k in (f"k{i}" for i in range(200))
                if d.assign_key_group(k, MAXP) <= 7][:3]
        with pytest.raises(d.KeyGroupError):
            n.update_at([*n.refs(keys), (15, b"bogus")], [1, 2, 3, 4])
        assert b.dump().get("n", {}) == {}
        n.update_at(n.refs(keys), [1, 2, 3])
        assert b.dump()["n"] == dict(zip(keys, [1, 2, 3], strict=True))
    finally:
        b.close()


def test_refs_of_a_column_are_the_refs_of_each_key_and_refuse_a_foreign_key(table):
    """``refs`` encodes an int or str key once (its hash input is its encoding): the refs
    equal ``ref`` of each key, for every kind of key, and a key outside the backend's key
    groups fails naming it."""
    b = d.ChangelogKeyedStateBackend(client(JOB, new_base()), "op", d.KeyGroupRange(0, 7),
                                     MAXP, materialization_interval=None,
                                     state_backend=table[0], local_dir=table[1])
    try:
        n = b.value_state("n")
        pool = [*range(300), *(f"k{i}" for i in range(300)), b"raw", True, (1, "a"), 2.5]
        mine = [k for k in pool if d.assign_key_group(k, MAXP) <= 7]
        assert {type(k) for k in mine} >= {int, str}
        assert n.refs(mine) == [n.ref(k) for k in mine]
        foreign = next(k for k in range(300) if d.assign_key_group(k, MAXP) > 7)
        with pytest.raises(d.KeyGroupError, match=f"key {foreign} "):
            n.refs([*mine, foreign])
    finally:
        b.close()
