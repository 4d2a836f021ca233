"""Backend snapshots (FLIP-158 "Performing a checkpoint"): what a state backend hands to a
checkpoint, and restores from (Flink's ``KeyedStateHandle``, which lives with the state
backends too; the checkpoint's ``_metadata`` that collects them is
:mod:`dstl_ray.checkpoint.metadata`).

The snapshot of one backend is an ordered list of components: the materialized state (or,
before the first materialization after a restore, the components it was restored from) and
the changelog handle for the changes after the last materialized sqn. Restore applies them in
order, each filtered to the new key group range.

Snapshots are versioned JSON inside the metadata, never pickle. Files are named by paths
relative to a job directory (``job``) under the base path, or relative to the metadata's own
directory (``job: null``, self-contained savepoints); every path is validated on read so a
snapshot cannot steer reads or deletes outside the base path.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import HandleError
from ..format.incremental import RocksDBHandle
from ..format.materialized import (
    SHARED_DIR,
    MaterializedHandle,
    StatesSpec,
    parse_job,
    parse_states,
    read_sections,
    states_json,
)
from ..format.segment import check_relative_path, loads, show
from ..keygroups import KeyGroupRange
from ..log.handle import StateChangelogHandle
from ..storage.base import Storage, join
from ..storage.registry import get_storage
from .incremental import read_changes
from .json_memo import TextMemo, compact_json, json_list, json_with

log = logging.getLogger(__name__)

def file_name(url: str) -> str:
    """The shared state registry key: the file name only (FLIP-158 "StateChangelog", 4)."""
    return url.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class ChangelogComponent:
    """Changes of one log after its backend's last materialization."""

    job: str
    states: StatesSpec
    handle: StateChangelogHandle
    restrict: KeyGroupRange | None = None  # only these key groups count (after a rescale)

    @property
    def key_group_range(self) -> KeyGroupRange:
        return self.restrict or self.handle.key_group_range

    def to_dict(self) -> dict[str, Any]:
        d = {"type": "changelog", "job": self.job, "states": states_json(self.states),
             "handle": self.handle.to_dict()}
        if self.restrict is not None:
            d["restrict"] = self.restrict.to_json()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], base_path: str) -> ChangelogComponent:
        job = parse_job(d.get("job"))
        if job is None:
            raise HandleError("a changelog component must name its job directory")
        handle = StateChangelogHandle.from_dict(d.get("handle"),
                                                expected_job_path=join(base_path, job))
        restrict = d.get("restrict")
        kgr = KeyGroupRange.from_json(restrict) if restrict is not None else None
        if kgr is not None and kgr.intersect(handle.key_group_range) != kgr:
            raise HandleError(f"changelog component restricted to {kgr.start}..{kgr.end}, "
                              f"outside its handle's key groups")
        return cls(job, parse_states(d.get("states")), handle, kgr)


Component = MaterializedHandle | ChangelogComponent | RocksDBHandle


def component_files(c: Component, base_path: str, own_dir: str) -> dict[str, str]:
    """File name -> URL of every file ``c`` refers to."""
    if isinstance(c, MaterializedHandle):
        url = c.url(base_path, own_dir)
        return {file_name(url): url}
    if isinstance(c, RocksDBHandle):
        return {file_name(u): u for u in c.urls(base_path)}
    return {file_name(u): u for u in c.handle.file_paths()}


def component_size(c: Component) -> int:
    """Bytes of state ``c`` names: its section of a materialized file, its RocksDB files, or
    its changelog segments (Flink's "checkpointed data size", full, not incremental)."""
    if isinstance(c, ChangelogComponent):
        return c.handle.state_size
    return c.size


def component_changes(c: Component, base_path: str, own_dir: str, key_groups: KeyGroupRange,
                      storage: Storage | None = None
                      ) -> Iterator[tuple[int, Iterable[bytes]]]:
    """(key group, change records) of ``c`` within ``key_groups``, read from its files: the
    reading half of a restore (FLIP-158 "Recovery and rescaling"), shared by the backend and
    the fuzzers. ``storage`` defaults to the one of each file's URL."""
    if isinstance(c, MaterializedHandle):
        url = c.url(base_path, own_dir)
        yield from read_sections(storage or get_storage(url), url, c, key_groups)
    elif isinstance(c, RocksDBHandle):
        yield from read_changes(c, base_path, key_groups, storage)
    else:
        yield from c.handle.read_all(storage, key_groups=key_groups).items()


