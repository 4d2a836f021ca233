"""Timers per key (spark_glue.timers) on a real backend, without Spark: they fire earliest
first across both domains, once, and only when due; timers registered while timers fire fire
in the same pass when due; deletion works; they are keyed state, so they survive a snapshot
and restore (fired ones do not come back) and split with their key groups on a rescale; the
watermark is the largest event time seen minus the allowed delay, and never goes back."""

from __future__ import annotations

import datetime as dt
import os

import pyarrow as pa
import pytest

import dstl_ray as d
from dstl_ray.errors import ConfigError, StateError
from dstl_ray.keygroups import key_group_range_for_subtask
from spark_glue.routing import group_by_key
from spark_glue.timers import (
    EVENT,
    PROCESSING,
    TIMERS_STATE,
    Timer,
    TimerContext,
    TimerService,
    max_event_time_ms,
)
from spark_glue.views import KeyedState
from spark_glue.worker import TaskSpec, _Entry, fire_timers, timer_context

from ..ckpt_util import MAXP, client, new_base

FULL = d.KeyGroupRange(0, MAXP - 1)


def backend(base: str, kgr: d.KeyGroupRange = FULL, restore=(), kind: str = "heap",
            local_dir: str | None = None) -> d.ChangelogKeyedStateBackend:
    return d.ChangelogKeyedStateBackend(client("timers", base), "op", kgr, MAXP,
                                        materialization_interval=None, restore=restore,
                                        state_backend=kind, local_dir=local_dir)


@pytest.fixture(params=["heap", "rocksdb"])
def kind(request) -> str:
    """The state backend, and with it the timer index: a heap, or a local RocksDB."""
    return request.param


@pytest.fixture
def service(kind, tmp_path):
    """Makes TimerServices of ``kind``; each is closed (its index) after the test."""
    made = []

    def make(b: d.ChangelogKeyedStateBackend) -> TimerService:
        s = TimerService(b, kind, str(tmp_path / "local"))
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def fired(service: TimerService, watermark: int | None, now: int) -> list[tuple]:
    return [(t.time_ms, t.domain, t.key) for t in service.due(watermark, now)]


def test_timers_fire_once_earliest_first_across_domains_and_only_when_due(kind, service):
    b = backend(new_base(), kind=kind)
    try:
        s = service(b)
        s.register("a", EVENT, 30)
        s.register("b", PROCESSING, 20)
        s.register("a", EVENT, 10)
        s.register("a", EVENT, 10)  # the same timer twice is one timer
        s.register("c", EVENT, 50)
        s.register("c", PROCESSING, 99)
        s.delete("c", EVENT, 50)
        assert s.of("a") == [(EVENT, 10), (EVENT, 30)]
        assert fired(s, None, 25) == [(20, PROCESSING, "b")]  # no watermark: no event timers
        assert fired(s, 30, 25) == [(10, EVENT, "a"), (30, EVENT, "a")]
        assert fired(s, 100, 25) == []  # c's event timer was deleted; its processing one waits
        s.register("c", EVENT, 50)  # registered again after a delete: one timer again
        assert fired(s, 100, 100) == [(50, EVENT, "c"), (99, PROCESSING, "c")]
        assert fired(s, 10**9, 10**9) == [] and b.dump().get(TIMERS_STATE, {}) == {}
        # the counters behind a batch's metrics: timers new to the service, timers fired
        assert (s.registered, s.fired) == (6, 5)
    finally:
        b.close()


def test_a_timer_registered_while_timers_fire_fires_in_the_same_pass_when_due(kind, service):
    b = backend(new_base(), kind=kind)
    try:
        s = service(b)
        s.register("k", EVENT, 1)
        seen = []
        for t in s.due(10, 0):
            seen.append(t)
            if t.time_ms < 11:
                s.register(t.key, EVENT, t.time_ms + 3)  # 4, 7, then 10 (due), then 13 (not)
        assert [t.time_ms for t in seen] == [1, 4, 7, 10]
        assert s.of("k") == [(EVENT, 13)]
    finally:
        b.close()


