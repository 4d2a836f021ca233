"""State changelog handles (FLIP-158 "API": ``StateChangelogHandle``).

A handle names, for one log (writer), the byte ranges of changelog files that hold its changes
in the sqn range ``(sqn_from, sqn_to]``. Several handles may refer to the same file; the shared
state registry keys files by name only (FLIP-158 "StateChangelog", point 4).

Handles are persisted as versioned JSON, never pickle, because they are read back from shared
storage; paths are relative to the job directory and may not escape it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import FormatError, HandleError
from ..format.changelog import FILE_SUFFIX, iter_blocks
from ..format.segment import Segment, loads, show
from ..keygroups import KeyGroupRange
from ..storage.base import Storage, join, normalize_url
from ..storage.registry import get_storage

HANDLE_VERSION = 1


@dataclass(frozen=True)
class StateChangelogHandle:
    """Changes of one log in ``(sqn_from, sqn_to]``, stored in ``segments``."""

    job_path: str  # URL of {base}/{job}
    log_id: str  # 32 hex digits
    key_group_range: KeyGroupRange
    sqn_from: int  # exclusive ("after")
    sqn_to: int  # inclusive
    segments: tuple[Segment, ...] = field(default=())

    # ----------------------------------------------------------------------- inspection

    def file_paths(self) -> list[str]:
        """Full URLs of the files this handle refers to (no duplicates)."""
        base = self.job_path.rstrip("/") + "/"  # join(job_path, path), once per handle
        return list(dict.fromkeys([base + s.path.strip("/") for s in self.segments]))

    @property
    def state_size(self) -> int:
        return sum(s.length for s in self.segments)

    def is_empty(self) -> bool:
        return not self.segments

    # ----------------------------------------------------------------------- reading

    def _storage(self, storage: Storage | None) -> Storage:
        return storage if storage is not None else get_storage(self.job_path)

    def iter_changesets(self, storage: Storage | None = None
                        ) -> Iterator[tuple[int, int, tuple[bytes, ...]]]:
        """Every (key group, sqn, values) in range, read segment by segment, each byte range
        once. Order within a key group is by sqn only after :meth:`read_all` sorts it."""
        st = self._storage(storage)
        want = bytes.fromhex(self.log_id)
        for seg in self.segments:
            path = join(self.job_path, seg.path)
            data = st.read_range(path, seg.offset, seg.length)
            if len(data) != seg.length:
                raise FormatError(
                    f"segment is torn: wanted {seg.length} bytes, file has {len(data)}",
                    path=path, offset=seg.offset)
            for block in iter_blocks(data, base_offset=seg.offset, path=path):
                if block.log_id != want:
                    raise FormatError(f"block belongs to log {block.log_id.hex()}, handle is "
                                      f"for {self.log_id}", path=path, offset=block.offset)
                for sqn, values in block.changesets:
                    if self.sqn_from < sqn <= self.sqn_to and seg.sqn_min <= sqn <= seg.sqn_max:
                        yield block.key_group, sqn, values

    def read_all(self, storage: Storage | None = None,
                 key_groups: KeyGroupRange | None = None) -> dict[int, list[bytes]]:
        """Every change in range, per key group, in append order (sorted by sqn, a changeset
        that several segments hold counted once)."""
        per_kg: dict[int, dict[int, tuple[bytes, ...]]] = {}
        for kg, sqn, values in self.iter_changesets(storage):
            if key_groups is not None and kg not in key_groups:
                continue
            per_kg.setdefault(kg, {}).setdefault(sqn, values)
        out: dict[int, list[bytes]] = {}
        for kg, by_sqn in per_kg.items():
            lst: list[bytes] = []
            for sqn in sorted(by_sqn):
                lst.extend(by_sqn[sqn])
            out[kg] = lst
        return out

    def get_state_changes(self, key_group: int, storage: Storage | None = None
                          ) -> Iterator[bytes]:
        """The changes of ``key_group`` in append order, filtered to this handle's sqn range."""
        if key_group not in self.key_group_range:
            return iter(())
        return iter(self.read_all(storage, KeyGroupRange(key_group, key_group))
                    .get(key_group, []))

    # ----------------------------------------------------------------------- JSON

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "dstl-changelog-handle", "version": HANDLE_VERSION,
            "job_path": self.job_path, "log_id": self.log_id,
            "key_groups": self.key_group_range.to_json(),
            "sqn": [self.sqn_from, self.sqn_to],
            "segments": [s.to_json() for s in self.segments],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, d: object, expected_job_path: str | None = None) -> StateChangelogHandle:
        if not isinstance(d, dict) or d.get("type") != "dstl-changelog-handle":
            raise HandleError("not a dstl changelog handle")
        if d.get("version") != HANDLE_VERSION:
            raise HandleError(f"unsupported handle version {show(d.get('version'))} "
                              f"(this reader knows {HANDLE_VERSION})")
        try:
            job_path = d["job_path"]
            log_id = d["log_id"]
            kgr = KeyGroupRange.from_json(d["key_groups"])
            sqn_from, sqn_to = d["sqn"]
            segments = tuple(Segment.from_json(s) for s in d["segments"])
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, HandleError):
                raise
            raise HandleError(f"malformed handle: {e}") from None
        if not isinstance(job_path, str) or "://" not in job_path:
            raise HandleError(f"handle job_path must be a URL, got {show(job_path)}")
        # kept normalized: file URLs built from it must be the ones a listing shows (orphan
        # cleanup compares them), and "a//b" or "a/x/.." must not reach the file system
        job_path = normalize_url(job_path)
        if expected_job_path is not None and job_path != normalize_url(expected_job_path):
            raise HandleError(f"handle points to {show(job_path)}, outside the job's base "
                              f"path {expected_job_path}")
        if not isinstance(log_id, str) or not re.fullmatch(r"[0-9a-f]{32}", log_id):
            raise HandleError(f"bad log id {show(log_id)}")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (sqn_from, sqn_to)) \
                or not 0 <= sqn_from <= sqn_to:
            raise HandleError(f"bad sqn range {show(d['sqn'])}")
        for s in segments:
            if not s.path.endswith(FILE_SUFFIX):
                raise HandleError(f"segment path {s.path!r} is not a {FILE_SUFFIX} file")
        return cls(job_path, log_id, kgr, sqn_from, sqn_to, segments)

    @classmethod
    def from_json(cls, text: str | bytes, expected_job_path: str | None = None
                  ) -> StateChangelogHandle:
        return cls.from_dict(loads(text, "handle"), expected_job_path)
