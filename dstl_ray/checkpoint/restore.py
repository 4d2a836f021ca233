"""Restore planning: which checkpoint a recovering job restores its backends from, and which
checkpoints it retains afterwards (FLIP-158 "Recovery and rescaling"; Flink's restore modes
CLAIM and NO_CLAIM; docs/architecture.md "Checkpoint lifecycle").

The job's own retained checkpoints are candidates newest first; with ``fallback`` one whose
files are missing or corrupt is skipped for the next older one. A checkpoint named
explicitly may be another job's or a savepoint: in CLAIM mode the job takes it over (it is
retained, and deleted once subsumed); in NO_CLAIM mode, and always for a savepoint, its files
stay foreign: protected, and materialized away before the first checkpoint.

A savepoint's files are the user's whatever the mode: any file a restored or kept
checkpoint names inside a savepoint's directory is protected too, so no registry
registration (CLAIM included) ever takes one over. A checkpoint under another base path
than the job's (a copy of the job's directory: a backup) cannot be claimed
(:func:`check_claim`); it restores in NO_CLAIM mode. A claimed checkpoint may have the id
of one of the job's own retained checkpoints: the registry holds references per metadata
URL, so subsuming one never drops the other's.

The coordinator applies the plan: it keeps its retained list, and hands the files to
:func:`settle_files` (references, protection, orphan cleanup) and the backends to its own
bookkeeping.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import RestoreError
from ..state.backend import ChangelogKeyedStateBackend
from ..state.registry import SharedStateRegistry
from ..storage.base import Storage, normalize_url
from .lease import JobLease
from .locations import remove_abandoned_locations
from .metadata import split_metadata_url
from .recovery import (
    SAVEPOINT_PREFIX,
    CompletedCheckpoint,
    cleanup_orphans,
    list_checkpoints,
    load_checkpoint,
)

log = logging.getLogger(__name__)


class RestoreMode(enum.StrEnum):
    """CLAIM: the new job owns the restored checkpoint's files (deletes them once subsumed).
    NO_CLAIM: it never deletes them and materializes first, so no checkpoint depends on them."""

    CLAIM = "claim"
    NO_CLAIM = "no_claim"


@dataclass(frozen=True)
class RestorePlan:
    """The outcome of :func:`plan_restore`: the restored backends and the checkpoints kept."""

    backends: list[ChangelogKeyedStateBackend]
    chosen: CompletedCheckpoint | None  # restored from (None: the job starts empty)
    own: bool  # candidates were the job's own retained checkpoints
    claim: bool  # a foreign checkpoint restored in CLAIM mode: the job owns its files now
    keep: list[CompletedCheckpoint]  # retained from now on (not sorted)
    drop: list[CompletedCheckpoint]  # retained ones newer than ``chosen``: broken

    @property
    def foreign(self) -> bool:
        """Restored from files the job does not own (NO_CLAIM, or a savepoint): they are
        never deleted, and the first checkpoint must not depend on them."""
        return self.chosen is not None and not self.own and not self.claim

    def live_urls(self) -> set[str]:
        """Every file the kept checkpoints use, and their metadata: not orphans."""
        return {u for c in self.keep for u in c.files.values()} | {
            c.metadata_url for c in self.keep}


def load_retained(job_path: str, storage: Storage
                  ) -> tuple[list[CompletedCheckpoint], list[tuple[str, RestoreError]]]:
    """The job's checkpoints that load, oldest first, and the metadata URLs of those that do
    not, with why."""
    retained: list[CompletedCheckpoint] = []
    broken: list[tuple[str, RestoreError]] = []
    for _cid, url in list_checkpoints(job_path, storage):
        try:
            retained.append(load_checkpoint(url, storage))
        except RestoreError as e:
            broken.append((url, e))
    return retained, broken


def plan_restore(retained: list[CompletedCheckpoint], broken: list[tuple[str, RestoreError]],
                 checkpoint: str | None, mode: RestoreMode, fallback: bool, retained_count: int,
                 restore: Callable[[CompletedCheckpoint | None],
                                   list[ChangelogKeyedStateBackend]],
                 base_path: str | None = None) -> RestorePlan:
    """Restore from ``checkpoint`` (a ``_metadata`` URL) or else the newest of ``retained``
    with ``restore`` (it raises :class:`RestoreError` for a checkpoint it cannot restore),
    falling back to older retained ones if ``fallback``; then decide what is kept.

    Without ``checkpoint``, a broken checkpoint newer than every loaded one is an error
    unless ``fallback``. With it, the job's older retained checkpoints are fallbacks only if
    ``checkpoint`` is one of its own; a foreign one is the only candidate, and one under
    another base path than the job's (``base_path``) is not claimed (:func:`check_claim`)."""
    if checkpoint is not None:
        ext = load_checkpoint(checkpoint)
        own = any(normalize_url(c.metadata_url) == ext.metadata_url for c in retained)
        candidates: list[CompletedCheckpoint | None] = [ext] + (
            [c for c in reversed(retained) if c.checkpoint_id < ext.checkpoint_id]
            if own else [])
        external = None if own else ext
        if not own and mode is RestoreMode.CLAIM and not ext.is_savepoint:
            check_claim(ext, base_path)
    else:
        own, external = True, None
        newest_ok = max((c.checkpoint_id for c in retained), default=-1)
        bad = [(u, e) for u, e in broken if int(u.rsplit("/", 2)[-2][4:]) > newest_ok]
        if bad and not fallback:
            raise bad[-1][1]
        candidates = list(reversed(retained)) or [None]
    chosen, backends = None, None
    errors: list[RestoreError] = []
    for cc in candidates:
        try:
            backends = restore(cc)
            chosen = cc
            break
        except RestoreError as e:
            errors.append(e)
            if not fallback or not own:
                raise
            log.warning("falling back from %s: %s", cc.metadata_url if cc else None, e)
    if backends is None:
        raise errors[-1]
    claim = external is not None and not own and mode is RestoreMode.CLAIM and not (
        chosen is not None and chosen.is_savepoint)
    # retained checkpoints newer than the chosen one are broken: they are dropped
    keep = [c for c in retained if chosen is None or not own
            or c.checkpoint_id <= chosen.checkpoint_id]
    drop = [c for c in retained if c not in keep]
    if claim and chosen is not None:
        keep.append(chosen)
    keep = keep[-retained_count:] if not claim else keep
    return RestorePlan(backends, chosen, own, claim, keep, drop)


