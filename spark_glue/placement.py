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

import logging
import os
import re
from typing import Any

from .jvm_errors import first_line

log = logging.getLogger(__name__)

_EXECUTOR_DIR = re.compile(r"/([^/]+)/blockmgr-[^/]*$")


def executor_id() -> str | None:
    """This Python worker's executor id (RayDP lays out ``.../app-*/<id>/blockmgr-*``)."""
    for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(","):
        m = _EXECUTOR_DIR.search(d.rstrip("/"))
        if m:
            return m.group(1)
    return None


# BlockManagerId's text (Spark 3.x): BlockManagerId(<executor id>, <host>, <port>, <topology>)
_BLOCK_MANAGER = re.compile(r"BlockManagerId\((.+), ([^,\s]+), (\d+), (None|Some\(.*\))\)")


def executor_hosts(sc: Any) -> dict[str, str]:
    """{executor id: host} of the live executors (from the block manager master), one py4j
    object at a time (:class:`Placement` asks for them in a few calls)."""
    jvm = sc._jvm
    status = sc._jsc.sc().env().blockManager().master().getMemoryStatus()
    out = {}
    for bm in jvm.scala.collection.JavaConverters.mapAsJavaMap(status).keySet():
        if bm.executorId() != "driver":
            out[bm.executorId()] = bm.host()
    return out


def parse_block_managers(text: str) -> dict[str, str] | None:
    """{executor id: host} from block manager ids as Spark prints them, one per line (None
    when a line is not one: then they are asked for one by one)."""
    out = {}
    for line in filter(None, text.split("\n")):
        m = _BLOCK_MANAGER.fullmatch(line)
        if m is None:
            return None
        if m.group(1) != "driver":
            out[m.group(1)] = m.group(2)
    return out


class Placement:
    """Where one operator's subtasks run (``sticky``: each on the executor it ran on last,
    :func:`plan`), and the driver's part of it: the live executors' hosts and the pinned RDD
    of a placement. Each py4j call is a round trip to the driver JVM (asking object by
    object took about 80 calls a micro-batch for the hosts and 15 per subtask for the RDD:
    110 ms a batch on a busy driver), so the JVM objects are looked up once per Spark
    context, the hosts come back as one string, and the RDD of an unchanged placement is
    used again (an RDD is immutable; every batch's job zips with it)."""

    def __init__(self, sticky: bool = True) -> None:
        self.sticky = sticky
        self.previous: dict[int, str] = {}  # subtask -> the executor it ran on last
        self._sc: Any = None
        self._master: Any = None
        self._rdd: tuple[tuple[Any, ...], Any] | None = None  # (placement, pinned RDD)

    def collect(self, per_subtask: Any, n: int) -> list[Any]:
        """The results of ``per_subtask``'s ``n`` tasks (an RDD of one result per
        partition), task ``i`` run where :func:`plan` puts subtask ``i`` when sticky and
        the executors are known, anywhere otherwise."""
        from pyspark.serializers import BatchedSerializer, CPickleSerializer

        sc = per_subtask.context
        hosts = self._live_hosts(sc) if self.sticky else {}
        if not hosts:
            return per_subtask.collect()
        # zipped with the pinned RDD, task i runs where the placement says; the state work
        # stays in ONE Python worker per task (the routed side's pipeline), and the pairs
        # are decoded on the driver, so no second worker competes for the cache
        placement = plan(n, self.previous, hosts)
        mine = per_subtask._reserialize(BatchedSerializer(CPickleSerializer(), 1))
        return [r for r, _i in mine.zip(self.pinned(sc, placement, hosts, n)).collect()]

    def collect_java(self, sc: Any, jrdd: Any, n: int) -> list[Any]:
        """:meth:`collect` of a JVM RDD of pickled rows (``DataFrame.javaToPython``) with
        ``n`` partitions, one row each: the rows, in partition order."""
        from pyspark.rdd import _load_from_socket
        from pyspark.serializers import BatchedSerializer, CPickleSerializer, PairDeserializer

        rows = BatchedSerializer(CPickleSerializer())
        hosts = self._live_hosts(sc) if self.sticky else {}
        if not hosts:
            return list(_load_from_socket(sc._jvm.PythonRDD.collectAndServe(jrdd.rdd()), rows))
        pinned = self.pinned(sc, plan(n, self.previous, hosts), hosts, n)
        sock = sc._jvm.PythonRDD.collectAndServe(jrdd.zip(pinned._jrdd).rdd())
        pairs = PairDeserializer(rows, BatchedSerializer(CPickleSerializer(), 1))
        return [r for r, _i in _load_from_socket(sock, pairs)]

    def remember(self, executors: dict[int, str]) -> None:
        """Where each subtask ran in the batch just done (its executor id)."""
        self.previous = executors

    def _live_hosts(self, sc: Any) -> dict[str, str]:
        try:
            return self.hosts(sc)
        except Exception as e:  # noqa: BLE001 - placement is an optimization only
            # query.stop() interrupts the batch's thread in the JVM call: no news
            log.log(logging.DEBUG if "InterruptedException" in str(e) else logging.WARNING,
                    "no executor placement (%s): subtasks run anywhere", first_line(e))
            return {}

    def _context(self, sc: Any) -> None:
        if self._sc is not sc:
            self._master = sc._jsc.sc().env().blockManager().master()
            self._sc, self._rdd = sc, None

    def hosts(self, sc: Any) -> dict[str, str]:
        """:func:`executor_hosts`, in three calls."""
        self._context(sc)
        try:
            got = parse_block_managers(self._master.getMemoryStatus().keys().mkString("\n"))
        except Exception as e:  # noqa: BLE001 - then object by object, as before
            if "InterruptedException" in str(e):
                raise  # query.stop(): no placement this batch
            log.debug("block manager ids not read as one string: %s", e)
            got = None
        return executor_hosts(sc) if got is None else got

    def pinned(self, sc: Any, placement: dict[int, str], hosts: dict[str, str], n: int
               ) -> Any:
        """:func:`pinned_rdd`, the same RDD while the placement stays."""
        self._context(sc)
        key = tuple((placement.get(i), hosts.get(placement.get(i, ""))) for i in range(n))
        if self._rdd is None or self._rdd[0] != key:
            self._rdd = key, pinned_rdd(sc, placement, hosts, n)
        return self._rdd[1]


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
