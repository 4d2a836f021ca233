"""Step 3 over rows Spark's JVM routed (spark_glue.jvm_route): one ``mapInArrow`` task per
subtask, in the same stage as the routing shuffle's reduce side (with a combiner mapping,
the final aggregation's), each pinned to its executor (spark_glue.placement).

The ``mapInArrow`` UDF is made once per operator and Spark context: PySpark makes a new one
at every ``mapInArrow`` call (pickling the function and building its JVM objects, about 44
round trips to the driver JVM). The batch's :class:`~spark_glue.worker.TaskSpec` therefore
does not travel in the function: the driver sets it as a Spark local property of the thread
that runs the job (:data:`SPEC_PROPERTY`, pickled, base64), which Spark ships with each of
the job's tasks and PySpark hands the task's Python worker (``TaskContext``); the property is
cleared when the job is done. A task reads the property of its own job, so a task of an
earlier job (a zombie of a failed stage attempt) never sees a later batch's spec.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

from .batch_plans import BatchPlanCache
from .jvm_route import planned, salted_exchange
from .placement import Placement
from .routing import quoted
from .worker import TaskSpec, run_batches

SPEC_PROPERTY = "dstl_ray.task_spec"
RESULT = "_dstl_result"


def subtask_task(batches: Iterable[Any]) -> Iterator[Any]:
    """The ``mapInArrow`` function: the task's partition is its subtask; its result pickled
    into one row."""
    import pyarrow as pa
    from pyspark import TaskContext
    from pyspark.serializers import CPickleSerializer

    ctx = TaskContext.get()
    text = ctx.getLocalProperty(SPEC_PROPERTY) if ctx is not None else None
    if not text:
        raise RuntimeError(f"the task has no {SPEC_PROPERTY} local property: a dstl-ray "
                           f"subtask runs only in its operator's job")
    ser = CPickleSerializer()  # as PySpark ships a task's function and its results
    spec = ser.loads(base64.b64decode(text))
    result = run_batches(spec, ctx.partitionId(), batches)
    result["spec"] = (spec.job_id, spec.operator_id, spec.batch_id, spec.epoch)
    yield pa.RecordBatch.from_arrays([pa.array([ser.dumps(result)], pa.binary())],
                                     names=[RESULT])


class SubtaskRunner:
    """One operator's step 3 over JVM-routed rows: the UDF and its calls made once per Spark
    context (by the routed frame's column names)."""

    def __init__(self) -> None:
        self._sc: Any = None
        self._udf: Any = None
        self._calls: dict[tuple[str, ...], Any] = {}
        self._plans = BatchPlanCache()

    def run(self, df: Any, routed: Callable[[], Any], params: Hashable,
            names: tuple[str, ...], spec: TaskSpec, placement: Placement, salted: bool
            ) -> list[dict[str, Any]] | None:
        """Every subtask's result (spark_glue.worker) for micro-batch ``df``, whose rows
        ``routed()`` routes (spark_glue.jvm_route, not yet planned; ``names``: its columns;
        ``params``: all the route depends on but ``df``), in partition order; None, with
        nothing run, when Spark planned a ``salted`` aggregation without its exchange
        (:func:`~spark_glue.jvm_route.salted_exchange`). A batch after the first is
        planned from the analysed plan last built where it can be
        (spark_glue.batch_plans)."""
        from pyspark import cloudpickle
        from pyspark.rdd import PythonEvalType
        from pyspark.serializers import CPickleSerializer
        from pyspark.sql.functions import col
        from pyspark.sql.pandas.functions import pandas_udf

        session = df.sparkSession
        sc = session.sparkContext
        if self._sc is not sc:
            self._sc, self._calls = sc, {}
            self._udf = pandas_udf(subtask_task,  # type: ignore[call-overload]
                                   returnType=f"{RESULT} binary",
                                   functionType=PythonEvalType.SQL_MAP_ARROW_ITER_UDF)
        call = self._calls.get(names)
        if call is None:
            call = self._calls[names] = self._udf(*[col(quoted(c)) for c in names])._jc.expr()
        p = spec.parallelism
        frames: list[Any] = []  # the routed DataFrame, when this batch built it

        def build() -> Any:
            frames.append(routed())
            return frames[0]._jdf.pythonMapInArrow(call, False)

        jdf = self._plans.plan(df, (params, names, p, salted), build)
        with planned(session, p):
            jrdd = jdf.javaToPython()
            if salted and not salted_exchange(
                    jdf.queryExecution().executedPlan().toString(), p):
                return None
            if jrdd.getNumPartitions() != p:
                # a batch Spark knows to be empty (an empty local relation) is planned
                # without partitions: every subtask still runs, on no rows
                frame = frames[0] if frames else routed()
                if not frame.isEmpty():
                    raise RuntimeError(f"batch {spec.batch_id}: Spark planned the routed "
                                       f"rows in {jrdd.getNumPartitions()} partitions, not "
                                       f"{p}")
                none = session.createDataFrame(sc.parallelize([], p), frame.schema)
                jrdd = none._jdf.pythonMapInArrow(call, False).javaToPython()
        sc.setLocalProperty(SPEC_PROPERTY, base64.b64encode(cloudpickle.dumps(spec)).decode())
        try:
            rows = placement.collect_java(sc, jrdd, p)
        finally:
            sc.setLocalProperty(SPEC_PROPERTY, None)
        results = [CPickleSerializer().loads(r[0]) for r in rows]
        mine = (spec.job_id, spec.operator_id, spec.batch_id, spec.epoch)
        for r in results:  # (a task that read another thread's spec applied another batch)
            if r.pop("spec") != mine:
                raise RuntimeError(f"batch {spec.batch_id}: a subtask ran with another "
                                   f"batch's task spec: {r['index']}")
        return results
