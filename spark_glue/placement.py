"""Keep each operator subtask on the same Spark executor from one micro-batch to the next, so
its cached backend is found instead of restored (the job Spark's own state stores give to
preferred locations from their StateStoreCoordinator; PySpark exposes no API for it).

The driver builds a one-element-per-partition RDD whose partition ``i`` prefers executor
``E(i)`` (``SparkContext.makeRDD`` with location preferences, through the JVM) and zips it
with the routed rows (one list per partition), so task ``i`` is scheduled on ``E(i)`` at
PROCESS_LOCAL level. This needs ``spark.shuffle.reduceLocality.enabled=false`` (the
:func:`~spark_glue.session.start_spark` default): otherwise the shuffle adds a host-level
preference that every executor on a shared host satisfies. Placement is only a preference:
a lost executor is dropped from it, an over-loaded executor gives subtasks to a less loaded
one (a replacement executor included), and any task may still run anywhere (then it
restores).
"""

from __future__ import annotations

import os
import re
from typing import Any

_EXECUTOR_DIR = re.compile(r"/([^/]+)/blockmgr-[^/]*$")


def executor_id() -> str | None:
    """This Python worker's executor id (RayDP lays out ``.../app-*/<id>/blockmgr-*``)."""
    for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(","):
        m = _EXECUTOR_DIR.search(d.rstrip("/"))
        if m:
            return m.group(1)
    return None


def executor_hosts(sc: Any) -> dict[str, str]:
    """{executor id: host} of the live executors (from the block manager master)."""
    jvm = sc._jvm
    status = sc._jsc.sc().env().blockManager().master().getMemoryStatus()
    out = {}
    for bm in jvm.scala.collection.JavaConverters.mapAsJavaMap(status).keySet():
        if bm.executorId() != "driver":
            out[bm.executorId()] = bm.host()
    return out


def plan(subtasks: int, previous: dict[int, str], hosts: dict[str, str]) -> dict[int, str]:
    """Executor per subtask: where it ran last while that executor is alive and not
    over-loaded, else the least loaded live executor (so a first batch spreads subtasks
    evenly).

    An executor is over-loaded when it holds more subtasks than its share (the subtasks
    over the live executors, rounded up): they run one after the other there while another
    executor idles. After a lost executor's subtask was retried on a survivor, the
    replacement executor never got it back, and every later batch (and checkpoint) took
    two subtasks' time. So a subtask above the share moves to a less loaded live executor,
    the highest-numbered first; a moved subtask restores its backend from the latest
    checkpoint, once. A plan as even as the executors allow stays where it is."""
    if not hosts:
        return {}
    order = sorted(hosts, key=lambda e: (len(e), e))
    share = -(-subtasks // len(order))
    load = dict.fromkeys(order, 0)
    out: dict[int, str] = {}
    for i in range(subtasks):
        e = previous.get(i)
        if e in hosts:
            out[i] = e
            load[e] += 1

    def least_loaded() -> str:
        return min(order, key=lambda x: load[x])

    for i in sorted(out, reverse=True):  # over-loaded executors give up their highest
        e = out[i]
        to = least_loaded()
        if load[e] > share and load[to] < share:
            out[i] = to
            load[e] -= 1
            load[to] += 1
    for i in range(subtasks):
        if i not in out:
            e = least_loaded()
            out[i] = e
            load[e] += 1
    return out


def pinned_rdd(sc: Any, placement: dict[int, str], hosts: dict[str, str], n: int) -> Any:
    """An RDD of ``n`` partitions holding their index, partition i preferring its executor."""
    from pyspark.rdd import RDD
    from pyspark.serializers import BatchedSerializer, CPickleSerializer

    jvm = sc._jvm
    conv = jvm.scala.collection.JavaConverters
    ser = CPickleSerializer()
    items = jvm.java.util.ArrayList()
    for i in range(n):
        locs = jvm.java.util.ArrayList()
        e = placement.get(i)
        if e is not None and e in hosts:
            locs.add(f"executor_{hosts[e]}_{e}")
        items.add(jvm.scala.Tuple2(bytearray(ser.dumps([i])), conv.asScalaBuffer(locs).toSeq()))
    tag = jvm.scala.reflect.ClassTag.apply(jvm.java.lang.Class.forName("[B"))
    jrdd = sc._jsc.sc().makeRDD(conv.asScalaBuffer(items).toSeq(), tag).toJavaRDD()
    return RDD(jrdd, sc, BatchedSerializer(ser, 1))
