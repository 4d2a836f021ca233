"""``CheckpointCoordinator``: triggers checkpoints and savepoints, writes their metadata,
retains the last K, subsumes older ones and drives recovery (docs/architecture.md "Checkpoint lifecycle";
Flink's retained checkpoints and restore modes; FLINK-5053 savepoints).

A checkpoint is complete only when every backend's snapshot is durable and
``{base}/{job}/chk-{n}/_metadata`` is written atomically; any failure declines it. Several
checkpoints may be pending at once.

Deadlines and order (Flink's ``execution.checkpointing.timeout`` and its completion rules): a
checkpoint has ONE deadline, ``checkpoint_timeout_s`` from its trigger, for all its backends
together; when it passes before every snapshot is in, the checkpoint is declined. Each pending
checkpoint waits on its own, so a hung one never holds up later ones. Completed checkpoints
still form a rising sequence: when checkpoint n completes, every pending checkpoint older
than n is declined as subsumed (it could only complete into the past), and an older one that
is ready after a newer one completed is declined, never written.

The class keeps the job's lists (backends, pending and retained checkpoints) and delegates
whole concerns: how a pending checkpoint waits (:func:`await_snapshots`), which checkpoint a
restore uses and what it keeps (:func:`plan_restore`), savepoints (:class:`Savepoints`)
and the directory claims of FLIP-306 (:func:`claim_checkpoint_dirs` and its siblings).
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import threading
import time
from typing import Any

from ..errors import CheckpointDeclinedError, DstlError
from ..key_hashes import BLAKE2B, joined_key_hash
from ..state.backend import ChangelogKeyedStateBackend
from ..state.registry import SharedStateRegistry
from ..state.snapshot import KeyedStateSnapshot
from ..storage.base import join, normalize_url
from ..storage.registry import get_storage
from ..transport.sender import Incarnation
from .claims import claim_backend_dir, claim_checkpoint_dirs, claim_node_dirs, release_backend_dir
from .cleaner import CheckpointsCleaner
from .lease import JobLease
from .lease_epochs import EPOCHS_DIR
from .locations import CheckpointLocations, metadata_url
from .metadata import CheckpointMetadata, delete_metadata
from .metadata_write import ExclusiveMetadata
from .pending import (
    DEFAULT_CHECKPOINT_TIMEOUT_S,
    PendingCheckpoint,
    abort_older,
    await_snapshots,
    checkpoint_timeout,
    snapshot_names,
    start_snapshots,
)
from .recovery import CompletedCheckpoint, restore_backends
from .restore import (
    RestoreMode,
    load_retained,
    materialize_now,
    plan_restore,
    register_kept,
    settle_files,
)
from .restore_point import RestorePointFile
from .retained import RetainedCheckpoints
from .savepoint import Savepoints

__all__ = [  # PendingCheckpoint, RestoreMode and the default timeout are part of its API
    "DEFAULT_CHECKPOINT_TIMEOUT_S",
    "CheckpointCoordinator",
    "CheckpointRetention",
    "PendingCheckpoint",
    "RestoreMode",
]

log = logging.getLogger(__name__)


class CheckpointRetention(enum.StrEnum):
    """Flink's ExternalizedCheckpointCleanup: what cancelling the job does to checkpoints."""

    RETAIN_ON_CANCELLATION = "retain_on_cancellation"
    DELETE_ON_CANCELLATION = "delete_on_cancellation"


