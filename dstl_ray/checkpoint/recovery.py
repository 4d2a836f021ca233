"""Recovery, rescaling and orphan cleanup (FLIP-158 "Recovery and rescaling", "Cleanup after
recovery"; Flink's CLAIM / NO_CLAIM restore modes).

Restore reads checkpoint metadata, assigns the new key group ranges (Flink's formula), and builds
one backend per subtask from every old snapshot whose range intersects its own: materialized
state first, then changelog replay filtered by key group and sqn.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, DstlError, HandleError, KeyGroupError, RestoreError, StorageError
from ..key_hashes import key_hash_named
from ..keygroups import key_group_range_for_subtask
from ..state.backend import ChangelogKeyedStateBackend, RestoreSource
from ..storage.base import Storage, join, normalize_url
from ..storage.registry import get_storage
from ..transport.sender import Incarnation
from .metadata import METADATA_FILE, CheckpointMetadata, remove_checkpoint_dir, split_metadata_url

log = logging.getLogger(__name__)
_CHK = re.compile(r"/chk-(\d+)/" + METADATA_FILE + "$")
SAVEPOINT_PREFIX = "savepoint-"  # a savepoint's directory, directly under its job's
# (``savepoint-{random}`` since savepoints stopped taking their name from the checkpoint
# counter, ``savepoint-{n}`` before: both are recognized)
_SAVEPOINT_DIR = re.compile("^/(" + SAVEPOINT_PREFIX + "[^/]+)/")
SAVEPOINT_MARKER = "_savepoint"  # created first in a savepoint's directory, only where absent


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
    root = normalize_url(job_path)
    st = storage or get_storage(root)
    out = []
    for url in map(normalize_url, st.list_files(root)):
        m = _CHK.search(url)
        if m and url.startswith(root + "/"):
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


def check_key_hash(checkpoint: CompletedCheckpoint, key_hash: str) -> None:
    """A :class:`ConfigError` unless ``checkpoint`` was written under ``key_hash`` (the
    restoring job's, dstl_ray.key_hashes): under another hash its keys would be looked up in
    other key groups than their state is in, and the state would seem gone. Not a
    :class:`RestoreError`: a restore with ``fallback`` must not skip to older checkpoints."""
    if checkpoint.metadata.key_hash != key_hash:
        raise ConfigError(f"checkpoint {checkpoint.metadata_url} files keys by the key hash "
                          f"{checkpoint.metadata.key_hash}, the job uses {key_hash}: its "
                          f"state would not be found under the job's keys")


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
    kind = backend_options.get("key_hash")
    if isinstance(kind, str) or kind is None:  # (by name too)
        backend_options = {**backend_options, "key_hash": key_hash_named(kind)}
    if checkpoint is not None and parallelism:  # (none: the job's start loads the list)
        check_key_hash(checkpoint, backend_options["key_hash"].name)
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
                    incarnation: Incarnation | None = None,
                    check: Callable[[], None] | None = None) -> list[str]:
    """FLIP-158 "Cleanup after recovery": delete every file under the job directory that is
    not in ``keep`` (URLs) and not part of a savepoint. Run before checkpointing (re)starts,
    so no new pending file can be removed. ``candidates``: a listing of the job directory
    taken before the restore wrote anything (default: list it now); files created after it
    are never touched. Every URL is compared in its normalized form.

    A savepoint directory with a ``_metadata`` is complete: the user's, never touched. One
    without is a savepoint in progress or the remains of one whose driver lost the job. Its
    marker names the incarnation that wrote it (``incarnation``: the one running this
    cleanup, the lease's holder): a marker of this incarnation or a newer one is a savepoint
    still running, spared; one of an older incarnation, or without an incarnation, or no
    marker at all, goes (its driver lost the job and can no longer write its
    ``_metadata``: it checks its lease first). Ages are never judged by a clock. Without
    ``incarnation`` every directory with a marker is spared. ``check`` (the job lease's) runs
    before every delete and stops the cleanup by raising: a driver fenced midway deletes
    nothing more."""
    st = storage or get_storage(job_path)
    root = normalize_url(job_path)
    listed = list(candidates) if candidates is not None else st.list_files(root)
    files = [normalize_url(u) for u in listed]
    keep_urls = {normalize_url(u) for u in keep}
    spared = _savepoints_to_keep(root, files, st, incarnation)
    deleted = []
    for url in files:
        if url in keep_urls:
            continue
        m = _SAVEPOINT_DIR.search(url[len(root):]) if url.startswith(root + "/") else None
        if m and m.group(1) in spared:
            continue
        if check is not None:
            check()
        try:
            st.delete(url)
            deleted.append(url)
        except DstlError as e:
            log.warning("orphan cleanup cannot delete %s: %s", url, e)
            continue
        if url.endswith("/" + METADATA_FILE):  # a subsumed one whose discard never ran
            remove_checkpoint_dir(st, url)
    if deleted:
        log.info("orphan cleanup deleted %d files under %s", len(deleted), root)
    return deleted


def _savepoints_to_keep(root: str, files: Sequence[str], storage: Storage,
                        incarnation: Incarnation | None) -> set[str]:
    """Names of the savepoint directories under job directory ``root`` (``files``: its
    normalized listing) that orphan cleanup must not touch: complete ones, and those in
    progress by ``incarnation`` or a newer one (see :func:`cleanup_orphans`)."""
    dirs: dict[str, set[str]] = {}
    for url in files:
        m = _SAVEPOINT_DIR.search(url[len(root):]) if url.startswith(root + "/") else None
        if m:
            dirs.setdefault(m.group(1), set()).add(url[len(root) + len(m.group(0)):])
    keep = set()
    for name, inside in dirs.items():
        directory = join(root, name)
        if METADATA_FILE in inside:
            keep.add(name)
            continue
        if SAVEPOINT_MARKER not in inside:
            continue  # parts are written after the marker only: remains of a failed one
        try:
            if storage.exists(join(directory, METADATA_FILE)):
                keep.add(name)  # completed since the listing
                continue
            writer = marker_incarnation(storage.read_file(join(directory, SAVEPOINT_MARKER)))
        except StorageError as e:  # never delete on doubt: the next recovery tries again
            log.warning("orphan cleanup keeps savepoint directory %s: %s", directory, e)
            keep.add(name)
            continue
        if incarnation is None or (writer is not None and writer.epoch >= incarnation.epoch):
            keep.add(name)
    return keep


def savepoint_marker(job_id: str, checkpoint_id: int, incarnation: str) -> bytes:
    """The content of a savepoint directory's marker ``_savepoint``: whose directory it is
    and which incarnation of the job writes the savepoint (orphan cleanup spares a savepoint
    in progress of a current incarnation)."""
    return json.dumps({"type": "dstl-savepoint", "job": job_id, "id": checkpoint_id,
                       "incarnation": incarnation}, sort_keys=True).encode()


def marker_incarnation(data: bytes) -> Incarnation | None:
    """The incarnation a marker names; None for a marker without one (written before
    markers named it) or one that does not parse."""
    try:
        rec = json.loads(data)
        return Incarnation.parse(str(rec.get("incarnation") or "")) if isinstance(
            rec, dict) else None
    except (ValueError, DstlError):
        return None
