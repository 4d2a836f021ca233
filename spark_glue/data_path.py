"""One operator's data path for a micro-batch (docs/architecture.md "Spark glue", steps 2 and
3): its rows to their subtasks, and one Spark task per subtask, each on its executor.

Two ways, by the job's key hash (spark_glue.job_key_hash):

- **Routed in the JVM** (spark_glue.jvm_route and spark_glue.jvm_tasks), when Spark computes
  the key groups (``spark-xxhash64:<type>``) and the batch needs no Python before the
  shuffle (no combiner function, no initial-state rows): the routing is the shuffle Spark
  makes anyway, and the subtask's task reads its partition as Arrow.
- **Routed in Python** (spark_glue.route_plan): the splitter's ``mapInArrow`` hashes each
  distinct key, a shuffle of its Arrow payloads, and the subtask's task reads them back
  (spark_glue.worker.run_partition). A job hashed by blake2b (every job before key hashes
  were named, or ``key_hash="blake2b"``), a combiner function, or a first batch that loads
  an ``initial_state`` DataFrame takes this way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dstl_ray.key_hashes import BLAKE2B

from .combine import Combine
from .jvm_route import routed as jvm_routed
from .jvm_tasks import SubtaskRunner
from .placement import Placement
from .route_plan import RoutePlan, route
from .worker import TaskSpec, run_partition


class DataPath:
    """The JVM objects both ways make once per operator and Spark context."""

    def __init__(self, key: str, combine: Combine | None) -> None:
        self.key, self.combine = key, combine
        self._route_plan = RoutePlan()
        self._runner = SubtaskRunner()

    def jvm_routed(self, spec: TaskSpec) -> bool:
        """Whether batch ``spec`` is routed in the JVM."""
        return (spec.key_hash != BLAKE2B.name and not spec.initial_columns
                and (self.combine is None or isinstance(self.combine, Mapping)))

    def run(self, df: Any, spec: TaskSpec, placement: Placement, initial_df: Any
            ) -> list[dict[str, Any]]:
        """Every subtask's result (spark_glue.worker) for micro-batch ``df`` (``initial_df``:
        the initial state's rows, when ``spec`` loads them)."""
        p = spec.parallelism
        if self.jvm_routed(spec):
            if self.key not in df.columns:
                from dstl_ray.errors import ConfigError

                raise ConfigError(f"key column {self.key!r} is not in the micro-batch's "
                                  f"columns {df.columns}")
            return self._runner.run(jvm_routed(df, self.key, spec.max_parallelism, p,
                                               self.combine),  # type: ignore[arg-type]
                                    spec, placement)

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