def check_claim(ext: CompletedCheckpoint, base_path: str | None) -> None:
    """Refuse to claim ``ext`` when it lies under another base path than the job's: its
    handles name their files relative to a base path (``{base}/{job}/...``), and the job's
    next checkpoints, which name the restored state until its first materialization, would
    resolve them against the job's own base path, naming other files (the job's own, long
    deleted, when ``ext`` is a copy of its directory). Claimed, the copy (a user's backup)
    would also be deleted once subsumed. NO_CLAIM restores it, leaves the copy untouched
    and materializes before the first checkpoint."""
    if base_path is None:
        return
    theirs = normalize_url(split_metadata_url(ext.metadata_url)[0])
    if theirs != normalize_url(base_path):
        raise RestoreError(
            f"cannot claim checkpoint {ext.metadata_url}: it lies under base path {theirs}, "
            f"the job's base path is {normalize_url(base_path)} (a copy of the job's "
            f"directory, a backup?); its files cannot be named by this job's checkpoints "
            f"nor deleted as the job's: restore it in NO_CLAIM mode, which leaves it "
            f"untouched", checkpoint=ext.metadata_url)


def register_kept(plan: RestorePlan, registry: SharedStateRegistry) -> None:
    """The kept checkpoints reference their files: before the coordinator lists them as
    retained, so a checkpoint dropped at once releases references it holds."""
    for c in plan.keep:
        registry.register(c.metadata_url, c.files)


def settle_files(plan: RestorePlan, registry: SharedStateRegistry, lease: JobLease,
                 job_path: str, storage: Storage, before: list[str] | None,
                 own_location: Callable[[int], bool] = lambda n: False) -> None:
    """The rest of the files side of a restore (after :func:`register_kept`): foreign
    files are protected, and, given ``before`` (a listing of the job directory taken before
    the restore wrote anything), every file in it that nothing kept uses is deleted as an
    orphan (FLIP-158 "Cleanup after recovery"), by the lease's holder only, and every empty
    ``chk-n`` but this run's own (``own_location``) is removed."""
    if plan.foreign and plan.chosen is not None:
        registry.protect(plan.chosen.files)
    named = plan.keep + ([plan.chosen] if plan.chosen is not None else [])
    registry.protect(u for c in named for u in savepoint_files(c))
    if before is not None:
        keep_urls = plan.live_urls() | {lease.url}
        lease.check(force=True)  # read it again: only the holder deletes orphans
        cleanup_orphans(job_path, keep_urls, storage, candidates=before,
                        incarnation=lease.incarnation, check=lease.check)
        remove_abandoned_locations(job_path, storage, lease.check, own_location)


def savepoint_files(cc: CompletedCheckpoint) -> list[str]:
    """The URLs of the files ``cc`` names that lie in a savepoint's directory
    (``{base}/{job}/savepoint-*/``): the user's, never the job's to delete."""
    base = split_metadata_url(cc.metadata_url)[0].rstrip("/") + "/"
    out = []
    for url in cc.files.values():
        parts = url[len(base):].split("/") if url.startswith(base) else []
        if len(parts) >= 3 and parts[1].startswith(SAVEPOINT_PREFIX):
            out.append(url)
    return out


def materialize_now(backends: list[ChangelogKeyedStateBackend]) -> None:
    """Materialize every backend at once and wait: after a NO_CLAIM or savepoint restore
    the first checkpoint must not depend on the foreign files."""
    for b in backends:
        b.materialize_now()