def test_timers_survive_restore_and_split_with_their_key_groups(kind, service):
    base = new_base()
    b = backend(base, kind=kind)
    try:
        s = service(b)
        keys = [f"k{i}" for i in range(40)]
        for i, k in enumerate(keys):
            s.register(k, EVENT, 100 + i)
        assert len(fired(s, 104, 0)) == 5  # k0..k4 fire before the checkpoint
        snap = b.snapshot(checkpoint_id=1).result(timeout=30)
    finally:
        b.close()
    src = d.RestoreSource(snap, base, "timers", "test")
    # rescale 1 -> 2: each new subtask gets exactly its key groups' timers
    halves = [key_group_range_for_subtask(MAXP, 2, i) for i in range(2)]
    got = []
    for kgr in halves:
        nb = backend(base, kgr, [src], kind=kind)
        try:
            ns = service(nb)
            for t in ns.due(10**6, 0):
                assert d.assign_key_group(t.key, MAXP) in kgr
                got.append(t.key)
        finally:
            nb.close()
    assert sorted(got) == sorted(keys[5:])  # fired ones did not come back


def test_max_event_time_of_timestamps_and_integers():
    when = dt.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=dt.UTC)
    ms = int(when.timestamp() * 1000)
    for unit in ("s", "ms", "us", "ns"):
        t = pa.table({"ts": pa.array([when, None], pa.timestamp(unit, tz="UTC"))})
        want = ms // 1000 * 1000 if unit == "s" else ms
        assert max_event_time_ms(t, "ts") == want
    assert max_event_time_ms(pa.table({"ts": [5, 9, None]}), "ts") == 9
    assert max_event_time_ms(pa.table({"ts": pa.array([None], pa.int64())}), "ts") is None
    assert max_event_time_ms(None, "ts") is None
    with pytest.raises(StateError, match="not in the micro-batch's columns"):
        max_event_time_ms(pa.table({"x": [1]}), "ts")
    with pytest.raises(StateError, match="timestamp or integer ms"):
        max_event_time_ms(pa.table({"ts": ["a"]}), "ts")


def spec(**kw) -> TaskSpec:
    return TaskSpec("timers", "op", "ns", "", 1, MAXP, None, lambda *a: None, 3, "e", 2, None,
                    key="user", **kw)


def test_the_watermark_is_the_largest_event_time_seen_minus_the_delay():
    b = backend(new_base())
    try:
        entry = _Entry(b, "e", None)
        rows = group_by_key(pa.table({"user": ["a", "b"], "ts": [1_000, 5_000]}), "user")
        ctx, seen = timer_context(spec(on_timer=print, event_time="ts", allowed_delay_ms=2_000,
                                       event_time_ms=3_000), entry, rows)
        assert seen == 5_000 and ctx.watermark_ms == 3_000 and entry.timers is ctx.service
        # an earlier batch's larger event time holds the watermark (it never goes back)
        ctx, seen = timer_context(spec(on_timer=print, event_time="ts", allowed_delay_ms=2_000,
                                       event_time_ms=9_000), entry, rows)
        assert seen == 9_000 and ctx.watermark_ms == 7_000
        ctx, seen = timer_context(spec(event_time="ts"), entry, rows)
        assert ctx is None and seen == 5_000  # no on_timer: no timers, event time still kept
    finally:
        b.close()


