"""Steps 1 and 2 of the operator's data path in Spark's JVM, for a job whose key hash Spark
computes (``spark-xxhash64:<type>``, dstl_ray.key_hashes): no Python pass over the rows, and
with a combiner mapping no stage of its own.

A row's subtask is Flink's operator index of its key group,
``pmod(xxhash64(key), max_parallelism) * parallelism div max_parallelism``, a SQL expression.
The routing is in the shuffle Spark makes anyway:

- **Without a combiner**: ``repartition(p, route)``, ``route`` the int that Spark's hash
  partitioning sends to the subtask's partition (:func:`spark_glue.routing.route_values`).
- **With a combiner mapping** (:mod:`spark_glue.combine`): ``groupBy(key, salt).agg(...)``.
  The aggregation's own exchange partitions by ``pmod(murmur3(salt, murmur3(key, 42)), p)``
  (Spark's hash of its grouping columns, chained), and ``salt``, an int that depends on the
  key only (so the groups are the key's), is chosen per row so that this hash IS the row's
  subtask: Murmur3's steps are invertible, so from ``murmur3(key, 42)`` (Spark's
  ``hash(key)``) and the subtask, ``salt`` follows in a few multiplications, rotations and
  xors mod 2**32 (:func:`salt_constant`, :func:`salt_columns`). Partition ``i`` of the
  aggregation is subtask ``i``'s rows, so the partial aggregation, its shuffle, the final
  aggregation and the state work run in two stages, as Spark's own ``groupBy().agg()`` with
  its state store does, where routing in Python took a stage more (the splitter's
  ``mapInArrow`` after the final aggregation, then a shuffle of its payloads).

A micro-batch of **one partition** (``foreachBatch``'s ``LogicalRDD`` of a file source's one
file, of a one-partition topic) with a combiner mapping takes a third way: declared to Spark
as the one partition it is (:meth:`JvmRoutePlan.one_partition`), it is grouped by the key
alone, then routed as rows without a combiner are. One partition suits any grouping, so
Spark plans the partial and the final aggregation in that partition's task with no exchange
between them, and only the aggregation's rows (one per key) get a route column and cross the
shuffle: no salt computed on each input row, no grouping by two columns, which cost the map
task of 1M events over 1k keys about a fifth of its time.

The plan is built with adaptive execution off and ``spark.sql.shuffle.partitions`` = p on the
batch's session (:func:`planned`): partition ``i`` must stay subtask ``i``, and an empty
micro-batch must still give every subtask a task. A Spark test checks every row's partition
against its key group (tests/spark/test_jvm_route.py).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from .batch_plans import LEAF
from .jvm_errors import first_line
from .routing import int32, quoted, route_values

log = logging.getLogger(__name__)

SALT, SALT_MIX, ROUTE_COL = "_dstl_salt", "_dstl_salt_mix", "_dstl_jvm_route"
_M32, _C1, _C2 = 0xFFFFFFFF, 0xCC9E2D51, 0x1B873593


def _inverse(a: int) -> int:
    return pow(a, -1, 1 << 32)


def _rotr(x: int, r: int) -> int:
    return ((x >> r) | (x << (32 - r))) & _M32


def _unfmix(h: int) -> int:
    """The inverse of Murmur3's finalization mix (without the length)."""
    h ^= h >> 16
    h = h * _inverse(0xC2B2AE35) & _M32
    h ^= (h >> 13) ^ (h >> 26)
    h = h * _inverse(0x85EBCA6B) & _M32
    return h ^ (h >> 16)


def salt_constant(subtask: int) -> int:
    """``c`` such that ``hashInt(salt, seed) == subtask`` (Spark's Murmur3 of an int, as an
    unsigned 32-bit value) for ``salt = unmixK1(seed ^ c)``, whatever the seed: undoing the
    finalization (4 bytes hashed) and ``mixH1`` from the wanted hash ``subtask``."""
    h1 = _unfmix(subtask) ^ 4
    return _rotr((h1 - 0xE6546B64) * _inverse(5) & _M32, 13)


