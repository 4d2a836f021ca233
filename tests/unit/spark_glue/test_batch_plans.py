"""spark_glue.batch_plans over stand-ins of Spark's plan nodes (pure logic: which batch is
planned from the kept chain, which is built, what the kept chain holds). That a reused
plan routes a real stream's rows right is tests/spark/test_jvm_route.py's."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from spark_glue.batch_plans import BatchPlanCache


class Seq:
    def __init__(self, items):
        self.items = list(items)

    def size(self):
        return len(self.items)

    def apply(self, i):
        return self.items[i]

    def isEmpty(self):  # noqa: N802 - Scala's name
        return not self.items

    def take(self, n):
        return Seq(self.items[:n])

    def equals(self, other):
        return self.items == other.items


class Node:
    def __init__(self, kind, output, children=(), fail=False):
        self.kind, self.out, self.kids, self.fail = kind, output, list(children), fail

    def getClass(self):  # noqa: N802 - Java's name
        return SimpleNamespace(getSimpleName=lambda: self.kind)

    def output(self):
        return self.out

    def children(self):
        return Seq(self.kids)

    def equals(self, other):
        return self is other

    def withNewChildInternal(self, child):  # noqa: N802 - Spark's name
        if self.fail:
            raise RuntimeError("py4j.Py4JException: Method withNewChildInternal does not exist")
        return Node(self.kind, self.out, [child], self.fail)

    def leaf(self):
        node = self
        while node.kids:
            node = node.kids[0]
        return node

    def kinds(self):
        return [self.kind, *(self.kids[0].kinds() if self.kids else [])]


def context():
    sql = SimpleNamespace(
        Dataset=SimpleNamespace(ofRows=lambda session, plan: SimpleNamespace(plan=plan)),
        catalyst=SimpleNamespace(plans=SimpleNamespace(logical=SimpleNamespace(
            LocalRelation=lambda output, rows, streaming: Node("LocalRelation", output)))))
    return SimpleNamespace(_jvm=SimpleNamespace(org=SimpleNamespace(apache=SimpleNamespace(
        spark=SimpleNamespace(sql=sql)))))


def batch(sc, leaf):
    return SimpleNamespace(sparkSession=SimpleNamespace(sparkContext=sc, _jsparkSession="s"),
                           _jdf=SimpleNamespace(queryExecution=lambda: SimpleNamespace(
                               analyzed=lambda: leaf)))


def route(df, fail=False):
    """What the DataFrame API would build on ``df``: three single-child nodes."""
    built = {"n": 0}

    def build():
        built["n"] += 1
        leaf = df._jdf.queryExecution().analyzed()
        root = Node("MapInArrow", "o", [Node("Aggregate", "o", [Node("Project", "o", [leaf],
                                                                     fail)], fail)], fail)
        return SimpleNamespace(plan=root,
                               queryExecution=lambda: SimpleNamespace(analyzed=lambda: root))
    return build, built


OUT = Seq(["user#1", "amount#2"])


def test_a_later_bare_batch_of_the_same_output_gets_the_kept_chain_on_its_own_leaf():
    sc, cache = context(), BatchPlanCache()
    first = batch(sc, Node("LogicalRDD", OUT))
    build, built = route(first)
    assert cache.plan(first, ("p", 3), build).plan.leaf() is first._jdf.queryExecution().analyzed()
    assert built["n"] == 1 and cache.reused == 0
    for _ in range(3):
        leaf = Node("LogicalRDD", Seq(OUT.items))  # a new RDD, the query's same attributes
        got = cache.plan(batch(sc, leaf), ("p", 3), build)
        assert got.plan.leaf() is leaf
        assert got.plan.kinds() == ["MapInArrow", "Aggregate", "Project", "LogicalRDD"]
    assert built["n"] == 1 and cache.reused == 3
    # the kept chain stands on a leaf of no rows, not on the first batch's
    kept = cache._entry[2]
    assert kept[0].kids[0].kind == "LocalRelation"
    assert all(n.leaf() is not first._jdf.queryExecution().analyzed() for n in kept)


@pytest.mark.parametrize("change", ["params", "output", "not bare", "context"])
def test_another_batch_is_built(change):
    sc, cache = context(), BatchPlanCache()
    first = batch(sc, Node("LogicalRDD", OUT))
    build, built = route(first)
    cache.plan(first, ("p", 3), build)
    params, leaf, where = ("p", 3), Node("LogicalRDD", OUT), sc
    if change == "params":  # a rescale, or other columns
        params = ("p", 4)
    elif change == "output":  # another query: other expression ids
        leaf = Node("LogicalRDD", Seq(["user#7", "amount#8"]))
    elif change == "not bare":  # ticks filtered out, a caller's frame
        leaf = Node("Filter", OUT, [Node("LogicalRDD", OUT)])
    else:
        where = context()
    other = batch(where, leaf)
    build2, built2 = route(other)
    got = cache.plan(other, params, build2)
    assert built2["n"] == 1 and cache.reused == 0
    assert got.plan.leaf() is leaf.leaf()
    # the plan last built is the one kept (a batch that is not bare keeps none)
    again = batch(where, Node("LogicalRDD", leaf.output()))
    cache.plan(again, params, build2)
    assert cache.reused == (0 if change == "not bare" else 1)


def test_a_reuse_spark_refuses_builds_and_stops_trying_in_that_context(caplog):
    sc, cache = context(), BatchPlanCache()
    first = batch(sc, Node("LogicalRDD", OUT))
    cache.plan(first, ("p", 3), route(first, fail=False)[0])
    cache._entry[2][0].fail = True  # as if Spark's internals had changed
    second = batch(sc, Node("LogicalRDD", OUT))
    build, built = route(second)
    with caplog.at_level(logging.WARNING, logger="spark_glue.batch_plans"):
        got = cache.plan(second, ("p", 3), build)
    assert got.plan.leaf() is second._jdf.queryExecution().analyzed() and built["n"] == 1
    assert "withNewChildInternal does not exist" in caplog.text and cache.reused == 0
    third = batch(sc, Node("LogicalRDD", OUT))
    cache.plan(third, ("p", 3), route(third)[0])
    assert cache._entry is None and cache.reused == 0
    # a new context tries again
    sc2 = context()
    fourth = batch(sc2, Node("LogicalRDD", OUT))
    cache.plan(fourth, ("p", 3), route(fourth)[0])
    cache.plan(batch(sc2, Node("LogicalRDD", OUT)), ("p", 3), route(fourth)[0])
    assert cache.reused == 1


def test_a_chain_that_cannot_be_kept_does_not_fail_the_batch(caplog):
    sc, cache = context(), BatchPlanCache()
    first = batch(sc, Node("LogicalRDD", OUT))
    build, built = route(first, fail=True)  # the stand-in chain cannot be made
    with caplog.at_level(logging.WARNING, logger="spark_glue.batch_plans"):
        got = cache.plan(first, ("p", 3), build)
    assert got.plan.leaf() is first._jdf.queryExecution().analyzed()
    assert cache._entry is None and "cannot be kept" in caplog.text
