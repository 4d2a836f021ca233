"""A driver process of one job for the lease tests (``python lease_driver.py BASE JOB TTL``,
run as a file so that its libfaketime fix comes before dstl_ray is imported; started by
:class:`~dstl_ray.testing.lease_process.DriverProcess`): one CheckpointCoordinator
(DirectTransport on ``file://`` or S3, no Ray), run under libfaketime to give it a wall clock
minutes off the others', or inside a host that gets partitioned. Commands come one per line
on stdin, each answered by one JSON line on stdout:

* ``start``: take the job (``restore``: the lease, the latest checkpoint, orphan cleanup);
  answers ``ok``, the incarnation and holder, or the :class:`JobLeaseError`, and ``waited_s``.
* ``run``: checkpoint continuously in the background (every value incremented, a forced
  materialization every third checkpoint, so subsumption deletes shared files).
* ``status``: checkpoints done and declined, whether the lease is fenced, and the state at the
  newest completed checkpoint.
* ``stop``: stop the loop and shut the coordinator down (it gives the job up).
"""

from __future__ import annotations

import json
import sys
import threading
import time


def _patch_sleep() -> None:
    """Under ``faketime --exclude-monotonic`` (libfaketime 0.9.10), ``time.sleep`` fails with
    EINVAL (its absolute CLOCK_MONOTONIC deadline is mistranslated) while timed lock waits
    work: sleep on a lock then. Done before dstl_ray is imported (it binds ``time.sleep`` as
    a default argument). Nothing else changes: the wall clock stays skewed."""
    try:
        time.sleep(0.001)
    except OSError:
        time.sleep = lambda s: threading.Event().wait(s) and None  # type: ignore[assignment]


_patch_sleep()

import dstl_ray as d  # noqa: E402
from dstl_ray.errors import JobLeaseError  # noqa: E402

MAXP = 16
KEYS = [f"k{i}" for i in range(8)]


def _reply(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


class Driver:
    def __init__(self, base: str, job: str, ttl_s: float) -> None:
        self.coord = d.CheckpointCoordinator(job, base, max_parallelism=MAXP, retained=1,
                                             lease_ttl_s=ttl_s)
        self.client = d.StateChangelogClient(job, transport=d.DirectTransport(job, base))
        self.backends: list[d.ChangelogKeyedStateBackend] = []
        self.done = 0
        self.declined = 0
        self.last_error = ""
        self.checkpointed: dict[str, int] = {}  # the state of the newest completed checkpoint
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None

    def start(self) -> None:
        t0 = time.monotonic()
        try:
            self.backends = self.coord.restore(self.client, "op", 1,
                                               materialization_interval=None)
        except JobLeaseError as e:
            _reply(ok=False, error=str(e), waited_s=time.monotonic() - t0)
            return
        self.checkpointed = dict(self.backends[0].dump().get("v", {}))
        _reply(ok=True, incarnation=str(self.coord.incarnation),
               holder=self.coord.lease.holder, waited_s=time.monotonic() - t0)

    def _run(self) -> None:
        b = self.backends[0]
        values = dict(self.checkpointed)
        n = 0
        while not self._stop.is_set():
            n += 1
            for k in KEYS:
                values[k] = values.get(k, 0) + 1
                b.value_state("v").update(k, values[k])
            if n % 3 == 0:
                f = b.materialize(force=True)
                if f is not None:
                    f.result(timeout=30)
            try:
                self.coord.trigger_checkpoint().result(timeout=30)
                self.done += 1
                self.checkpointed = dict(values)
            except d.DstlError as e:
                self.declined += 1
                self.last_error = str(e)
            time.sleep(0.05)

    def run(self) -> None:
        self._loop = threading.Thread(target=self._run, daemon=True)
        self._loop.start()
        _reply(ok=True)

    def status(self) -> None:
        _reply(ok=True, done=self.done, declined=self.declined, fenced=self.coord.lease.fenced,
               last_error=self.last_error, checkpointed=self.checkpointed)

    def stop(self) -> None:
        self._stop.set()
        if self._loop is not None:
            self._loop.join(60)
        self.coord.shutdown()
        _reply(ok=True, checkpointed=self.checkpointed)


def main() -> None:
    base, job, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
    driver = Driver(base, job, ttl)
    _reply(ok=True, ready=True, wall_clock=time.time())
    for line in sys.stdin:
        cmd = line.strip()
        getattr(driver, cmd)()
        if cmd == "stop":
            return


if __name__ == "__main__":
    main()