def salt_of(seed: int, subtask: int) -> int:
    """The salt (unsigned 32-bit) :func:`salt_columns` computes for a row whose key's
    ``hash`` is ``seed`` (unsigned 32-bit): the Python twin the unit tests check against
    :func:`spark_glue.routing.spark_hash_int`."""
    k1 = seed ^ salt_constant(subtask)
    return _rotr(k1 * _inverse(_C2) & _M32, 15) * _inverse(_C1) & _M32


def _wrapping_times(a: Any, b: int) -> Any:
    """``a * b`` of an int column and a constant, wrapping at 32 bits as Java's int
    multiplication does (Murmur3's own arithmetic), whatever ``spark.sql.ansi.enabled``:
    Catalyst's ``Multiply`` in LEGACY mode, made in the JVM, where the DataFrame API's ``*``
    would take the session's mode and ANSI refuse the overflow."""
    from pyspark import SparkContext
    from pyspark.sql import functions as F
    from pyspark.sql.column import Column

    jvm = SparkContext._active_spark_context._jvm  # type: ignore[union-attr]
    x = jvm.org.apache.spark.sql.catalyst.expressions
    product = x.Multiply(a._jc.expr(), F.lit(int32(b))._jc.expr(), x.EvalMode.LEGACY())
    return Column(jvm.org.apache.spark.sql.Column(product))


def subtask_column(key: str, max_parallelism: int, parallelism: int) -> Any:
    """Each row's subtask: Flink's operator index of ``pmod(xxhash64(key), max_parallelism)``
    (an int column)."""
    from pyspark.sql import functions as F

    kg = F.pmod(F.xxhash64(F.col(quoted(key))), F.lit(max_parallelism))
    return F.floor(kg * F.lit(parallelism) / F.lit(max_parallelism)).cast("int")


def salt_columns(key: str, max_parallelism: int, parallelism: int) -> tuple[Any, Any]:
    """Each row's salt (:func:`salt_of`, in SQL, in Java's int arithmetic): ``hash(key,
    salt)``, the aggregation's partitioning hash, is the row's subtask. Two columns, to be
    added in turn: :data:`SALT_MIX`, the key's hash xor the subtask's constant times
    ``C2``'s inverse, then :data:`SALT` from it. The rotation between reads its input twice:
    as a column of its own (Spark keeps a projection that an expensive expression is read
    twice from), the key's two hashes are computed once per row and the plan stays small;
    written as one expression it doubles with every reuse, and so does Spark's time to
    analyse, optimize and print the plan and to run it."""
    from pyspark.sql import functions as F

    consts = F.array(*[F.lit(int32(salt_constant(i))) for i in range(parallelism)])
    sub = subtask_column(key, max_parallelism, parallelism)
    k1 = F.hash(F.col(quoted(key))).bitwiseXOR(F.element_at(consts, sub + 1))
    mixed = F.col(SALT_MIX)
    rotated = F.shiftrightunsigned(mixed, 15).bitwiseOR(F.shiftleft(mixed, 17))
    return _wrapping_times(k1, _inverse(_C2)), _wrapping_times(rotated, _inverse(_C1))


@dataclass(frozen=True)
class _Ways:
    """One routing's JVM objects (a way of :meth:`JvmRoutePlan.routed`). Rows routed as
    rows: the route column and the column list ``repartition`` takes. Grouped by the key and
    the salt: the salt's two columns (:func:`salt_columns`). With a combiner mapping: the
    grouping's column list, the first aggregation and a list of the others, and the
    mapping's items, held so that the ids in the plan's cache key are not reused."""

    route: Any = None
    route_by: Any = None
    salt_mix: Any = None
    salt: Any = None
    group_by: Any = None
    first_agg: Any = None
    other_aggs: Any = None
    items: tuple[tuple[str, Any], ...] | None = None


