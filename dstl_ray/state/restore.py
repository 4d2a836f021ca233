"""Restoring a keyed state backend from snapshots (FLIP-158 "Recovery and rescaling").

A backend starts from the components of one or more snapshots (a checkpoint after a failover,
several after a rescale, or a savepoint): materialized state first, then the changelog, each
filtered to the backend's key groups and, for the changelog, to the changes after the
materialized sqn (the handle filters by sqn). The restored components stay the backend's base
until its first materialization, so its snapshots name them meanwhile.

With file merging (FLIP-306 4.5), the segments of the backend's own directory are taken over;
state from any other directory means a rescale, after which the backend writes its own copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import (
    FormatError,
    HandleError,
    LocalStateError,
    RestoreError,
    StateError,
    StorageError,
)
from ..format.incremental import RocksDBHandle, UploadedFile
from ..format.materialized import MaterializedHandle
from ..keygroups import KeyGroupRange
from ..merging.pool import SubtaskFileManager
from ..storage.base import join, normalize_url
from .records import StateKind, check_stamps
from .snapshot import Component, KeyedStateSnapshot, component_changes, component_files, restricted
from .table import StateTable
from .ttl import spec_ttl


@dataclass(frozen=True)
class RestoreSource:
    """A snapshot to restore from, with where its files live and its name for errors."""

    snapshot: KeyedStateSnapshot
    base_path: str
    own_dir: str
    checkpoint: str  # e.g. the metadata URL
    checkpoint_id: int = -1  # its id (-1: unknown), for taking merged files over


@dataclass(frozen=True)
class RestoredState:
    """What a restore leaves besides the filled tables."""

    components: tuple[Component, ...]  # restricted to our key groups: the backend's base
    files: dict[str, str]  # file name -> URL of every file those components name
    foreign: bool  # materialized state came from elsewhere (a rescale: write our own copy)
    # SST files of the database the table opened, if they lie in this job's directory:
    # uploaded already (a new handle names them, relative to the job directory, again)
    uploaded: dict[str, UploadedFile]


def restore_state(sources: Sequence[RestoreSource], key_group_range: KeyGroupRange, job_id: str,
                  register_state: Callable[[str, StateKind, int | None, str | None], int],
                  table: StateTable, merging: SubtaskFileManager | None,
                  job_path: str | None = None) -> RestoredState:
    """Apply every source's changes in ``key_group_range`` to ``table``.

    ``register_state`` maps a state name, kind, TTL (ms, None without; values of a TTL
    state carry timestamps) and schema (the declared type's DDL, DROPPED for a dropped
    state's place, None when untyped) to its id, adding a new state to ``table`` (the
    backend's own registration, so restored and later states share ids). A file that
    cannot be read or decoded raises :class:`RestoreError` naming the checkpoint and the
    file.

    ``job_path``: this job's directory. SST files the table opened as its database count as
    uploaded only if they lie there: a checkpoint of a job with the same id in another
    checkpoint directory names files this job's handles cannot name (their paths are
    relative to the job directory)."""
    own_root = normalize_url(job_path) if job_path is not None else None
    base: list[Component] = []
    files_of_base: dict[str, str] = {}
    foreign = False
    uploaded: dict[str, UploadedFile] = {}
    for src in sources:
        # a restored component may cover more key groups than the snapshot holding it
        # (a backend restored after rescaling): only the snapshot's own range counts
        want = src.snapshot.key_group_range.intersect(key_group_range)
        if want is None:
            continue
        for comp in src.snapshot.components:
            mine = comp.key_group_range.intersect(want)
            if mine is None:
                continue
            files = component_files(comp, src.base_path, src.own_dir)
            try:
                # (a typed state's schema, or DROPPED for a dropped state's place)
                sid_map = [register_state(s[0], StateKind(s[1]), spec_ttl(s),
                                          s[3] if len(s) > 3 else None)  # type: ignore[misc]
                           for s in comp.states]
                if isinstance(comp, RocksDBHandle):  # its files may become our database
                    got = table.load_incremental(comp, src.base_path, mine, sid_map)
                    if got is not None:  # the database is this handle's now, and only its
                        uploaded = dict(got) if _ours(comp.job, src, job_id, own_root) else {}
                else:
                    # each file through its own URL's storage: the checkpoint may live on
                    # another file system than this job (a savepoint restored elsewhere)
                    stamped = frozenset(i for i, spec in enumerate(comp.states)
                                        if spec_ttl(spec) is not None)
                    for kg, recs in component_changes(comp, src.base_path, src.own_dir, mine):
                        if stamped:
                            recs = list(recs)
                            check_stamps(recs, stamped)
                        table.apply_records(recs, kg, sid_map)
            except LocalStateError:
                raise  # the local table failed (a full disk), not the checkpoint's files
            except (FormatError, StorageError, HandleError, StateError) as e:
                path = getattr(e, "path", None) or next(
                    (u for u in files.values() if u in str(e)), ", ".join(files.values()))
                raise RestoreError(f"cannot restore checkpoint {src.checkpoint}: file "
                                   f"{path}: {e}", checkpoint=src.checkpoint,
                                   path=path) from e
            base.append(restricted(comp, mine))
            files_of_base.update(files)
            if merging is not None and isinstance(comp, MaterializedHandle):
                # a segment is taken over only if it lies in this very job directory: a
                # copy's (a backup's) segment of the same relative path is another file,
                # and adopted it would free the job's own one under the watermark
                if _ours(comp.job, src, job_id, own_root) and merging.owns(comp.path):
                    merging.adopt(comp.path, comp.offset, comp.size, src.checkpoint_id)
                else:
                    foreign = True
    return RestoredState(tuple(base), files_of_base, foreign, uploaded)


def _ours(job: str | None, src: RestoreSource, job_id: str, own_root: str | None) -> bool:
    """A component naming its files relative to job directory ``job`` of ``src``'s base
    path names files of this job's directory ``own_root`` (both normalized): same job id
    AND same base path. A job of the same id under another base path (a copy of the job's
    directory) has files of the same relative paths that are not this job's."""
    return (job is not None and job == job_id and own_root is not None
            and normalize_url(join(src.base_path, job)) == own_root)
