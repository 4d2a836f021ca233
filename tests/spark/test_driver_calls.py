"""The driver's py4j round trips per micro-batch (each a call into the driver JVM, 1 ms or
more on a busy driver): the routing's UDF is made once per operator and Spark context
(spark_glue.route_plan.RoutePlan), as are the combiner's aggregation and the route column,
so a micro-batch's routing is the calls of its three steps; the executors' hosts come in a
few calls and an unchanged placement's pinned RDD is used again
(spark_glue.placement.Placement); what they give is what the one-object-at-a-time way
gives."""

from __future__ import annotations

import contextlib
import dataclasses

from pyspark.sql import functions as F

from spark_glue.placement import Placement, executor_hosts
from spark_glue.route_plan import RoutePlan, route
from spark_glue.routing import (
    read_payloads,
    route_values,
    routed_schema,
    splitter,
    subtask_of,
)


@contextlib.contextmanager
def counted(sc):
    """Counts the py4j commands this thread sends while the block runs, but for the deletes
    of JVM objects whose Python proxies were collected meanwhile (sent whenever Python's
    garbage collector runs: not calls of the code under test)."""
    from py4j.protocol import MEMORY_COMMAND_NAME, MEMORY_DEL_SUBCOMMAND_NAME

    client = sc._gateway._gateway_client
    orig, calls = client.send_command, [0]
    delete = MEMORY_COMMAND_NAME + MEMORY_DEL_SUBCOMMAND_NAME

    def send_command(command, *a, **k):
        if not command.startswith(delete):
            calls[0] += 1
        return orig(command, *a, **k)

    client.send_command = send_command
    try:
        yield calls
    finally:
        client.send_command = orig


def test_hosts_in_a_few_calls_and_the_pinned_rdd_kept(spark):
    sc = spark.sparkContext
    spark.range(6).count()  # the executors are up (a job of the JVM only)
    placement = Placement()
    slow = executor_hosts(sc)
    assert placement.hosts(sc) == slow and len(slow) >= 2
    with counted(sc) as calls:
        assert placement.hosts(sc) == slow
    assert calls[0] <= 4, f"{calls[0]} py4j calls for the executors' hosts"
    ids = sorted(slow)
    plan = {i: ids[i % len(ids)] for i in range(3)}
    rdd = placement.pinned(sc, plan, slow, 3)
    with counted(sc) as calls:
        assert placement.pinned(sc, dict(plan), slow, 3) is rdd
    assert calls[0] == 0
    moved = {**plan, 0: ids[1]}
    other = placement.pinned(sc, moved, slow, 3)
    assert other is not rdd and other.getNumPartitions() == 3


def test_the_routing_udf_is_made_once(spark):
    p, maxp = 3, 32
    plan = RoutePlan()
    frames = [spark.createDataFrame([(f"u{i}", i) for i in range(b, b + 50)], "user STRING, v INT")
              for b in (0, 100)]
    made = []
    for df in frames:
        with counted(spark.sparkContext) as calls:
            out = plan.apply(df, df.columns, "user", maxp, p, None)
        made.append(calls[0])
        users = []
        for r, sub, pl in out.collect():  # each payload holds its subtask's keys only
            assert r == route_values(p)[sub]
            part = read_payloads(sub, [(r, sub, pl)]).column("user").to_pylist()
            assert {subtask_of(u, maxp, p) for u in part} == {sub}
            users += part
        assert sorted(users) == sorted(r.user for r in df.collect())
    assert len(plan._udfs) == 1

    @dataclasses.dataclass
    class Combine:  # a combiner need not be hashable (an eq dataclass is not)
        key: str

        def __call__(self, pdf):
            return pdf.groupby(self.key, as_index=False).agg(n=("v", "size"))

    rows = plan.apply(frames[0], frames[0].columns, "user", maxp, p,
                          Combine("user")).collect()
    assert sum(read_payloads(s, [(r, s, pl)]).num_rows for r, s, pl in rows) == 50
    assert len(plan._udfs) == 2
    with counted(spark.sparkContext) as calls:
        frames[0].mapInArrow(splitter("user", maxp, p, route_values(p)), routed_schema())
    assert made[1] < calls[0], (made, calls[0])


def _routed(df):
    """{subtask: sorted rows} of a routed DataFrame, each payload in its subtask's partition."""
    out = {}
    for i, part in enumerate(df.rdd.glom().collect()):
        table = read_payloads(i, part)
        assert table is None or table.column_names == ["user.id", "n", "total.sum"]
        out[i] = [] if table is None else sorted(zip(*table.to_pydict().values(), strict=True))
    return out


def test_a_batch_routes_in_the_calls_of_its_three_steps(spark):
    """With a combiner mapping, each later batch's routing is groupBy/agg, the splitter's
    mapInArrow and the repartition (and their DataFrames), not the public API's dozens; the
    rows are those of groupBy().agg(), each in its key's subtask. Column names are taken
    literally (a dot is no struct field)."""
    p, maxp = 3, 32
    plan = RoutePlan()
    combine = {"n": F.count("*"), "total.sum": F.sum("v")}
    frames = [spark.createDataFrame([(f"u{i % 7}", i) for i in range(b, b + 40)],
                                    "`user.id` STRING, v INT") for b in (0, 100, 200)]
    made = []
    for df in frames:
        df.columns  # noqa: B018 - the operator asks for them first (the tick check)
        with counted(spark.sparkContext) as calls:
            out = route(df, "user.id", maxp, p, combine, plan=plan)
        made.append(calls[0])
        want = {}
        for r in df.groupBy(F.col("`user.id`")).agg(F.count("*"), F.sum("v")).collect():
            want.setdefault(subtask_of(r[0], maxp, p), []).append(tuple(r))
        got = _routed(out)
        assert {i: rows for i, rows in got.items() if rows} == {
            i: sorted(rows) for i, rows in want.items()}
    assert len(plan._udfs) == 1 and len(plan._aggs) == 1
    assert made[1] <= 6 and made[2] <= 6, made  # 4: groupBy, agg, mapInArrow, repartition
