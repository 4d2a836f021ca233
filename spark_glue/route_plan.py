"""Steps 1 and 2 of the operator's data path (:mod:`spark_glue.routing`) as each micro-batch's
Spark plan: the combiner's aggregation, the splitter's ``mapInArrow``, the ``repartition`` by
route, with their JVM objects made once per operator and Spark context.

Every PySpark call that builds a plan is one or more py4j round trips to the driver JVM, and
its helpers spend more: a Python list becomes a Scala ``Seq`` element by element, a column
name becomes a ``Column`` through a reflective lookup, a DataFrame's columns are its schema
as JSON. Built with the public API, a micro-batch's routing took 46 round trips (85 ms on a
busy driver, every batch); the aggregation, the splitter's UDF applied to its columns and
the route column are the same from one batch to the next, so only the three steps' own
calls remain (:class:`RoutePlan`): ``groupBy``/``agg``, ``pythonMapInArrow``,
``repartition``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .combine import Combine, check_combine
from .routing import ROUTE, quoted, route_values, routed_schema, splitter


class RoutePlan:
    """The JVM objects of one operator's routing, made once per Spark context.

    - The splitter's ``mapInArrow`` UDF: ``DataFrame.mapInArrow`` makes a new one at every
      call (it pickles the function and builds its JVM objects: 44 round trips, 120 ms a
      micro-batch on a busy driver). A UDF is reusable on any DataFrame (its function and
      output schema are fixed: the splitter's parameters key it), and so is its call on
      columns given by name (resolved when each batch's plan is analyzed): one expression
      per UDF and column names. The function is pickled once: a ``combine`` object changed
      between batches is shipped as it was at the first.
    - A combiner mapping's ``groupBy(key).agg(...)``: its grouping and aggregate columns
      as the JVM takes them, by the mapping's names and expressions.
    - The route column ``repartition`` hashes."""

    def __init__(self) -> None:
        self._sc: Any = None
        # splitter parameters -> (combine, UDF, {column names: the UDF's call on them})
        self._udfs: dict[tuple[Any, ...], tuple[Any, Any, dict[tuple[str, ...], Any]]] = {}
        # (key, the mapping's (name, id(expression))s) -> (its items, grouping Seq, first
        # aggregate, the others' Seq)
        self._aggs: dict[tuple[Any, ...], tuple[Any, Any, Any, Any]] = {}
        self._by_route: Any = None  # Seq(col(ROUTE))

    def _context(self, sc: Any) -> None:
        if self._sc is not sc:  # a new session: its JVM knows none of ours
            self._sc, self._udfs, self._aggs, self._by_route = sc, {}, {}, None

    def aggregate(self, df: Any, key: str, combine: Mapping[str, Any]) -> tuple[Any, list[str]]:
        """``df.groupBy(key).agg(...)`` of a combiner mapping (:mod:`spark_glue.combine`),
        and its columns (the key, then the mapping's, in order)."""
        from pyspark.sql import DataFrame
        from pyspark.sql.column import _to_seq
        from pyspark.sql.functions import col

        check_combine(combine, key, None)  # (the operator's is checked: a caller's may not be)
        sc = df.sparkSession.sparkContext
        self._context(sc)
        items = tuple(combine.items())  # (a mapping changed in place is another entry)
        params = (key, tuple((name, id(expr)) for name, expr in items))
        got = self._aggs.get(params)
        if got is None:  # (the entry holds the expressions: their ids are not reused)
            exprs = [expr.alias(name)._jc for name, expr in items]
            got = self._aggs[params] = (items, _to_seq(sc, [col(quoted(key))._jc]), exprs[0],
                                        _to_seq(sc, exprs[1:]))
        jdf = df._jdf.groupBy(got[1]).agg(got[2], got[3])
        return DataFrame(jdf, df.sparkSession), [key, *(name for name, _ in items)]

    def apply(self, df: Any, columns: Sequence[str], key: str, max_parallelism: int,
              parallelism: int, combine: Callable[[Any], Any] | None,
              key_hash: str = "blake2b") -> Any:
        """``df.mapInArrow(splitter(...), routed_schema())`` (``columns``: ``df``'s), with
        the UDF and its call made once."""
        from pyspark.rdd import PythonEvalType
        from pyspark.sql import DataFrame
        from pyspark.sql.functions import col
        from pyspark.sql.pandas.functions import pandas_udf

        sc = df.sparkSession.sparkContext
        self._context(sc)
        # the combiner by identity (it need not be hashable; the entry holds it, so its id
        # is not reused), and the files added with addPyFile, which the UDF ships
        params = (key, max_parallelism, parallelism, id(combine), key_hash,
                  tuple(getattr(sc, "_python_includes", None) or ()))
        got = self._udfs.get(params)
        if got is None:
            got = self._udfs[params] = combine, pandas_udf(  # type: ignore[call-overload]
                splitter(key, max_parallelism, parallelism, route_values(parallelism),
                         combine, key_hash),
                returnType=routed_schema(),
                functionType=PythonEvalType.SQL_MAP_ARROW_ITER_UDF), {}
        names = tuple(columns)
        call = got[2].get(names)
        if call is None:  # as DataFrame.mapInArrow does (3.5), its columns by name
            call = got[2][names] = got[1](*[col(quoted(c)) for c in names])._jc.expr()
        return DataFrame(df._jdf.pythonMapInArrow(call, False), df.sparkSession)

    def by_route(self, df: Any, parallelism: int) -> Any:
        """``df.repartition(parallelism, col(ROUTE))``."""
        from pyspark.sql import DataFrame
        from pyspark.sql.column import _to_seq
        from pyspark.sql.functions import col

        self._context(df.sparkSession.sparkContext)
        if self._by_route is None:
            self._by_route = _to_seq(self._sc, [col(ROUTE)._jc])
        return DataFrame(df._jdf.repartition(parallelism, self._by_route), df.sparkSession)


def route(df: Any, key: str, max_parallelism: int, parallelism: int,
          combine: Combine | None = None, extra: Any = None,
          plan: RoutePlan | None = None, key_hash: str = "blake2b") -> Any:
    """Steps 1 and 2: ``df``'s rows as Arrow payloads, partition ``i`` holding subtask
    ``i``'s; ``df``'s rows through ``combine`` first (if given: a function per input
    partition, a mapping in the JVM, :mod:`spark_glue.combine`), and ``extra``'s rows routed
    alongside, uncombined (the initial state's, spark_glue.initial_frame).
    ``plan``: the operator's (a new one otherwise); ``key_hash``: the job's, by name."""
    columns = df.columns
    if key not in columns:
        from dstl_ray.errors import ConfigError

        raise ConfigError(f"key column {key!r} is not in the micro-batch's columns "
                          f"{columns}")
    plan = plan or RoutePlan()
    if isinstance(combine, Mapping):  # in the JVM: no function left for the map side
        df, columns = plan.aggregate(df, key, combine)
        combine = None
    payloads = plan.apply(df, columns, key, max_parallelism, parallelism, combine, key_hash)
    if extra is not None:
        payloads = payloads.union(plan.apply(extra, extra.columns, key, max_parallelism,
                                             parallelism, None, key_hash))
    return plan.by_route(payloads, parallelism)