def test_on_timer_gets_the_keys_state_and_timers_need_on_timer():
    b = backend(new_base())
    try:
        def on_timer(key, timer, state):
            c = state.value("closed")
            c.set(c.get(0) + 1)
            return [(key, timer.time_ms, timer.domain)]

        ctx = TimerContext(TimerService(b), 50, 0)
        ks = KeyedState(b, "a", {}, ctx)
        ks.timers.register_event_time(40)
        ks.timers.register_event_time(dt.datetime.fromtimestamp(0.045, dt.UTC))
        ks.timers.register_processing_time(60)
        assert ks.timers.list() == [(EVENT, 40), (EVENT, 45), (PROCESSING, 60)]
        assert ks.timers.watermark == 50 and ks.timers.now == 0
        out = fire_timers(spec(on_timer=on_timer), ctx, b, {})
        assert out == [("a", 40, EVENT), ("a", 45, EVENT)]
        assert b.value_state("closed").value("a") == 2
        assert Timer(1, EVENT, "x") < Timer(2, EVENT, "a")
        with pytest.raises(ConfigError, match="need the operator's on_timer"):
            KeyedState(b, "a").timers  # noqa: B018
        with pytest.raises(ConfigError, match="is the operator's timers"):
            KeyedState(b, "a").map(TIMERS_STATE)
        with pytest.raises(StateError, match="ms since the epoch or a datetime"):
            ks.timers.register_event_time("soon")
    finally:
        b.close()


def test_a_snapshots_event_time_round_trips_and_is_checked():
    from dstl_ray.errors import HandleError
    from dstl_ray.state.snapshot import KeyedStateSnapshot

    snap = KeyedStateSnapshot("op", FULL, (), None, 1_700_000_000_123)
    d_ = snap.to_dict()
    assert KeyedStateSnapshot.from_dict(d_, "memory://x").event_time_ms == 1_700_000_000_123
    assert "event_time_ms" not in KeyedStateSnapshot("op", FULL).to_dict()  # unchanged bytes
    with pytest.raises(HandleError, match="event_time_ms must be an integer"):
        KeyedStateSnapshot.from_dict({**d_, "event_time_ms": "soon"}, "memory://x")


def test_deleted_timers_do_not_pile_up_and_a_runaway_loop_is_stopped(kind, service,
                                                                     monkeypatch):
    b = backend(new_base(), kind=kind)
    try:
        s = service(b)
        for i in range(20_000):  # an idle timeout pushed ahead on every event
            if i:
                s.delete("k", PROCESSING, i - 1)
            s.register("k", PROCESSING, i)
        assert s.live() == 1 and s.pending() <= 2 * s.live() + 1024
        assert fired(s, None, 10**9) == [(19_999, PROCESSING, "k")]
        monkeypatch.setattr(TimerService, "MAX_FIRINGS_PER_PASS", 50)
        s.register("k", EVENT, 1)
        with pytest.raises(StateError, match="does on_timer register a timer at or before"):
            for t in s.due(10, 0):
                s.register(t.key, EVENT, t.time_ms)  # re-arms at the time that fired it
    finally:
        b.close()


def test_a_loop_is_stopped_after_the_cap_however_many_timers_are_pending(kind, service,
                                                                        monkeypatch):
    """Pending future timers do not delay the loop check: it counts timers registered due
    while timers fire, not firings beyond the backlog."""
    b = backend(new_base(), kind=kind)
    try:
        s = service(b)
        for i in range(1000):
            s.register(f"later{i}", EVENT, 10_000 + i)  # pending, not due
        monkeypatch.setattr(TimerService, "MAX_FIRINGS_PER_PASS", 50)
        s.register("k", EVENT, 1)
        n = 0
        with pytest.raises(StateError, match="does on_timer register a timer at or before"):
            for t in s.due(10, 0):
                n += 1
                s.register(t.key, EVENT, t.time_ms)  # re-arms at the time that fired it
        assert n == 51
        # registering future timers while timers fire is no loop (k's last re-arm is due)
        s.register("x", EVENT, 2)
        assert [t.key for t in s.due(10, 0) if not s.register(t.key, EVENT, 10**6)] == \
            ["k", "x"]
    finally:
        b.close()


def test_times_of_numpy_numbers_and_naive_datetimes():
    import numpy as np

    from spark_glue.timers import _ms

    assert _ms(np.int64(5)) == 5 and _ms(7.6) == 8
    naive = dt.datetime(2026, 1, 1)  # as TimestampNTZ: UTC, whatever the local zone
    assert _ms(naive) == _ms(naive.replace(tzinfo=dt.UTC))
    with pytest.raises(StateError):
        _ms(float("nan"))
    with pytest.raises(StateError, match="64 bits"):
        _ms(1 << 63)


