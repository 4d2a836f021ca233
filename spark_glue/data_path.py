"""One operator's data path for a micro-batch (docs/architecture.md "Spark glue", steps 2 and
3): its rows to their subtasks, and one Spark task per subtask, each on its executor.

Two ways, by the job's key hash (spark_glue.job_key_hash):

- **Routed in the JVM** (spark_glue.jvm_route and spark_glue.jvm_tasks), when Spark computes
  the key groups (``spark-xxhash64:<type>``) and the batch needs no Python before the
  shuffle (no combiner function, no initial-state rows): the routing is the shuffle Spark
  makes anyway, and the subtask's task reads its partition as Arrow. A batch of one
  partition with a combiner mapping is aggregated whole in its task, then routed.
- **Routed in Python** (spark_glue.route_plan): the splitter's ``mapInArrow`` hashes each
  distinct key, a shuffle of its Arrow payloads, and the subtask's task reads them back
  (spark_glue.worker.run_partition). A job hashed by blake2b (every job before key hashes
  were named, or ``key_hash="blake2b"``), a combiner function, or a first batch that loads
  an ``initial_state`` DataFrame takes this way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from dstl_ray.errors import ConfigError
from dstl_ray.key_hashes import BLAKE2B

from .combine import Combine
from .jvm_route import ROUTE_COL, SALT, SALT_MIX, JvmRoutePlan
from .jvm_tasks import SubtaskRunner
from .placement import Placement
from .route_plan import RoutePlan, route
from .worker import TaskSpec, run_partition

log = logging.getLogger(__name__)


class DataPath:
    """The JVM objects both ways make once per operator and Spark context."""

    def __init__(self, key: str, combine: Combine | None) -> None:
        self.key, self.combine = key, combine
        self._route_plan, self._jvm_plan = RoutePlan(), JvmRoutePlan()
        self._runner = SubtaskRunner()
        self.aggregated_whole = 0  # batches of one partition aggregated in its task (tests)

    def jvm_routed(self, spec: TaskSpec) -> bool:
        """Whether batch ``spec`` is routed in the JVM: the job is hashed by Spark, nothing
        runs in Python before the shuffle, and PySpark pins each Python thread to a JVM
        thread (its default), so the spec set on the driver thread reaches the job's tasks."""
        return (spec.key_hash != BLAKE2B.name and not spec.initial_columns
                and (self.combine is None or isinstance(self.combine, Mapping))
                and os.environ.get("PYSPARK_PIN_THREAD", "true").lower() == "true")

    def clashes(self, columns: tuple[str, ...]) -> bool:
        """Whether a batch of ``columns`` has one named like a column the JVM route adds, or
        the combiner mapping an output so (in any case: Spark matches names regardless of
        case): the batch's would be replaced by the route's before the combiner reads it,
        the combiner's dropped with the salt; such a batch goes the Python way."""
        outputs = self.combine if isinstance(self.combine, Mapping) else ()
        named = {c.lower() for c in (*columns, *outputs)}
        return bool({SALT, SALT_MIX, ROUTE_COL} & named)

    def run(self, df: Any, spec: TaskSpec, placement: Placement, initial_df: Any
            ) -> list[dict[str, Any]]:
        """Every subtask's result (spark_glue.worker) for micro-batch ``df`` (``initial_df``:
        the initial state's rows, when ``spec`` loads them)."""
        p = spec.parallelism
        columns = tuple(df.columns) if self.jvm_routed(spec) else ()
        if columns and self.key not in columns:
            raise ConfigError(f"key column {self.key!r} is not in the micro-batch's columns "
                              f"{list(columns)}")
        if columns and not self.clashes(columns):
            combine: Mapping[str, Any] | None = self.combine  # type: ignore[assignment]
            one = None if combine is None else self._jvm_plan.one_partition(df)
            single = one is not None
            if single:  # the same batch, declared one partition
                df = one
            got = self._runner.run(
                df, lambda: self._jvm_plan.routed(df, self.key, spec.max_parallelism, p,
                                                  combine, single),
                (spec.max_parallelism, columns, single),
                columns if combine is None else (self.key, *combine), spec, placement,
                salted=combine is not None and not single)
            if got is not None:
                self.aggregated_whole += single
                return got
            log.info("batch %d: Spark planned the aggregation without an exchange by key and "
                     "salt (its input suits the grouping already): routed in Python",
                     spec.batch_id)

        def task(index: int, payloads: Any) -> Any:
            return run_partition(spec, index, payloads)

        routed = route(df, self.key, spec.max_parallelism, p, self.combine, initial_df,
                       self._route_plan, spec.key_hash).rdd
        if routed.getNumPartitions() != p:
            # Spark's adaptive execution gives an empty shuffle no partitions: an empty
            # micro-batch still checkpoints every subtask
            if not routed.isEmpty():
                raise RuntimeError(f"batch {spec.batch_id}: Spark gave the routed rows "
                                   f"{routed.getNumPartitions()} partitions, not {p}")
            routed = routed.context.parallelize([], p)
        # one result per partition, each subtask on its executor if sticky
        return placement.collect(routed.mapPartitionsWithIndex(task), p)