class CheckpointCoordinator:
    """Checkpoints of one job: ``{base}/{job}/chk-{n}/_metadata`` plus shared state files."""

    def __init__(self, job_id: str, base_path: str, *, max_parallelism: int = 128,
                 retained: int = 1,
                 retention: CheckpointRetention = CheckpointRetention.RETAIN_ON_CANCELLATION,
                 max_concurrent: int = 4, registry: SharedStateRegistry | None = None,
                 checkpoint_timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S,
                 lease_ttl_s: float = 30.0) -> None:
        if retained < 1 or max_concurrent < 1:
            raise ValueError("retained and max_concurrent must be >= 1")
        self.checkpoint_timeout_s = checkpoint_timeout(checkpoint_timeout_s)
        self.job_id = job_id
        self.base_path = normalize_url(base_path)
        self.job_path = join(self.base_path, job_id)
        self.max_parallelism, self.key_hash = max_parallelism, BLAKE2B.name  # (key_hashes)
        self.retention = CheckpointRetention(retention)
        self.max_concurrent = max_concurrent
        self.storage = get_storage(self.job_path)
        self.registry = registry or SharedStateRegistry(list_files=self.storage.list_files)
        self.backends: list[ChangelogKeyedStateBackend] = []
        self._lock = threading.Lock()
        self._retained = RetainedCheckpoints(retained)
        self._pending: dict[int, PendingCheckpoint] = {}
        self._in_progress: set[int] = set()  # checkpoint ids triggered and not yet finished
        self._next_id = 1
        # one thread per pending checkpoint waits for its snapshots (declines need no wait);
        # metadata writes and the retained list change one checkpoint at a time
        self._finisher = concurrent.futures.ThreadPoolExecutor(
            max_concurrent + 2, thread_name_prefix="dstl-cc")
        self._commit_lock = threading.Lock()
        # one live driver per job; taken when the job starts (restore, first checkpoint); its
        # epochs are claimed in {base}/_epochs/{job}/, outside the job directory
        self.lease = JobLease(self.job_path, ttl_s=lease_ttl_s, storage=self.storage,
                              epochs_url=join(self.base_path, EPOCHS_DIR, job_id))
        self.declined = 0
        # subsumed checkpoints are deleted in the background (Flink's CheckpointsCleaner)
        self.cleaner = CheckpointsCleaner(self.lease, self.registry, self._notify_subsumed)
        self.metadata = ExclusiveMetadata(self.storage, self.lease)  # never written over
        self.locations = CheckpointLocations(self.storage, self.job_path, self.lease.check,
                                             lambda url: self.cleaner.settle([url]))
        self.restore_point = RestorePointFile(self.base_path, job_id, self.lease.check)
        self.savepoints = Savepoints(job_id, self.job_path, max_parallelism, self.storage,
                                     self.lease.check, self.registry, lambda: self.key_hash)

    # ------------------------------------------------------------------ incarnation

    @property
    def incarnation(self) -> Incarnation:
        """This run of the job (:mod:`dstl_ray.checkpoint.lease`); taking it holds the job's lease."""
        with self._lock:
            if self.lease.incarnation is None:
                inc = self.lease.acquire()
                self.registry.guard = self.lease.check  # a fenced driver deletes nothing
                claim_node_dirs(self.registry, self.job_path, inc)
            return self.lease.incarnation  # type: ignore[return-value]

    # ------------------------------------------------------------------ backends

    def register_backend(self, backend: ChangelogKeyedStateBackend) -> None:
        backend.set_incarnation(str(self.incarnation))
        backend.attach_registry(self.registry)
        claim_backend_dir(self.registry, backend)
        with self._lock:  # (its checkpoints record the backends' one key hash)
            self.key_hash = joined_key_hash(self.backends, backend)
            self.backends.append(backend)

    def unregister_backend(self, backend: ChangelogKeyedStateBackend) -> None:
        with self._lock:
            self.backends.remove(backend)
        release_backend_dir(self.registry, backend)

    def subsumed_watermark(self) -> int:
        """The newest checkpoint id up to which every checkpoint is subsumed or declined:
        nothing at or below it is retained or in progress, and no checkpoint this
        coordinator may still complete has an id at or below it (FLIP-306 4.4). With
        nothing retained, :meth:`complete_checkpoint` accepts any id (a Spark query starts
        at batch 0, a replayed batch restarts at its own id), so the watermark is -1."""
        with self._lock:
            ids = self._retained.ids() + list(self._in_progress)
        ids += self.cleaner.outstanding_ids()  # a _metadata still listed names its files
        return min(ids) - 1 if ids else -1

    def _notify_subsumed(self) -> None:
        """Tell every backend the watermark (each call carries all earlier ones). Backends
        delete files by it (merged files past their last use) without asking the lease
        again, so only a driver that still holds the job validly tells them anything."""
        try:
            self.lease.check()
        except DstlError as e:  # fenced, or unsure: the next driver's recovery decides
            log.log(logging.WARNING if self.lease.fenced else logging.DEBUG,
                    "not notifying the subsumed watermark: %s", e)
            return
        wm = self.subsumed_watermark()
        with self._lock:
            backends = list(self.backends)
        for b in backends:
            try:
                b.notify_checkpoint_subsumed(wm)
            except DstlError as e:
                log.warning("subsume notification to %s failed: %s", b.operator_id, e)

    def completed_checkpoints(self) -> list[CompletedCheckpoint]:
        """Retained checkpoints, oldest first."""
        with self._lock:
            return self._retained.all()

    def latest_checkpoint(self) -> CompletedCheckpoint | None:
        with self._lock:
            return self._retained.latest()

    def _new_id(self) -> int:
        n = self._next_id
        self._next_id += 1
        return n

    def trigger_checkpoint(self) -> PendingCheckpoint:
        """Checkpoint n: every backend's snapshot, then the metadata file (asynchronously).
        Declined if the snapshots are not all in ``checkpoint_timeout_s`` after now."""
        self.incarnation  # noqa: B018 - the job's lease, before anything is written
        deadline = time.monotonic() + self.checkpoint_timeout_s
        with self._lock:
            n = self._new_id()
            self._in_progress.add(n)
            backends = list(self.backends)
            pending = len(self._pending)
        self.locations.begin(n, metadata_url(self.job_path, n))
        self.registry.checkpoint_started(n)
        futures, error = start_snapshots(n, backends, pending, self.max_concurrent)
        abort: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # registered before it can finish: _forget must find it
            pc = PendingCheckpoint(n, self._finisher.submit(
                self._finish, n, futures, error, deadline, abort, snapshot_names(backends)),
                abort, futures)
            self._pending[n] = pc
        pc.future.add_done_callback(lambda _f: self._forget(n))
        return pc

    def _forget(self, n: int) -> None:
        with self._lock:
            self._pending.pop(n, None)
            self._in_progress.discard(n)
        self._notify_subsumed()

    def _finish(self, n: int, futures: list[concurrent.futures.Future],
                error: BaseException | None, deadline: float,
                abort: concurrent.futures.Future, names: list[str]) -> CompletedCheckpoint:
        """Wait for checkpoint ``n``'s snapshots until its deadline (:func:`await_snapshots`:
        older checkpoints that are ready finish first), then commit or decline it."""
        snaps, error = await_snapshots(n, futures, names, error, deadline, abort,
                                       self.checkpoint_timeout_s, lambda: self._older_ready(n))
        return self._commit(n, snaps, error)

    def _older_ready(self, n: int) -> list[concurrent.futures.Future]:
        """Futures of the pending checkpoints older than ``n`` whose snapshots are all in."""
        with self._lock:
            return [p.future for m, p in self._pending.items()
                    if m < n and p.ready() and not p.future.done()]

    def _commit(self, n: int, snaps: list[KeyedStateSnapshot], error: BaseException | None
                ) -> CompletedCheckpoint:
        with self._commit_lock:  # one metadata write and retained-list change at a time
            return self._commit_locked(n, snaps, error)

    def _commit_locked(self, n: int, snaps: list[KeyedStateSnapshot],
                       error: BaseException | None) -> CompletedCheckpoint:
        url = metadata_url(self.job_path, n)
        self.cleaner.settle([url])  # an old chk-n's discard (a replayed id) is done first
        meta = CheckpointMetadata(self.job_id, n, "checkpoint", self.max_parallelism,
                                  tuple(snaps), epoch=self.lease.epoch, key_hash=self.key_hash)
        files = meta.files(url)
        self.registry.register(url, files)  # so a declined checkpoint's files get cleaned
        try:
            if error is not None:
                raise error
            self.lease.check()  # a fenced driver never writes metadata
            with self._lock:
                subsumed_by = self._retained.subsumed(n)
            if subsumed_by:  # completed checkpoints only ever rise
                raise CheckpointDeclinedError(subsumed_by)
            self.locations.ready(n)  # chk-n made, its name durable
            size = self.metadata.write(url, meta)
        except BaseException as e:  # noqa: BLE001
            self.declined += 1
            self.registry.release(url)
            self.registry.checkpoint_finished(n)
            self.locations.declined(n)  # one made ahead goes (only if empty)
            log.warning("checkpoint %d of %s declined: %s", n, self.job_id, e)
            raise CheckpointDeclinedError(f"checkpoint {n} of job {self.job_id} declined: "
                                          f"{type(e).__name__}: {e}") from e
        cc = CompletedCheckpoint(n, url, meta, files, size)
        claim_checkpoint_dirs(self.registry, self.job_path, snaps)
        with self._lock:
            subsumed = self._retained.add(cc)
            older = [p for m, p in self._pending.items() if m < n]
        self.registry.checkpoint_finished(n, completed=True)
        self.locations.completed(n)  # older locations begun can no longer complete
        abort_older(older, n)  # Flink: completing n aborts the pending checkpoints before it
        self.cleaner.discard_later(subsumed)  # complete now; the subsumed go in the background
        return cc

    def begin_checkpoint(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` of :meth:`complete_checkpoint` is being taken: its
        location (``chk-n``) is made now, in the background, while the snapshots are taken
        (Flink's trigger makes it with its barriers; a hub, just after its triggers). Optional:
        the commit makes what is missing (:mod:`~dstl_ray.checkpoint.locations`)."""
        self.incarnation  # noqa: B018 - the job's lease, before anything is written
        self.locations.begin(checkpoint_id, metadata_url(self.job_path, checkpoint_id))

    def complete_checkpoint(self, checkpoint_id: int, snapshots: list[KeyedStateSnapshot]
                            ) -> CompletedCheckpoint:
        """Complete checkpoint ``checkpoint_id`` from snapshots taken elsewhere (backends in
        other processes, e.g. Spark tasks; the id is the micro-batch id). It must be newer
        than every retained checkpoint: see :meth:`drop_checkpoints_from` for a replay."""
        self.incarnation  # noqa: B018 - the job's lease, before anything is written
        with self._lock:
            self._retained.refuse_older(checkpoint_id, self.job_id, self._in_progress)
            self._next_id = max(self._next_id, checkpoint_id + 1)
            self._in_progress.add(checkpoint_id)
        self.registry.checkpoint_started(checkpoint_id)
        try:
            return self._finisher.submit(self._commit, checkpoint_id, list(snapshots),
                                         None).result()
        finally:
            with self._lock:
                self._in_progress.discard(checkpoint_id)

    def drop_checkpoints_from(self, checkpoint_id: int) -> list[int]:
        """Forget retained checkpoints with id >= ``checkpoint_id`` (their metadata first,
        then their references), so a replayed micro-batch can complete them anew from the
        older state; returns the dropped ids."""
        self.cleaner.settle()  # the subsumed ones go first: what is left is what is listed
        with self._lock:
            gone = self._retained.drop_from(checkpoint_id)
        for cc in reversed(gone):
            self.cleaner.discard(cc)
        self._notify_subsumed()
        return [c.checkpoint_id for c in gone]

    # ------------------------------------------------------------------ savepoints

    def trigger_savepoint(self, of: CompletedCheckpoint | None = None, table: str = "heap",
                          local_dir: str | None = None, timeout_s: float | None = None
                          ) -> concurrent.futures.Future[CompletedCheckpoint]:
        """A savepoint (:class:`Savepoints`) of the backends, or of checkpoint ``of`` (its id)
        rewritten from its files: for a job whose backends live elsewhere (Spark's)."""
        inc = self.incarnation  # the job's lease, before anything is written
        with self._lock:
            n, backends = self._new_id() if of is None else of.checkpoint_id, list(self.backends)
        return self.savepoints.start(n, backends, str(inc), of, table, local_dir, timeout_s)

    # ------------------------------------------------------------------ recovery

    def restore(self, client: Any, operator_id: str, parallelism: int, *,
                checkpoint: str | None = None, mode: RestoreMode = RestoreMode.CLAIM,
                fallback: bool = False, cleanup: bool = True, **backend_options: Any
                ) -> list[ChangelogKeyedStateBackend]:
        """Recover the job: load this job's retained checkpoints, restore ``parallelism``
        backends of ``operator_id`` from ``checkpoint`` (a ``_metadata`` URL, possibly of
        another job or a savepoint) or else the latest complete one, delete orphans, and
        register the backends. With ``fallback`` a checkpoint whose files are missing or
        corrupt is skipped for the next older retained one; otherwise the error names both.
        Orphans are cleaned by the restore that starts this run (takes the lease) only: a
        later one (another operator) would delete this run's live files."""
        took = self.lease.incarnation is None
        self.incarnation  # noqa: B018 - the job's lease first: never clean another's files
        try:
            return self._restore(client, operator_id, parallelism, checkpoint, mode,
                                 fallback, cleanup and took, backend_options)
        except BaseException:
            if took:  # the job did not start: the next driver need not wait
                self.lease.release()
                self.lease.incarnation = None  # a retry starts a new incarnation
            raise

    def _restore(self, client: Any, operator_id: str, parallelism: int,
                 checkpoint: str | None, mode: RestoreMode, fallback: bool, cleanup: bool,
                 backend_options: dict[str, Any]) -> list[ChangelogKeyedStateBackend]:
        self.cleaner.settle()  # (a live coordinator's) subsumed checkpoints are not listed
        # the orphan cleanup considers only files that exist before anything of this run is
        # written: restoring backends may write already (a rescale with file merging
        # materializes each new subtask's own copy at once), and those files are live
        before = self.storage.list_files(self.job_path) if cleanup else None
        retained, broken = load_retained(self.job_path, self.storage)
        checkpoint, mode = self.restore_point.pick(checkpoint, mode, retained)
        with self._lock:
            self._next_id = max([self._next_id, *[c.checkpoint_id + 1 for c in retained]])
        backend_options.setdefault("incarnation", str(self.incarnation))
        plan = plan_restore(retained, broken, checkpoint, mode, fallback, self._retained.count,
                            lambda cc: restore_backends(client, cc, operator_id, parallelism,
                                                        self.max_parallelism,
                                                        **backend_options), self.base_path)
        chosen = plan.chosen
        for c in plan.drop:  # retained checkpoints newer than the chosen one are broken
            self.lease.check()  # per delete: a driver fenced meanwhile deletes nothing more
            delete_metadata(c.metadata_url)
        register_kept(plan, self.registry)  # before anyone can see (and drop) them retained
        with self._lock:
            if plan.claim and chosen is not None:
                self._next_id = max(self._next_id, chosen.checkpoint_id + 1)
            self._retained.replace(plan.keep)
        settle_files(plan, self.registry, self.lease, self.job_path, self.storage, before,
                     self.locations.owns)
        self.restore_point.restored(checkpoint, mode, plan)
        if chosen is not None:
            claim_checkpoint_dirs(self.registry, self.job_path, chosen.metadata.snapshots)
        for b in plan.backends:
            if plan.own:
                b.take_over(plan.keep)
            self.register_backend(b)
        self._notify_subsumed()
        if plan.foreign:  # the first checkpoint must not depend on foreign files
            materialize_now(plan.backends)
        return plan.backends

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, cancel: bool = False, timeout: float = 60.0) -> None:
        """Stop: wait for pending checkpoints, close the backends (FLIP-158 "Cleanup on
        shutdown"), and on cancel with DELETE_ON_CANCELLATION delete every checkpoint."""
        with self._lock:
            pending = [p.future for p in self._pending.values()]
        concurrent.futures.wait(pending, timeout=timeout)
        for b in list(self.backends):
            b.close()
        with self._lock:
            self.backends.clear()
        self.savepoints.close()  # before checkpoints go, and the lease
        self.cleaner.settle()  # the subsumed ones before the retained: a cancel leaves none
        delete = cancel and self.retention is CheckpointRetention.DELETE_ON_CANCELLATION
        if delete:
            with self._lock:
                gone = self._retained.clear()
            for cc in gone:
                self.cleaner.discard(cc)
            self.restore_point.remove()
        self.registry.close(timeout)  # what shutting down freed is gone on return
        with self._commit_lock:  # no commit writes into one meanwhile
            self.locations.close()  # the ones begun and never completed
        self._finisher.shutdown(wait=True)
        self.lease.release(delete=delete)

    def abandon(self) -> None:
        """Stop as a crashed driver would: nothing is closed, released or deleted, and the
        job's lease is left to the next driver (the chaos harness and tests simulate a
        driver's death with it)."""
        self.lease.abandon()  # (queued discards check it: they delete nothing)
        self.locations.abandon()
        self._finisher.shutdown(wait=False)
