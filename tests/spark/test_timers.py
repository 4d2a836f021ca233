"""Timers in micro-batches on RayDP over several Ray nodes: session windows closed by
event-time timers, and a processing-time timer per key and batch, through an executor kill
and a driver restart between checkpoint completion and Spark's commit. The sessions emitted
plus those still open must be exactly the offline sessions of all input, every session the
watermark passed must have been emitted, and the timers left in state are exactly the open
sessions' ones."""

from __future__ import annotations

import sys
import time

import pytest
from pyspark import cloudpickle

from spark_glue import KeyedStatefulOperator, with_ticks
from spark_glue.pipeline import json_lines, write_event_file
from spark_glue.session import kill_executor
from spark_glue.sessions import SCHEMA, Sessions, check_sessions
from spark_glue.timers import PROCESSING, TIMERS_STATE

cloudpickle.register_pickle_by_value(sys.modules[__name__])

GAP, SPAN, DELAY_S, T0 = 20_000, 60_000, 5.0, 1_700_000_000_000
SESSIONS = Sessions(GAP)


def update(key, rows, state):
    """Sessions, and a processing-time timer due at once: it counts the batches of a key."""
    state.timers.register_processing_time(state.timers.now)
    return SESSIONS.update(key, rows, state)


def on_timer(key, timer, state):
    if timer.domain == PROCESSING:
        ticks = state.value("ticks")
        ticks.set(ticks.get(0) + 1)
        return []
    return SESSIONS.on_timer(key, timer, state)


def write(src, i: int) -> list[tuple[str, int]]:
    """Micro-batch i's file: 120 events of 25 users in [T0 + i * SPAN, T0 + (i + 1) * SPAN)."""
    write_event_file(src, i, 120, 25, seed=5, event_time_ms=T0 + i * SPAN, span_ms=SPAN)
    return [(e["user"], e["ts"]) for e in json_lines([src / f"events-{i:05d}.json"])]


class _Crash(Exception):
    pass


def test_session_windows_survive_an_executor_kill_and_a_driver_restart(spark, tree_factory,
                                                                      namespace, tmp_path):
    tree_factory(persist_delay_s=0.02)
    src, chk = tmp_path / "in", tmp_path / "chk"
    files = [write(src, i) for i in range(3)]
    sunk: dict[int, list] = {}
    crashed: list[int] = []

    def sink(batch_id, out):
        sunk[batch_id] = out  # idempotent by batch id: a replay overwrites
        if batch_id == 1:
            assert kill_executor(), "no RayDP executor actor found"
        if batch_id == 4 and not crashed:
            crashed.append(batch_id)
            raise _Crash("driver dies after checkpoint 4")

    def operator():
        return KeyedStatefulOperator("sessions", key="user", update=update, on_timer=on_timer,
                                     event_time="ts", allowed_delay=DELAY_S, sink=sink,
                                     namespace=namespace, parallelism=3, max_parallelism=32,
                                     materialization_interval=1.0)

    def run(op, until: int):
        q = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(src))
             .writeStream.foreachBatch(op).option("checkpointLocation", str(chk)).start())
        try:
            deadline = time.time() + 240
            while not any(s.batch_id >= until for s in op.history) and time.time() < deadline:
                if q.exception() is not None:
                    raise q.exception()
                time.sleep(0.3)
        finally:
            q.stop()

    op1 = operator()
    run(op1, 2)
    files += [write(src, i) for i in range(3, 6)]
    with pytest.raises(Exception, match="driver dies"):
        run(op1, 5)
    op1.coordinator.shutdown()
    op2 = operator()
    run(op2, 5)
    op2.close()
    assert [s.batch_id for s in op2.history] == [4, 5] and op2.history[0].replayed
    # the kill made tasks restore
    assert sum(s.restores for s in op1.history[2:]) >= 1, [
        (s.batch_id, s.executors, s.restores) for s in op1.history]
    events = [e for f in files for e in f]
    state = op2.state()
    watermark = max(t for f in files[:-1] for _u, t in f) - int(DELAY_S * 1000)
    emitted = [tuple(s) for b in sorted(sunk) for s in sunk[b]]
    assert len(emitted) == len(set(emitted))  # no session emitted twice
    assert check_sessions(emitted, state.get("session", {}), events, GAP, watermark) == []
    assert len(emitted) > 25  # sessions closed by arrival and by timers
    # the timers left are the open sessions' (processing-time ones all fired)
    assert {u: m for u, m in state.get(TIMERS_STATE, {}).items() if m} == {
        u: {f"event:{v[1] + GAP + 1}": 1} for u, v in state.get("session", {}).items()}
    batches_of = {}
    for i, f in enumerate(files):
        for u, _t in f:
            batches_of.setdefault(u, set()).add(i)
    assert state["ticks"] == {u: len(b) for u, b in batches_of.items()}


def remind_later(key, rows, state):
    """A processing-time timer 2 s after the key's first row."""
    if state.value("seen").get() is None:
        state.value("seen").set(True)
        state.timers.register_processing_time(state.timers.now + 2000)
    return []


def reminded(key, timer, state):
    return [(key, timer.time_ms)]


def test_a_processing_time_timer_fires_on_an_idle_stream(spark, tree_factory, namespace,
                                                         tmp_path):
    """Issue 30 item 4: with the ticks (spark_glue.with_ticks) every trigger runs a
    micro-batch, so a timer fires within about a trigger interval of its time while no data
    arrives; without them foreachBatch ran only when data came."""
    tree_factory(persist_delay_s=0.02)
    src = tmp_path / "in"
    users = {u for u, _t in write(src, 0)}
    fired: dict[str, tuple[int, int]] = {}

    def sink(batch_id, out):
        for key, due_ms in out:
            fired.setdefault(key, (due_ms, batch_id))

    op = KeyedStatefulOperator("idle", key="user", update=remind_later, on_timer=reminded,
                               sink=sink, namespace=namespace, parallelism=2,
                               max_parallelism=32, materialization_interval=None)
    q = (with_ticks(spark.readStream.schema(SCHEMA).json(str(src)))
         .writeStream.foreachBatch(op).trigger(processingTime="500 milliseconds")
         .option("checkpointLocation", str(tmp_path / "chk")).start())
    try:
        deadline = time.time() + 60
        while set(fired) != users and time.time() < deadline:
            if q.exception() is not None:
                raise q.exception()
            time.sleep(0.2)
    finally:
        q.stop()
    op.close()
    assert set(fired) == users  # no data after the first file: the ticks ran the batches
    # each fired in the first micro-batch that started at or after its time (a batch's
    # processing time is its start): the one before it started too early
    start_ms = {s.batch_id: (s.finished_at - s.batch_s) * 1000 for s in op.history}
    for due, b in fired.values():
        assert start_ms[b] >= due - 500 and start_ms[b - 1] < due, (due, b, start_ms)
    assert op.history[0].rows == 120 and all(s.rows == 0 for s in op.history[1:])
    # they fired in micro-batches without data, which ran on the ticks alone
    assert all(b >= 1 and op.history[b].rows == 0 for _due, b in fired.values())
