"""Spark on Ray through RayDP, with small documented defaults and clean shutdown.

``start_spark`` connects to Ray if needed and calls ``raydp.init_spark``; executors are Ray
actors spread over the Ray nodes (``placement_group_strategy="SPREAD"``), so Spark tasks run
on every node and reach their own node's changelog actor. ``stop_spark`` stops the executors
and the JVM; call it (or use ``spark_session`` as a context manager) so no JVM or actor leaks.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

DEFAULTS = {
    "spark.driver.memory": "512m",
    "spark.sql.shuffle.partitions": "4",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.execution.arrow.pyspark.enabled": "false",
    # operator subtasks prefer the executor holding their cached state (spark_glue.placement);
    # a host-level shuffle preference would let any executor on a shared host take them
    "spark.shuffle.reduceLocality.enabled": "false",
    # glibc gives every thread that allocates an arena of its own (up to 8 per core), and
    # RocksDB's, Arrow's and Spark's threads leave each fragmented: two arenas keep a Python
    # worker with RocksDB state near what it uses (10M pending timers in RocksDB: peak RSS
    # 559 -> 491 MiB, experiments/timers_scale.py), as Hadoop's containers cap them at 4 and
    # Flink's images swap in jemalloc for RocksDB
    "spark.executorEnv.MALLOC_ARENA_MAX": "2",
}


def start_spark(app_name: str = "dstl-ray", num_executors: int = 2, executor_cores: int = 1,
                executor_memory: str = "512M", configs: Mapping[str, str] | None = None,
                spread: bool = True) -> Any:
    """A SparkSession whose executors are Ray actors (RayDP).

    Defaults: 2 executors x 1 core x 512 MiB, 4 shuffle partitions, no UI. The Python workers
    use this interpreter (``PYSPARK_PYTHON``), so they can import dstl_ray.
    """
    import ray
    import raydp

    from dstl_ray.transport.ray import ensure_ray

    if not ray.is_initialized():
        ensure_ray(os.environ.get("DSTL_NAMESPACE", "dstl_ray"))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # the driver's address for its executors is the one Ray knows this node by (on several
    # machines, the --node-ip-address of `ray start`), not whatever the hostname resolves to
    conf = {**DEFAULTS, "spark.pyspark.python": os.environ["PYSPARK_PYTHON"],
            "spark.driver.host": ray.util.get_node_ip_address(), **dict(configs or {})}
    return raydp.init_spark(app_name, num_executors=num_executors,
                            executor_cores=executor_cores, executor_memory=executor_memory,
                            placement_group_strategy="SPREAD" if spread else None,
                            configs=conf)


def stop_spark() -> None:
    import raydp

    raydp.stop_spark()


@contextmanager
def spark_session(**kwargs: Any) -> Iterator[Any]:
    spark = start_spark(**kwargs)
    try:
        yield spark
    finally:
        stop_spark()


def gcs_address() -> str:
    """The address Spark tasks use to join this Ray cluster (pass it into closures)."""
    import ray

    return ray.get_runtime_context().gcs_address


def executor_hosts(spark: Any) -> list[str]:
    """The hosts (IPs) of the session's live executors, one per executor, as Spark's
    scheduler knows them."""
    infos = spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
    hosts = [str(i.host()) for i in infos]
    driver = spark.conf.get("spark.driver.host", "")
    if driver in hosts:
        hosts.remove(driver)  # the driver is listed as well
    return sorted(hosts)


def wait_for_executors(spark: Any, n: int, timeout_s: float = 180.0,
                       poll_s: float = 0.5) -> list[str]:
    """Wait until at least ``n`` executors are registered with the driver (a killed RayDP
    executor actor comes back as a new executor some seconds later; a job started before
    then places its subtasks on fewer executors). Returns their hosts; raises
    :class:`~dstl_ray.errors.DeadlineError` naming how many came within ``timeout_s``."""
    from dstl_ray.errors import DeadlineError

    deadline = time.monotonic() + timeout_s
    while True:
        hosts = executor_hosts(spark)
        if len(hosts) >= n:
            return hosts
        if time.monotonic() >= deadline:
            raise DeadlineError(f"{len(hosts)} of {n} Spark executors registered after "
                                f"{timeout_s:g} s")
        time.sleep(poll_s)


def executor_actors() -> list[tuple[str, str]]:
    """(name, namespace) of the live RayDP executor actors, from the GCS (works without the
    dashboard, which a second Ray cluster on the same machine may not get)."""
    import ray

    return sorted((a["name"], a["namespace"])
                  for a in ray.util.list_named_actors(all_namespaces=True)
                  if "executor" in a["name"].lower())


def kill_executor(index: int = 0) -> str:
    """Kill one RayDP executor actor (failure injection in demos, chaos runs and tests);
    returns its name, or "" if there is none."""
    import ray

    execs = executor_actors()
    if not execs:
        return ""
    name, ns = execs[index % len(execs)]
    ray.kill(ray.get_actor(name, namespace=ns), no_restart=False)
    return name