def test_a_timer_deleted_and_registered_again_keeps_one_entry_and_a_backlog_fires(kind, service):
    b = backend(new_base(), kind=kind)
    try:
        s = service(b)
        for k in range(3000):  # the sessions' pattern: an event that does not move the end
            s.register(k, EVENT, 50)
            for _ in range(3):
                s.delete(k, EVENT, 50)
                s.register(k, EVENT, 50)
        assert s.live() == 3000 and s.pending() == 3000
        TimerService.MAX_FIRINGS_PER_PASS, cap = 10, TimerService.MAX_FIRINGS_PER_PASS
        try:  # a backlog of due timers is not a loop, however long
            assert len(fired(s, 100, 0)) == 3000
        finally:
            TimerService.MAX_FIRINGS_PER_PASS = cap
    finally:
        b.close()


def test_the_rocksdb_index_keeps_timers_on_disk_and_only_key_group_heads_in_memory(tmp_path):
    """With state_backend="rocksdb" pending timers are RocksDB keys (key group, domain,
    time, key): memory holds one head per key group and domain, whatever the count; the
    earliest timer is found across key groups after its key group's head was deleted or
    fired; negative and equal times order right; closing deletes the index's directory."""
    from spark_glue.timer_index import RocksDBTimerIndex

    local = tmp_path / "local"
    b = backend(new_base(), kind="rocksdb", local_dir=str(local / "state"))
    s = TimerService(b, "rocksdb", str(local))
    try:
        index = s._index
        assert isinstance(index, RocksDBTimerIndex) and os.path.isdir(index.path)
        for i in range(5000):
            s.register(i, PROCESSING, 10_000 + (i * 7919) % 5000)
        s.register("neg", EVENT, -5)
        s.register("tie-a", EVENT, 3)
        s.register("tie-b", EVENT, 3)
        assert s.live() == 5003 and index.heads() <= 2 * MAXP
        # the earliest of every key group was deleted: the next one is still found
        earliest = sorted(range(5000), key=lambda i: (i * 7919) % 5000)
        for i in earliest[:100]:
            s.delete(i, PROCESSING, 10_000 + (i * 7919) % 5000)
        got = fired(s, 3, 10_000 + 150)
        assert got[0] == (-5, EVENT, "neg")
        assert sorted(got[1:3]) == [(3, EVENT, "tie-a"), (3, EVENT, "tie-b")]
        assert [t for t, _, _ in got[3:]] == list(range(10_100, 10_151))
        assert s.live() == 5000 - 100 - 51
        # churn (the sessions' pattern: a timer pushed ahead on every event) keeps the
        # heads' heap bounded by the key groups
        for r in range(5):
            for i in range(200, 400):
                s.delete(i, PROCESSING, 10_000 + (i * 7919) % 5000 + r)
                s.register(i, PROCESSING, 10_000 + (i * 7919) % 5000 + r + 1)
        assert len(index._heaps[PROCESSING]) <= 4 * len(index._heads[PROCESSING]) + 64
        # a new service (a restored subtask) builds the same index from the state
        live = s.live()
        s.close()
        assert not os.path.exists(index.path)
        s2 = TimerService(b, "rocksdb", str(local))
        try:
            assert s2.live() == s2.pending() == live
            due = [t for t, _, _ in fired(s2, None, 10_160)]
            assert due == sorted(due) and due and due[-1] <= 10_160
            assert s2.live() == live - len(due)
            assert os.path.isdir(s2._index.path)
        finally:
            s2.close()
        assert not os.path.exists(s2._index.path)
        assert not [p for p in os.listdir(local) if p.startswith("dstl-rocksdb-timers-")]
    finally:
        s.close()
        b.close()
