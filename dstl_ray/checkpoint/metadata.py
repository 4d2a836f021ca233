"""Checkpoint metadata (FLIP-158 "Performing a checkpoint"): ``{base}/{job}/chk-{n}/_metadata``,
the one file that makes a checkpoint complete, collecting every backend's snapshot
(:mod:`dstl_ray.state.snapshot`). Versioned JSON, never pickle; every path in it is validated
on read (the snapshots' own checks), so a metadata file cannot steer reads or deletes outside
the base path.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from ..errors import DstlError, HandleError, StorageError
from ..format.materialized import parse_job
from ..format.segment import loads, non_negative_int, show
from ..key_hashes import BLAKE2B, key_hash_named
from ..state.json_memo import json_list, json_with
from ..state.snapshot import KeyedStateSnapshot
from ..storage.base import Storage, normalize_url
from ..storage.registry import get_storage

log = logging.getLogger(__name__)

METADATA_VERSION = 1
# a checkpoint filed by a key hash other than blake2b (dstl_ray.key_hashes): a version that
# knows no key hashes refuses it, rather than look its keys up in blake2b's key groups
KEY_HASH_VERSION = 2
METADATA_FILE = "_metadata"
MAX_CHECKPOINT_ID = (1 << 63) - 1  # a Flink long


def parse_timestamp(ts: object) -> float:
    """A finite JSON number (epoch seconds); anything else raises :class:`HandleError`."""
    if isinstance(ts, (int, float)) and not isinstance(ts, bool):
        try:
            value = float(ts)
        except OverflowError:
            value = math.inf
        if math.isfinite(value):
            return value
    raise HandleError(f"bad checkpoint timestamp {show(ts)}")


def split_metadata_url(url: str) -> tuple[str, str]:
    """``{base}/{job}/{dir}/_metadata`` -> (base, ``{base}/{job}/{dir}``)."""
    own_dir = url.rsplit("/", 1)[0]
    base = own_dir.rsplit("/", 2)[0]
    return base, own_dir


def delete_metadata(metadata_url: str) -> None:
    """Delete a checkpoint's ``_metadata``, then its directory if nothing else is in it
    (Flink disposes of a discarded checkpoint's exclusive directory too): on a file system
    with directories, one empty ``chk-n`` per checkpoint would otherwise pile up forever,
    and every listing of the job (orphan cleanup, the registry) walks them all."""
    storage = get_storage(metadata_url)
    storage.delete(metadata_url)
    remove_checkpoint_dir(storage, metadata_url)


def remove_checkpoint_dir(storage: Storage, metadata_url: str) -> None:
    """Remove the directory of a deleted ``_metadata`` if nothing else is in it (on a
    storage with directories: ``delete_dir``). Best effort: a directory left over costs a
    listing entry, not a checkpoint."""
    remove_dir = getattr(storage, "delete_dir", None)
    if remove_dir is not None:
        try:
            remove_dir(split_metadata_url(metadata_url)[1])
        except StorageError as e:
            log.warning("cannot remove the directory of %s: %s", metadata_url, e)


@dataclass(frozen=True)
class CheckpointMetadata:
    """Everything needed to restore a checkpoint or savepoint; stored as ``_metadata``."""

    job_id: str
    checkpoint_id: int
    kind: str  # "checkpoint" | "savepoint"
    max_parallelism: int
    snapshots: tuple[KeyedStateSnapshot, ...]
    timestamp: float = field(default_factory=time.time)
    # the writer's incarnation epoch (checkpoint/lease.py; 0: unknown, an older version's):
    # a file of an older epoch at a checkpoint's path is another incarnation's late write
    epoch: int = 0
    # how the job's keys became key groups (dstl_ray.key_hashes): named in the file unless it
    # is blake2b, so a file without one (every version before) means blake2b
    key_hash: str = BLAKE2B.name

    def to_json(self) -> str:
        named = self.key_hash != BLAKE2B.name  # (an older reader refuses version 2 whole)
        head: dict[str, object] = {
            "type": "dstl-checkpoint", "version": KEY_HASH_VERSION if named else METADATA_VERSION,
            "job": self.job_id, "id": self.checkpoint_id, "kind": self.kind,
            "max_parallelism": self.max_parallelism, "timestamp": self.timestamp,
            "epoch": self.epoch}
        if named:
            head["key_hash"] = self.key_hash
        return json_with(head, snapshots=json_list(s.to_json() for s in self.snapshots))

    @classmethod
    def from_json(cls, text: str | bytes, metadata_url: str) -> CheckpointMetadata:
        base, _ = split_metadata_url(normalize_url(metadata_url))
        d = loads(text, "checkpoint metadata")
        if not isinstance(d, dict) or d.get("type") != "dstl-checkpoint":
            raise HandleError("not a dstl checkpoint metadata file")
        if d.get("version") not in (METADATA_VERSION, KEY_HASH_VERSION) or (
                d.get("version") == KEY_HASH_VERSION) != ("key_hash" in d):
            raise HandleError(f"unsupported checkpoint metadata version {show(d.get('version'))}"
                              f" (version {KEY_HASH_VERSION} and only it names a key hash)")
        cid, maxp, kind, ts = d.get("id"), d.get("max_parallelism"), d.get("kind"), \
            d.get("timestamp", 0.0)
        if non_negative_int("checkpoint id", cid) > MAX_CHECKPOINT_ID:
            raise HandleError(f"checkpoint id {cid} exceeds {MAX_CHECKPOINT_ID}")
        if not isinstance(maxp, int) or isinstance(maxp, bool) or not 0 < maxp <= 1 << 15:
            raise HandleError(f"bad max_parallelism {show(maxp)}")
        if kind not in ("checkpoint", "savepoint"):
            raise HandleError(f"bad checkpoint kind {show(kind)}")
        job = parse_job(d.get("job"))
        if job is None:
            raise HandleError("checkpoint metadata names no job")
        snaps = d.get("snapshots")
        if not isinstance(snaps, list):
            raise HandleError("snapshots must be a list")
        try:
            key_hash = key_hash_named(d.get("key_hash")).name
        except DstlError as e:  # (an unknown name, or a hash this install cannot compute)
            raise HandleError(f"checkpoint metadata: {e}") from e
        return cls(job, cid, kind, maxp,
                   tuple(KeyedStateSnapshot.from_dict(s, base) for s in snaps),
                   parse_timestamp(ts), non_negative_int("epoch", d.get("epoch", 0)),
                   key_hash)

    def files(self, metadata_url: str) -> dict[str, str]:
        """File name -> URL of every state file this checkpoint references."""
        base, own_dir = split_metadata_url(normalize_url(metadata_url))
        out: dict[str, str] = {}
        for s in self.snapshots:
            out.update(s.files(base, own_dir))
        return out