def restricted(c: Component, key_groups: KeyGroupRange) -> Component:
    """``c`` limited to ``key_groups`` (which must lie within its range)."""
    if c.key_group_range == key_groups:
        return c
    if isinstance(c, MaterializedHandle):
        return dataclasses.replace(c, key_group_range=key_groups, sections=tuple(
            s for s in c.sections if s[0] in key_groups))
    if isinstance(c, RocksDBHandle):  # its files keep every key group; readers filter
        return dataclasses.replace(c, key_group_range=key_groups)
    return dataclasses.replace(c, restrict=key_groups)


_ENCODED = TextMemo()  # components' JSON text, for every snapshot of this process


def component_json(c: Component) -> str:
    """``c``'s JSON text (compact, keys sorted), made once while it is kept."""
    return _ENCODED.text(c, lambda x: compact_json(x.to_dict()))


def component_from_dict(d: object, base_path: str) -> Component:
    if not isinstance(d, dict):
        raise HandleError(f"component must be an object, got {type(d).__name__}")
    if d.get("type") == "materialized":
        return MaterializedHandle.from_dict(d)
    if d.get("type") == "changelog":
        return ChangelogComponent.from_dict(d, base_path)
    if d.get("type") == "rocksdb":
        return RocksDBHandle.from_dict(d)
    raise HandleError(f"unknown component type {show(d.get('type'))}")


@dataclass(frozen=True)
class KeyedStateSnapshot:
    """Snapshot of one backend (one subtask of one operator)."""

    operator_id: str
    key_group_range: KeyGroupRange
    components: tuple[Component, ...] = ()
    # FLIP-306 "DirectoryStateHandle": the subtask's directory of merged files, relative to
    # the job directory; its files belong to the subtask, the directory to the coordinator
    owned_dir: str | None = None
    # the largest event time (ms since the epoch) the operator had seen when the subtask
    # took this snapshot: where an event-time watermark resumes after a restart (Spark keeps
    # its watermark in its offset log for the same reason); None: no event time
    event_time_ms: int | None = None
    # the processing time (ms) its micro-batch ran at: a replay of the batch runs at it again
    processing_time_ms: int | None = None

    def _fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {"operator": self.operator_id,
                             "key_groups": self.key_group_range.to_json()}
        if self.owned_dir is not None:
            d["owned_dir"] = self.owned_dir
        for name in ("event_time_ms", "processing_time_ms"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d

    def to_dict(self) -> dict[str, Any]:
        return {**self._fields(), "components": [c.to_dict() for c in self.components]}

    def to_json(self) -> str:
        """``json.dumps(self.to_dict())``, each component's text made once while it is
        kept (:class:`~dstl_ray.state.json_memo.TextMemo`)."""
        return json_with(self._fields(),
                         components=json_list(component_json(c) for c in self.components))

    @classmethod
    def from_json(cls, text: str, base_path: str) -> KeyedStateSnapshot:
        """The snapshot of JSON ``text`` (:meth:`to_json`'s); :class:`HandleError` if it
        does not read."""
        return cls.from_dict(loads(text, "keyed state snapshot"), base_path)

    @classmethod
    def from_dict(cls, d: object, base_path: str) -> KeyedStateSnapshot:
        if not isinstance(d, dict) or not isinstance(d.get("operator"), str):
            raise HandleError("malformed keyed state snapshot")
        comps = d.get("components")
        if not isinstance(comps, list):
            raise HandleError("snapshot components must be a list")
        owned = d.get("owned_dir")
        if owned is not None:
            owned = check_relative_path(owned)
            if not owned.startswith(SHARED_DIR + "/"):
                raise HandleError(f"owned directory {show(owned)} is not under {SHARED_DIR}/")
        times = [d.get(name) for name in ("event_time_ms", "processing_time_ms")]
        for name, t in zip(("event_time_ms", "processing_time_ms"), times, strict=True):
            if t is not None and (isinstance(t, bool) or not isinstance(t, int)):
                raise HandleError(f"snapshot {name} must be an integer, got {t!r}")
        return cls(d["operator"], KeyGroupRange.from_json(d.get("key_groups")),
                   tuple(component_from_dict(c, base_path) for c in comps), owned, *times)

    def state_size(self) -> int:
        """Bytes of state the snapshot names (see :func:`component_size`)."""
        return sum(component_size(c) for c in self.components)

    def files(self, base_path: str, own_dir: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for c in self.components:
            out.update(component_files(c, base_path, own_dir))
        return out