class JvmRoutePlan:
    """The JVM objects of one operator's routing, made once per Spark context and routing
    parameters: each ``F`` function a column expression calls is a round trip to the driver
    JVM (the salt alone takes dozens), so a batch's plan takes only the steps' own calls
    (``withColumn`` twice, ``groupBy``/``agg``, ``drop``; or ``withColumn``, ``repartition``,
    ``drop``), as :class:`spark_glue.route_plan.RoutePlan` does for the Python route."""

    def __init__(self) -> None:
        self._sc: Any = None
        self._made: dict[tuple[Any, ...], _Ways] = {}
        self._single: Any = None  # Spark's SinglePartition and Dataset class, when looked up
        self._off: Any = None  # the context whose Spark refused a declared partition

    def _bind(self, sc: Any) -> None:
        if self._sc is not sc:  # a new session: its JVM knows none of ours
            self._sc, self._made, self._single = sc, {}, None

    def one_partition(self, df: Any) -> Any:
        """``df`` declared to Spark as the one partition it is, when it is a bare
        ``LogicalRDD`` (what ``foreachBatch`` hands over) whose RDD has one partition and
        that is not persisted: the same node with ``SinglePartition`` as its
        partitioning; else None. A file or Kafka source's batch comes with its partitioning
        unknown, so a grouping of it gets an exchange even when one task holds every row.
        (``coalesce(1)`` would say the same, but as an operator outside whole-stage code
        generation: every row copied out of the scan first, which costs what the salt
        saves.) A persisted batch is left as it is: Spark finds a cached plan by its
        leaf, so the copy would read the batch from its source again, where the caller's
        other writes read the cache. A Spark that refuses the copy (its internals
        changed) gets None from then on, and the salted way."""
        from pyspark.sql import DataFrame

        sc = df.sparkSession.sparkContext
        self._bind(sc)
        if self._off is sc:
            return None
        try:
            leaf = df._jdf.queryExecution().analyzed()
            if leaf.nodeName() != LEAF:
                return None
            rdd = leaf.rdd()
            if rdd.getNumPartitions() != 1 or df._jdf.storageLevel().isValid():
                return None
            if self._single is None:
                physical = sc._jvm.org.apache.spark.sql.catalyst.plans.physical
                self._single = (getattr(getattr(physical, "SinglePartition$"), "MODULE$"),
                                sc._jvm.org.apache.spark.sql.Dataset)
            more = leaf.otherCopyArgs()  # (the session, the origin's statistics, constraints)
            node = leaf.copy(leaf.output(), rdd, self._single[0], leaf.outputOrdering(),
                             leaf.isStreaming(), more.apply(0), more.apply(1), more.apply(2))
            jdf = self._single[1].ofRows(df.sparkSession._jsparkSession, node)
        except Exception as e:  # noqa: BLE001 - py4j's errors: the salted way instead
            log.warning("a micro-batch of one partition cannot be declared so to Spark (%s): "
                        "its rows are grouped by key and salt", first_line(e))
            self._off = sc
            return None
        return DataFrame(jdf, df.sparkSession)

    def routed(self, df: Any, key: str, max_parallelism: int, parallelism: int,
               combine: Mapping[str, Any] | None, single: bool = False) -> Any:
        """``df``'s rows (through ``combine``'s aggregation if given), partition ``i``
        holding subtask ``i``'s: the key column, then the mapping's columns or ``df``'s
        others; ``single``: ``df`` is declared one partition (:meth:`one_partition`), a
        combiner's aggregation groups by the key alone and its rows are routed as rows
        (undeclared, Spark adds an exchange for the grouping: the same rows, a stage more).
        Plan it inside :func:`planned`."""
        from pyspark.sql import DataFrame

        sc = df.sparkSession.sparkContext
        self._bind(sc)
        items = None if combine is None else tuple(combine.items())
        params = (key, max_parallelism, parallelism,
                  None if items is None else tuple((name, id(e)) for name, e in items))
        made = self._made.get((params, single))
        if made is None:
            made = self._ways(key, max_parallelism, parallelism, items, single, sc)
            self._made[params, single] = made
        jdf = df._jdf
        if made.salt is None:  # rows routed as rows (a one-partition batch aggregated first)
            if made.items is not None:
                jdf = jdf.groupBy(made.group_by).agg(made.first_agg, made.other_aggs)
            jdf = jdf.withColumn(ROUTE_COL, made.route).repartition(parallelism, made.route_by)
            return DataFrame(jdf.drop(ROUTE_COL), df.sparkSession)
        jdf = (jdf.withColumn(SALT_MIX, made.salt_mix).withColumn(SALT, made.salt)
               .groupBy(made.group_by).agg(made.first_agg, made.other_aggs))
        return DataFrame(jdf.drop(SALT), df.sparkSession)

    @staticmethod
    def _ways(key: str, max_parallelism: int, parallelism: int,
              items: tuple[tuple[str, Any], ...] | None, single: bool, sc: Any) -> _Ways:
        """The JVM objects of one routing, made once (dozens of round trips to the JVM)."""
        from pyspark.sql import functions as F
        from pyspark.sql.column import _to_seq

        by = [F.col(quoted(key))._jc]
        if items is None or single:  # the route column, and the repartition by it
            routes = F.array(*[F.lit(v) for v in route_values(parallelism)])
            sub = subtask_column(key, max_parallelism, parallelism)
            ways = _Ways(route=F.element_at(routes, sub + 1)._jc,
                         route_by=_to_seq(sc, [F.col(ROUTE_COL)._jc]))
        else:  # the salt's two columns, and the grouping by the key and the salt
            mix, salt = salt_columns(key, max_parallelism, parallelism)
            ways, by = _Ways(salt_mix=mix._jc, salt=salt._jc), [*by, F.col(SALT)._jc]
        if items is None:
            return ways
        aggs = [expr.alias(name)._jc for name, expr in items]
        return replace(ways, group_by=_to_seq(sc, by), first_agg=aggs[0],
                       other_aggs=_to_seq(sc, aggs[1:]), items=items)


