"""One episode's job under chaos (``experiments.chaos``): its coordinator, its subtask actors,
the rounds applied to them, and what the fault injections (``experiments.chaos_faults``) do
to it: take a checkpoint, fail over, restart from a savepoint, check it against the oracle.

Checkpoint ``n`` of the job holds rounds ``base + 1 .. base + n``: a job restarted under its
id after DELETE_ON_CANCELLATION (``job_restart``) numbers its checkpoints from 1 again, from
the round ``base`` it restarted after. Every other recovery keeps the numbering, so after one
the next round is above every completed checkpoint (:meth:`Episode.caught_up`).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

from .chaos_job import LEASE_TTL_S, MAXP, OP, PAR, Oracle, differences, restore_in_driver


class Episode:
    """The episode's job: started at ``PAR`` subtasks from nothing, by a new coordinator."""

    def __init__(self, harness: Any, job: str, log: Any) -> None:
        self.h, self.job, self.log = harness, job, log
        self.oracle = Oracle(harness.seed)
        self.coord = self.coordinator()
        self.actors = harness.start(job, None, str(self.coord.incarnation))
        self.res: dict[str, Any] = {
            "job": job, "storage": harness.base.split(":")[0], "faults_by_kind": Counter(),
            "recoveries": 0, "checkpoints_completed": 0, "checkpoints_declined": 0,
            "changes_verified": 0, "changes_lost": 0, "clean_checkpoint_failures": 0,
            "clean_checkpoint_retries": 0, "max_buffered_bytes": 0, "parallelisms": [PAR]}
        self.rnd = 0  # the round the episode is at
        self.applied = 0  # rounds applied to the live subtasks
        self.base = 0  # the round after which the job last started from nothing
        self.par = PAR

    def coordinator(self, retention: Any = None) -> Any:
        """A new driver's coordinator of the job (DELETE_ON_CANCELLATION unless told)."""
        from dstl_ray import CheckpointCoordinator, CheckpointRetention

        return CheckpointCoordinator(
            self.job, self.h.base, max_parallelism=MAXP, retained=2,
            retention=retention or CheckpointRetention.DELETE_ON_CANCELLATION,
            lease_ttl_s=LEASE_TTL_S)

    def count(self, key: str, n: int = 1) -> None:
        self.res[key] = self.res.get(key, 0) + n

    # ------------------------------------------------------------------ rounds

    def apply_to(self, rnd: int) -> None:
        import ray

        while self.applied < rnd:
            self.applied += 1
            ray.get([a.apply.remote(self.h.seed, self.applied) for a in self.actors],
                    timeout=120)

    def advance(self) -> bool:
        """The next round, and its checkpoint: the job goes on while a fault is under way."""
        self.rnd += 1
        self.apply_to(self.rnd)
        return self.checkpoint(self.rnd)

    def caught_up(self) -> None:
        """After a recovery that replayed further than the episode's round (a takeover
        driver checkpoints a round of its own), the episode goes on from there."""
        self.rnd = max(self.rnd, self.applied)

    def checkpoint(self, rnd: int, drop_acks: bool = False) -> bool:
        """Checkpoint ``rnd - base`` of the live subtasks: True if it completed."""
        import ray

        from dstl_ray import DstlError
        from dstl_ray.state.snapshot import KeyedStateSnapshot

        cid = rnd - self.base  # a restarted job numbers its checkpoints from 1 again
        try:
            wm = self.coord.subsumed_watermark()
            snaps = ray.get([a.snapshot.remote(cid, wm) for a in self.actors], timeout=120)
        except Exception as e:  # noqa: BLE001 - declined: writers keep their changes
            self.log(f"    checkpoint {cid} declined: {type(e).__name__}: {str(e)[:120]}")
            if "Timeout" in type(e).__name__ or "TimeoutError" in str(e)[:300]:
                self.h.debug(self.actors, self.log)
            self.res["checkpoints_declined"] += 1
            return False
        if drop_acks:
            self.res["checkpoints_declined"] += 1
            return False
        try:
            self.coord.complete_checkpoint(cid, [KeyedStateSnapshot.from_dict(
                json.loads(s), self.coord.base_path) for s in snaps])
        except DstlError as e:  # a fenced driver writes no metadata
            self.log(f"    checkpoint {cid} not completed: {type(e).__name__}: {str(e)[:200]}")
            self.res["checkpoints_declined"] += 1
            return False
        self.res["checkpoints_completed"] += 1
        return True

    def clean_round(self) -> None:
        """A round without faults: a checkpoint must complete soon (as in Flink, a declined
        one is followed by the next trigger)."""
        self.rnd += 1
        self.apply_to(self.rnd)
        for _attempt in range(20):
            if self.checkpoint(self.rnd):
                return
            self.res["clean_checkpoint_retries"] += 1
            time.sleep(0.5)
        self.res["clean_checkpoint_failures"] += 1

    # ------------------------------------------------------------------ recovery

    def failover(self, new_coordinator: bool, parallelism: int | None = None,
                 restart: bool = False) -> None:
        """The job restarts from its latest checkpoint: its subtasks are killed and started
        again; with ``new_coordinator`` its driver died too; with ``restart`` it was cancelled
        (DELETE_ON_CANCELLATION) and starts under the same id from nothing."""
        self.h.kill(self.actors)
        if restart:
            self.coord.shutdown(cancel=True)
            self.coord = self.coordinator()
            self.base = self.applied
        elif new_coordinator:
            self.coord.abandon()  # the driver dies with its subtasks
            self.coord = self.coordinator()
        if restart or new_coordinator:
            self.coord.restore(None, OP, 0)  # load retained checkpoints, clean orphans
        latest = self.coord.latest_checkpoint()
        self.start(latest.metadata_url if latest else None,
                   latest.checkpoint_id if latest else 0, parallelism or self.par)

    def start(self, source: str | None, rounds: int, parallelism: int,
              foreign: bool = False) -> None:
        """Start the subtasks at ``parallelism`` from ``source`` (a ``_metadata`` URL, None:
        empty), which holds ``rounds`` rounds after ``base``."""
        self.par = parallelism
        self.res["parallelisms"].append(parallelism)
        self.actors = self.h.start(self.job, source, str(self.coord.incarnation), parallelism,
                                   foreign=foreign)
        self.applied = self.base + rounds
        self.res["recoveries"] += 1

    def stop(self) -> None:
        """The episode ends: its subtasks and its driver go (nothing cleaned)."""
        self.h.kill(self.actors)
        self.coord.abandon()

    # ------------------------------------------------------------------ oracle

    def want(self, rounds: int) -> Counter:
        """The counts of checkpoint ``rounds`` (rounds after ``base``)."""
        return self.oracle.between(self.base, self.base + rounds)

    def verify(self, where: str) -> None:
        """The live state, and the latest checkpoint restored from storage, against the
        oracle: every difference is a lost change."""
        import ray

        got: dict[int, int] = {}
        for d in ray.get([a.dump.remote() for a in self.actors], timeout=120):
            got.update(d)
        lost = differences(got, self.oracle.between(self.base, self.applied))
        latest = self.coord.latest_checkpoint()
        if latest is not None:
            restored = restore_in_driver(self.job, self.h.base, latest.metadata_url)
            want = self.want(latest.checkpoint_id)
            lost += differences(restored, want)
            self.res["changes_verified"] += sum(want.values())
        self.res["changes_lost"] += lost
        if lost:
            self.log(f"    LOST {lost} changes ({where})")
