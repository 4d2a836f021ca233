"""The README's Spark blocks run as written, in order, in one namespace
(tests/unit/docs_util.py): the Structured Streaming query over two files of events (two
micro-batches) into a file sink read back with ``spark.read``, the vectorized, the
session windows' and the typed state's operators (made, not run:
tests/spark/test_vectorized_api.py and test_timers.py run such operators), and reading the
state and the changes back. ``/data`` and ``/out`` are in this test's temporary directory,
and ``start_spark`` returns the session's Spark (RayDP runs one Spark per Ray cluster)."""

from __future__ import annotations

import json
from collections import Counter

import dstl_ray
import spark_glue
from tests.unit.docs_util import readme_runs, runnable

EVENTS = ([("u1", 5), ("u2", 7), ("u1", 1)], [("u2", 3), ("u3", 4)])


def _totals(batches) -> tuple[Counter, Counter]:
    count, total = Counter(), Counter()
    for batch in batches:
        for user, amount in batch:
            count[user] += 1
            total[user] += amount
    return count, total


def test_readme_spark_blocks_run(spark, tree_factory, namespace, tmp_path, monkeypatch):
    monkeypatch.setenv("DSTL_NAMESPACE", namespace)  # the block's operators find this tree
    monkeypatch.setattr(spark_glue, "start_spark", lambda *args, **kwargs: spark)
    deployed, real = [], dstl_ray.deploy

    def deploy(base, config=None, *, address=None, detached=True):
        if address is None:  # tree_factory's own call
            return real(base, config, detached=detached)
        # the block's: on the session's Ray, in this test's namespace
        assert base == f"file://{tmp_path}/data/dstl" and address == "auto"
        deployed.append(tree_factory(base=base))
        return deployed[-1]

    monkeypatch.setattr(dstl_ray, "deploy", deploy)
    events = tmp_path / "data" / "events"
    events.mkdir(parents=True)

    def add_events(n: int) -> None:
        lines = [json.dumps({"user": u, "amount": a}) for u, a in EVENTS[n]]
        part = tmp_path / f"part-{n}.json"
        part.write_text("\n".join(lines) + "\n")
        part.rename(events / part.name)  # whole, or not there: the file source sees it once

    _plain, blocks = readme_runs()
    assert len(blocks) == 5, [b.where for b in blocks]
    stream, vectorized, windows, typed, read_back = blocks
    names: dict = {"__name__": "__readme__"}  # functions go to Spark by value

    def run(block) -> None:
        exec(compile(runnable(block, tmp_path), block.where, "exec"), names)

    add_events(0)
    try:
        run(stream)  # it waits for the first file itself, and reads the output back
        assert len(deployed) == 1  # the block deploys its tree
        assert sorted(tuple(r) for r in names["spark"].read.parquet(
            str(tmp_path / "out" / "user-totals")).collect()) == [("u1", 2, 6), ("u2", 1, 7)]
        query = names["query"]
        add_events(1)
        query.processAllAvailable()
        count, total = _totals(EVENTS)
        assert names["op"].state() == {"count": dict(count), "sum": dict(total)}
        files = spark.read.parquet(str(tmp_path / "out" / "user-totals")).collect()
        assert sorted(tuple(r) for r in files) == [  # each batch's outputs, once
            ("u1", 2, 6), ("u2", 1, 7), ("u2", 2, 10), ("u3", 1, 4)]

        run(vectorized)  # its update function's shape runs in test_vectorized_api.py
        run(windows)
        run(typed)  # made, not run: tests/spark/test_typed_state.py runs typed state
        assert names["typed"].state_schema[0] == ("count", "bigint")
        run(read_back)
        assert {r.key: r.value for r in names["counts"].collect()} == dict(count)
        assert {r.key: r.value for r in names["sums"].collect()} == dict(total)
        changed = {r.key: r.value for r in names["feed"].collect() if r.op == "value_set"}
        assert changed == {u: count[u] for u, _ in EVENTS[1]}  # the second batch's keys
    finally:
        for q in spark.streams.active:
            q.stop()
        for name in ("op", "vectorized", "windows", "typed"):
            if name in names:
                names[name].close()
