"""State TTL in Spark micro-batches (Flink's StateTtlConfig semantics, processing time): an
entry not written for longer than its TTL reads as absent in the update function of a later
batch (a count starts again from zero), and is absent from ``op.state()`` and from the state
reader; a state without TTL keeps everything. (That a materialization drops expired entries
is tested on both tables in tests/unit/state/test_state_ttl.py.)"""

from __future__ import annotations

import sys
import time

from pyspark import cloudpickle

from spark_glue import KeyedStatefulOperator, read_state

from .test_stateful_operator import run_stream

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCHEMA = "user STRING, amount LONG"


def count_both(key, rows, state):
    """``recent`` has a TTL, ``total`` has none."""
    for name in ("recent", "total"):
        v = state.value(name)
        v.set(v.get(0) + len(rows))
    return None


def _write(folder, i, users):
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".f{i:04d}.tmp"
    tmp.write_text("".join(f'{{"user": "{u}", "amount": 1}}\n' for u in users))
    tmp.rename(folder / f"f{i:04d}.json")


def test_expired_entries_read_as_absent_in_later_batches(spark, tree_factory, namespace,
                                                         tmp_path):
    tree_factory()
    src, chk = tmp_path / "in", tmp_path / "chk"
    op = KeyedStatefulOperator("ttl", key="user", update=count_both, namespace=namespace,
                               parallelism=2, max_parallelism=32,
                               materialization_interval=0.0, state_ttl={"recent": 10.0})
    _write(src, 0, ["a", "b", "c", "a"])
    run_stream(spark, op, src, chk)
    assert op.state()["recent"] == {"a": 2, "b": 1, "c": 1}
    time.sleep(10.5)  # a, b and c expire in "recent"
    _write(src, 1, ["a", "b"])
    run_stream(spark, op, src, chk)
    state = op.state()
    assert state["recent"] == {"a": 1, "b": 1}  # counted again from zero; c is gone
    assert state["total"] == {"a": 3, "b": 2, "c": 1}  # no TTL: nothing expires
    rows = {r["key"]: r["value"] for r in read_state(spark, op, "recent").collect()}
    assert rows == {"a": 1, "b": 1}
    op.close()
