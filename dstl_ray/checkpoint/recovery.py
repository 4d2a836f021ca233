"""Recovery, rescaling and orphan cleanup (FLIP-158 "Recovery and rescaling", "Cleanup after
recovery"; Flink's CLAIM / NO_CLAIM restore modes).

Restore reads checkpoint metadata, assigns the new key group ranges (Flink's formula), and builds
one backend per subtask from every old snapshot whose range intersects its own: materialized
state first, then changelog replay filtered by key group and sqn.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import DstlError, HandleError, KeyGroupError, RestoreError, StorageError
from ..keygroups import key_group_range_for_subtask
from ..state.backend import ChangelogKeyedStateBackend, RestoreSource
from ..storage.base import Storage, join, normalize_url
from ..storage.registry import get_storage
from .snapshot import METADATA_FILE, CheckpointMetadata, split_metadata_url

log = logging.getLogger(__name__)
_CHK = re.compile(r"/chk-(\d+)/" + METADATA_FILE + "$")
SAVEPOINT_PREFIX = "savepoint-"  # a savepoint's directory, directly under its job's
# (``savepoint-{random}`` since savepoints stopped taking their name from the checkpoint
# counter, ``savepoint-{n}`` before: both are recognized)
_SAVEPOINT_DIR = re.compile("^/(" + SAVEPOINT_PREFIX + "[^/]+)/")


@dataclass(frozen=True)
class CompletedCheckpoint:
    """A complete checkpoint or savepoint: its metadata, where it lives, the files it uses."""

    checkpoint_id: int
    metadata_url: str
    metadata: CheckpointMetadata
    files: dict[str, str] = field(hash=False, compare=False)  # name -> URL
    metadata_size: int = 0

    @property
    def is_savepoint(self) -> bool:
        return self.metadata.kind == "savepoint"


def load_checkpoint(metadata_url: str, storage: Storage | None = None) -> CompletedCheckpoint:
    """Read and validate ``{...}/_metadata``; errors name the checkpoint."""
    url = normalize_url(metadata_url)
    if not url.endswith("/" + METADATA_FILE):
        url = join(url, METADATA_FILE)
    st = storage or get_storage(url)
    try:
        text = st.read_file(url)
        meta = CheckpointMetadata.from_json(text, url)
    except (StorageError, HandleError, KeyGroupError) as e:
        raise RestoreError(f"cannot read checkpoint metadata {url}: {e}", checkpoint=url,
                           path=url) from e
    return CompletedCheckpoint(meta.checkpoint_id, url, meta, meta.files(url), len(text))


def list_checkpoints(job_path: str, storage: Storage | None = None) -> list[tuple[int, str]]:
    """(id, metadata URL) of every ``chk-n/_metadata`` in the job directory, oldest first."""
    st = storage or get_storage(job_path)
    out = []
    for url in st.list_files(job_path):
        m = _CHK.search(url)
        if m and url.startswith(job_path + "/"):
            out.append((int(m.group(1)), url))
    return sorted(out)


def assign_sources(checkpoint: CompletedCheckpoint, operator_id: str, parallelism: int
                   ) -> list[list[RestoreSource]]:
    """For each new subtask, the old snapshots of ``operator_id`` overlapping its range."""
    meta = checkpoint.metadata
    base, own_dir = split_metadata_url(checkpoint.metadata_url)
    out: list[list[RestoreSource]] = []
    for i in range(parallelism):
        kgr = key_group_range_for_subtask(meta.max_parallelism, parallelism, i)
        out.append([RestoreSource(s, base, own_dir, checkpoint.metadata_url,
                                  checkpoint.checkpoint_id)
                    for s in meta.snapshots
                    if s.operator_id == operator_id and s.key_group_range.intersect(kgr)])
    return out


def restore_backends(client: Any, checkpoint: CompletedCheckpoint | None, operator_id: str,
                     parallelism: int, max_parallelism: int, **backend_options: Any
                     ) -> list[ChangelogKeyedStateBackend]:
    """One backend per subtask of ``parallelism``, restored from ``checkpoint`` (or empty).

    Raises :class:`RestoreError` naming the checkpoint and the file if a referenced file is
    missing or corrupt; no writer is left open in that case."""
    if checkpoint is not None and checkpoint.metadata.max_parallelism != max_parallelism:
        raise RestoreError(f"checkpoint {checkpoint.metadata_url} has max_parallelism "
                           f"{checkpoint.metadata.max_parallelism}, the job uses "
                           f"{max_parallelism}", checkpoint=checkpoint.metadata_url)
    sources: Sequence[list[RestoreSource]] = (
        assign_sources(checkpoint, operator_id, parallelism) if checkpoint is not None
        else [[] for _ in range(parallelism)])
    backends: list[ChangelogKeyedStateBackend] = []
    try:
        for i in range(parallelism):
            kgr = key_group_range_for_subtask(max_parallelism, parallelism, i)
            backends.append(ChangelogKeyedStateBackend(client, operator_id, kgr, max_parallelism,
                                                       restore=sources[i], **backend_options))
    except BaseException:
        for b in backends:
            b.close()
        raise
    return backends


def cleanup_orphans(job_path: str, keep: set[str], storage: Storage | None = None,
                    candidates: Sequence[str] | None = None,
                    check: Callable[[], None] | None = None) -> list[str]:
    """FLIP-158 "Cleanup after recovery": delete every file under the job directory that is
    not in ``keep`` (URLs) and not part of a complete savepoint. Run before checkpointing
    (re)starts, so no new pending file can be removed. ``candidates``: a listing of the job
    directory taken before the restore wrote anything (default: list it now); files created
    after it are never touched. ``check`` (the job lease's) runs before every delete and
    stops the cleanup by raising: a driver fenced midway deletes nothing more."""
    st = storage or get_storage(job_path)
    files = list(candidates) if candidates is not None else st.list_files(job_path)
    complete_savepoints = {m.group(1) for u in files if u.endswith("/" + METADATA_FILE)
                           and (m := _SAVEPOINT_DIR.search(u[len(job_path):]))}
    deleted = []
    for url in files:
        if url in keep:
            continue
        m = _SAVEPOINT_DIR.search(url[len(job_path):])
        if m and m.group(1) in complete_savepoints:
            continue
        if check is not None:
            check()
        try:
            st.delete(url)
            deleted.append(url)
        except DstlError as e:
            log.warning("orphan cleanup cannot delete %s: %s", url, e)
    if deleted:
        log.info("orphan cleanup deleted %d files under %s", len(deleted), job_path)
    return deleted
