"""One operator's micro-batch plan, analysed once and reused for the batches after it.

``foreachBatch`` hands each micro-batch over as a ``LogicalRDD`` of that batch's rows, with
the streaming query's output attributes: the same names, types and expression ids in
every batch of a query. The JVM route's plan on top of it (spark_glue.jvm_route, the
subtasks' ``mapInArrow`` of spark_glue.jvm_tasks) is then the same from one batch to the
next but for that leaf. Building it with the DataFrame API analyses it anew at every step
(``withColumn``, ``groupBy``/``agg``, ``drop``, ``mapInArrow``: five ``Dataset`` s, each
analysed and given an encoder), 150 ms and more a batch on a busy driver. So the first
batch's analysed plan is kept as its chain of single-child nodes, and a later batch whose
plan is a bare ``LogicalRDD`` with the same output gets that chain put on its own leaf
(one ``withNewChildInternal`` a node) and analysed once, as one ``Dataset``. Optimizing
and physical planning still run for every batch, so whatever Spark decides from the
batch's own leaf (its partitioning, its statistics) is decided afresh.

Any other batch (a ``DataFrame`` a caller built, a batch with a tick column filtered out,
an empty batch Spark planned as a local relation) is built with the DataFrame API, as
the first one is.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

LEAF = "LogicalRDD"


class BatchPlanCache:
    """The analysed plan of one operator's JVM route, by the route's parameters: at most
    one entry (an operator's parameters change only when its parallelism does)."""

    def __init__(self) -> None:
        self._sc: Any = None
        self._dataset: Any = None  # the JVM's Dataset class (its lookup is a round trip)
        self._params: Hashable = None
        self._output: Any = None  # the leaf's output attributes the chain was built on
        self._chain: list[Any] = []  # bottom-up, each node's single child the one below
        self.reused = 0  # batches planned from the kept chain (for tests and probes)

    def plan(self, df: Any, params: Hashable, build: Callable[[], Any]) -> Any:
        """The JVM ``Dataset`` ``build()`` makes on ``df`` (a PySpark ``DataFrame``), made
        from the kept chain when ``df`` is a bare ``LogicalRDD`` of the output the chain
        was built on and ``params`` are the same; else ``build()``'s, its chain kept."""
        sc = df.sparkSession.sparkContext
        if self._sc is not sc:  # a new context: its JVM has none of ours
            self._sc, self._params, self._chain = sc, None, []
            self._dataset = sc._jvm.org.apache.spark.sql.Dataset
        leaf = df._jdf.queryExecution().analyzed()
        bare = leaf.getClass().getSimpleName() == LEAF
        if bare and self._chain and params == self._params and leaf.output().equals(
                self._output):
            node = leaf
            for parent in self._chain:
                node = parent.withNewChildInternal(node)
            self.reused += 1
            return self._dataset.ofRows(df.sparkSession._jsparkSession, node)
        jdf = build()
        self._params, self._chain = params, (self._chain_of(jdf, leaf) if bare else [])
        self._output = leaf.output()
        return jdf

    @staticmethod
    def _chain_of(jdf: Any, leaf: Any) -> list[Any]:
        """``jdf``'s analysed plan, bottom-up without its leaf, when every node down to
        ``leaf`` (the batch's own ``LogicalRDD``) has that one child; else none."""
        chain, node = [], jdf.queryExecution().analyzed()
        while node.children().size() == 1:
            chain.append(node)
            node = node.children().apply(0)
        if not node.children().isEmpty() or not node.equals(leaf):
            return []
        return chain[::-1]