def routed(df: Any, key: str, max_parallelism: int, parallelism: int,
           combine: Mapping[str, Any] | None, single: bool = False) -> Any:
    """:meth:`JvmRoutePlan.routed` with a plan of its own."""
    return JvmRoutePlan().routed(df, key, max_parallelism, parallelism, combine, single)


def salted_exchange(plan: str, parallelism: int) -> bool:
    """Whether a physical plan's text has the aggregation's exchange by the key and the salt
    into ``parallelism`` partitions: Spark leaves an exchange out when its input is already
    partitioned to suit the grouping (a single partition suits any), and the rows would then
    not be in their subtasks' partitions."""
    return re.search(rf"Exchange hashpartitioning\([^\n]*?\b{SALT}#\d+, {parallelism}\)",
                     plan) is not None


_PLANNING = threading.Lock()  # the settings below are the session's, not the thread's


@contextmanager
def planned(session: Any, parallelism: int) -> Iterator[None]:
    """Plan inside: adaptive execution off (its coalescing would merge subtasks' partitions,
    and an empty micro-batch's shuffle would have none), ``parallelism`` shuffle partitions,
    and an input partitioned by the key alone not taken for one partitioned by the key and
    the salt, on ``session`` (the batch's), each setting as it was afterwards; one planning
    at a time in this process."""
    conf = session.conf
    wanted = {"spark.sql.adaptive.enabled": "false",
              "spark.sql.shuffle.partitions": str(parallelism),
              "spark.sql.requireAllClusterKeysForDistribution": "true"}
    with _PLANNING:
        before = {k: conf.get(k, None) for k in wanted}
        try:
            for k, v in wanted.items():
                conf.set(k, v)
            yield
        finally:
            for k, v in before.items():
                if v is None:
                    conf.unset(k)
                else:
                    conf.set(k, v)
