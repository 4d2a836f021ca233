"""One operator's micro-batch plan, analysed once and reused for the batches after it.

``foreachBatch`` hands each micro-batch over as a ``LogicalRDD`` of that batch's rows, with
the streaming query's output attributes: the same names, types and expression ids in
every batch of a query (an empty batch too). The JVM route's plan on top of it
(spark_glue.jvm_route, the subtasks' ``mapInArrow`` of spark_glue.jvm_tasks) is then the
same from one batch to the next but for that leaf. Building it with the DataFrame API
analyses it anew at every step (``withColumn``, ``groupBy``/``agg`` or ``repartition``,
``drop``, ``mapInArrow``: four or five ``Dataset`` s, each analysed and given an encoder),
150 ms and more a batch on a busy driver. So a built plan is kept as its chain of
single-child nodes, and a later batch whose plan is a bare ``LogicalRDD`` with the same
output gets that chain put on its own leaf (one ``withNewChildInternal`` a node) and
analysed once, as one ``Dataset``. Optimizing and physical planning still run for every
batch, so whatever Spark decides from the batch's own leaf (its partitioning, its
statistics) is decided afresh. What analysis decided stays as it was for the first batch,
as it does for Spark's own streaming queries, which are analysed once when they start:
settings such as ``spark.sql.ansi.enabled`` or the session time zone changed while the
query runs do not reach a combiner's expressions.

Any other batch (a ``DataFrame`` a caller built, a batch with a tick column filtered out,
another query's batch) is built with the DataFrame API, and its plan kept if it is a bare
``LogicalRDD``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

from .jvm_errors import first_line

log = logging.getLogger(__name__)

LEAF = "LogicalRDD"


class BatchPlanCache:
    """The analysed plan of one operator's JVM route, kept for the parameters it was built
    with (the route's own, the batch's columns) and the leaf output it was built on: one
    entry, the plan last built."""

    def __init__(self) -> None:
        self._sc: Any = None
        self._dataset: Any = None  # the JVM's Dataset class (its lookup is a round trip)
        # (params, the leaf's output attributes, the chain bottom-up: each node's single
        # child the one below, the lowest one's a stand-in leaf with no rows)
        self._entry: tuple[Hashable, Any, list[Any]] | None = None
        self._off: Any = None  # the context where a reuse failed: none there again
        self.reused = 0  # batches planned from a kept chain (for tests and probes)

    def plan(self, df: Any, params: Hashable, build: Callable[[], Any]) -> Any:
        """The JVM ``Dataset`` ``build()`` makes on ``df`` (a PySpark ``DataFrame``), made
        from the kept chain when ``df`` is a bare ``LogicalRDD`` of the output the chain
        was built on and ``params`` are the same; else ``build()``'s, its chain kept. A
        reuse that Spark refuses (an API of Spark's internals changed) drops the chain
        and builds."""
        sc = df.sparkSession.sparkContext
        if self._sc is not sc:  # a new context: its JVM has none of ours
            self._sc, self._entry = sc, None
            self._dataset = sc._jvm.org.apache.spark.sql.Dataset
        leaf = df._jdf.queryExecution().analyzed()
        bare = leaf.getClass().getSimpleName() == LEAF
        entry = self._entry
        if bare and entry is not None and params == entry[0] and leaf.output().equals(
                entry[1]):
            try:
                got = self._dataset.ofRows(df.sparkSession._jsparkSession,
                                           self._on(entry[2], leaf))
            except Exception as e:  # noqa: BLE001 - py4j's errors: build it instead
                self._refused(e, sc)
            else:
                self.reused += 1
                return got
        self._entry = None
        jdf = build()
        if bare and self._off is not sc:
            try:
                output = leaf.output()
                chain = self._chain_of(jdf, leaf, output)
            except Exception as e:  # noqa: BLE001 - py4j's errors: the batch goes on
                self._refused(e, sc)
            else:
                if chain:
                    self._entry = (params, output, chain)
        return jdf

    def _refused(self, e: Exception, sc: Any) -> None:
        log.warning("a micro-batch's plan cannot be kept for the next ones (%s): each is "
                    "built with the DataFrame API", first_line(e))
        self._entry, self._off = None, sc

    @staticmethod
    def _on(chain: list[Any], leaf: Any) -> Any:
        """``chain`` (bottom-up) put on ``leaf``: the plan's root."""
        node = leaf
        for parent in chain:
            node = parent.withNewChildInternal(node)
        return node

    def _chain_of(self, jdf: Any, leaf: Any, output: Any) -> list[Any]:
        """``jdf``'s analysed plan, bottom-up without its leaf, when every node down to
        ``leaf`` (the batch's own ``LogicalRDD``) has that one child; else none. The chain
        is kept on a stand-in leaf of the same output and no rows: the batch's own would
        hold its RDD (and what it came from) as long as the entry lives."""
        chain, node = [], jdf.queryExecution().analyzed()
        while node.children().size() == 1:
            chain.append(node)
            node = node.children().apply(0)
        if not chain or not node.children().isEmpty() or not node.equals(leaf):
            return []
        logical = self._sc._jvm.org.apache.spark.sql.catalyst.plans.logical
        stand_in = logical.LocalRelation(output, output.take(0), False)  # (no rows)
        kept, below = [], stand_in
        for parent in reversed(chain):
            below = parent.withNewChildInternal(below)
            kept.append(below)
        return kept
