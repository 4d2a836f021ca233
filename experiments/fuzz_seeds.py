"""Valid persisted data for the fuzzers and property tests, produced by the real code, and
the restore-side reading they share (:func:`restore_reads`).

:func:`build_job` runs a small keyed job on :class:`~dstl_ray.DirectTransport` (no Ray): two
subtasks with value, list and map state, one materialization, checkpoint 1, a savepoint, then a
rescale to three subtasks and another checkpoint (whose restored components carry
``restrict``). Its files are what a restore reads: ``_metadata`` JSON, ``.dstm`` materialized
state, ``.dstl`` changelog files, and the state change records inside them. :func:`write_seeds`
turns them into one libFuzzer seed directory per target.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dstl_ray import CheckpointCoordinator, DirectTransport, StateChangelogClient, assign_key_group
from dstl_ray.checkpoint.metadata import split_metadata_url
from dstl_ray.checkpoint.recovery import assign_sources, load_checkpoint
from dstl_ray.errors import StateError, StorageError
from dstl_ray.format.changelog import read_prefixed
from dstl_ray.keygroups import key_group_range_for_subtask
from dstl_ray.state.records import StateKind, TaggedSerializer, apply_records, check_stamps
from dstl_ray.state.snapshot import ChangelogComponent, component_changes
from dstl_ray.state.ttl import STAMP_SIZE, spec_ttl
from dstl_ray.storage.base import normalize_url
from dstl_ray.storage.registry import get_storage

JOB = "fuzz"
OPERATOR = "op"
MAXP = 8
STATES = (("v", "value"), ("l", "list"), ("m", "map"))
TTL_S = 365 * 86400  # the seed job's TTL states outlive any test run
METADATA_ENV = "DSTL_FUZZ_METADATA"  # the _metadata URL the "metadata" target loads inputs as

# values of every kind the TaggedSerializer knows, nested, as keyed state holds them
VALUES: tuple[object, ...] = (
    0, -7, 2**70, 1.5, float("inf"), "x", "ünï", b"\x00\xff", None, True, False,
    [1, "a", [2.5, None]], {"k": [1, 2], 3: {"n": b"z"}, (1, (2, 3)): "tuple key"}, [], {},
)


# what a forged or damaged metadata/handle field may hold: wrong types, huge and negative
# numbers, paths that escape or leave the job directory, other schemes
EVIL: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 7, 2**31, 2**63, 2**64, -2**63, 10**40, 1.5, -0.0, 1e308, "",
    "..", "../x.dstm", "a/../../b.dstl", "/etc/passwd", "//host/x.dstm", "./x.dstm",
    "x\\..\\y.dstm", "s3://other-bucket/job", "file:///etc", "http://host/job",
    "memory://fuzz/job", "file:///tmp/../etc/x.dstl", "x.dstm", "x.dstl", "op", "value", "map",
    "a" * 300, "\u0000", [], {}, [0], [0, 7], [7, 0], [0, 32767], [0, 32768], [-1, 3],
    [[0, 12, 20]], [["v", "value"]], [["v", "value"], ["v", "list"]],
)


def json_slots(doc: Any, out: list[tuple[Any, Any]] | None = None) -> list[tuple[Any, Any]]:
    """Every (container, key or index) of a parsed JSON document, parents first."""
    out = [] if out is None else out
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((doc, k))
            json_slots(v, out)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append((doc, i))
            json_slots(v, out)
    return out


@dataclass(frozen=True)
class SeedJob:
    """Where :func:`build_job` left its files."""

    base: str  # URL of the base path
    checkpoint: str  # _metadata URL of checkpoint 1 (materialized + changelog components)
    savepoint: str  # _metadata URL of the self-contained savepoint (job: null)
    rescaled: str  # _metadata URL of the checkpoint after a rescale (restricted components)

    def files(self, suffix: str) -> list[str]:
        """URLs of every file of the job ending in ``suffix``."""
        root = f"{self.base}/{JOB}"
        return [u for u in get_storage(root).list_files(root) if u.endswith(suffix)]


def _write(backends: list, round_: int) -> None:
    """Round ``round_`` of the seed job's changes: every kind of value under value, list and
    map state, plus removes and clears, so the files hold every record op."""

    def owner(key: object) -> Any:
        return next(b for b in backends if assign_key_group(key, MAXP) in b.key_group_range)

    for i, value in enumerate(VALUES):
        key = f"k{i}" if i % 2 else i
        b = owner(key)
        if i % 4 == 0:  # states with a TTL: their values carry timestamps (state.ttl)
            b.value_state("vt", TTL_S).update(key, value)
            b.list_state("lt", TTL_S).add(key, value)
            b.map_state("mt", TTL_S).put(key, f"u{round_}", value)
        b.value_state("v").update(key, [round_, value])
        b.list_state("l").add(key, value)
        b.map_state("m").put(key, f"u{round_}", value)
        if i % 3 == 0:  # removes and clears, so the changelog holds every op
            b.map_state("m").remove(key, f"u{round_ - 1}")
            gone = owner(f"gone{i}")
            gone.value_state("v").update(f"gone{i}", i)
            gone.value_state("v").clear(f"gone{i}")
            gone.list_state("l").update(f"gone{i}", [1, 2])
            gone.map_state("m").clear(f"gone{i}")


def build_job(base: str) -> SeedJob:
    """Run the seed job under ``base`` (a URL); every file it writes stays there."""
    base = normalize_url(base)

    def client() -> StateChangelogClient:
        return StateChangelogClient(JOB, transport=DirectTransport(JOB, base))

    coord = CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=10)
    backends = coord.restore(client(), OPERATOR, 2, materialization_interval=None)
    _write(backends, 0)
    backends[0].materialize().result(timeout=60)
    _write(backends, 1)
    checkpoint = coord.trigger_checkpoint().result(timeout=60)
    savepoint = coord.trigger_savepoint().result(timeout=60)
    coord.shutdown()
    coord = CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=10)
    backends = coord.restore(client(), OPERATOR, 3, materialization_interval=None,
                             cleanup=False)
    _write(backends, 2)
    rescaled = coord.trigger_checkpoint().result(timeout=60)
    coord.shutdown()
    return SeedJob(base, checkpoint.metadata_url, savepoint.metadata_url, rescaled.metadata_url)


def records_of(job: SeedJob) -> list[bytes]:
    """Every state change record the job's files hold (materialized and changelog)."""
    out: list[bytes] = []
    for url in (job.checkpoint, job.savepoint, job.rescaled):
        cc = load_checkpoint(url)
        base, own_dir = split_metadata_url(url)
        for snap in cc.metadata.snapshots:
            for comp in snap.components:
                for _kg, recs in component_changes(comp, base, own_dir, comp.key_group_range):
                    out.extend(recs)
    return out


class BytesStorage:
    """Read-only storage over in-memory files; ``read_range`` clamps like the real ones."""

    def __init__(self, files: dict[str, bytes], fallback: Any = None) -> None:
        self.files, self.fallback = files, fallback

    def read_file(self, path: str) -> bytes:
        if path in self.files:
            return self.files[path]
        if self.fallback is None:
            raise StorageError(f"no such file {path}")
        return self.fallback.read_file(path)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if path in self.files:
            return self.files[path][offset:offset + length]
        if self.fallback is None:
            raise StorageError(f"no such file {path}")
        return self.fallback.read_range(path, offset, length)


def deserialize_tables(tables: list[dict[int, dict[bytes, Any]]], kinds: list[Any],
                       ttls: list[int | None] | None = None) -> None:
    """Decode every key and value as state access would (``ChangelogKeyedStateBackend.dump``):
    values of a TTL state (``ttls[sid]`` set) after their timestamp."""
    ser = TaggedSerializer()
    for sid, (kind, per_kg) in enumerate(zip(kinds, tables, strict=True)):
        cut = STAMP_SIZE if ttls and ttls[sid] is not None else 0

        def de(v: bytes, k: bool = False, cut: int = cut) -> Any:
            return ser.deserialize(v if k else v[cut:])

        _decode_state(kind, per_kg, de)


def _decode_state(kind: Any, per_kg: dict[int, dict[bytes, Any]], de: Any) -> None:
    for d in per_kg.values():
        for k, v in d.items():
            de(k, True)
            if kind == "value":
                de(v)
            elif kind == "list":
                for x in v:
                    de(x)
            else:
                for uk, x in v.items():
                    de(uk, True)
                    de(x)


class Tables:
    """A backend's tables and state registry, as ``_restore`` fills them."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {}
        self.kinds: list[Any] = []  # StateKind
        self.tables: list[dict[int, dict[bytes, Any]]] = []
        self.ttls: list[int | None] = []

    def sid_map(self, states: Any) -> list[int]:
        """Register ``states`` (a component's spec); their local state ids."""
        out = []
        for name, kind, *ttl in states:
            sid = self.names.get(name)
            if sid is None:
                sid = self.names[name] = len(self.kinds)
                self.kinds.append(StateKind(kind))
                self.tables.append({})
                self.ttls.append(ttl[0] if ttl else None)
            elif self.kinds[sid] is not StateKind(kind):
                raise StateError(f"state {name!r} is a {self.kinds[sid].value} state")
            out.append(sid)
        return out


def restore_reads(cc: Any, storage: Any, parallelism: int) -> list[Tables]:
    """The reading half of restoring ``cc`` (a CompletedCheckpoint) at ``parallelism``, as
    ``dstl_ray.backend_restore.restore_state`` does it: per subtask, every overlapping
    component's records applied to that subtask's tables, then every key and value
    deserialized. Raises only what the readers raise."""
    base, own_dir = split_metadata_url(cc.metadata_url)
    out = []
    for i, sources in enumerate(assign_sources(cc, OPERATOR, parallelism)):
        kgr = key_group_range_for_subtask(cc.metadata.max_parallelism, parallelism, i)
        t = Tables()
        for src in sources:
            want = src.snapshot.key_group_range.intersect(kgr)
            for comp in src.snapshot.components:
                mine = want and comp.key_group_range.intersect(want)
                if mine is None:
                    continue
                sid_map = t.sid_map(comp.states)
                stamped = frozenset(i for i, spec in enumerate(comp.states)
                                    if spec_ttl(spec) is not None)
                for kg, recs in component_changes(comp, base, own_dir, mine, storage):
                    recs = list(recs)
                    check_stamps(recs, stamped)
                    apply_records(recs, t.tables, t.kinds, kg, sid_map)
        deserialize_tables(t.tables, t.kinds, t.ttls)
        out.append(t)
    return out


def _dump(directory: str, name: str, data: bytes) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)


def write_seeds(directory: str, job: SeedJob) -> None:
    """Seed files for the "metadata", "materialized" and "records" targets, plus the job's
    changelog files and handles for "format" and "handle", one directory per target."""
    st = get_storage(job.base)
    for name, url in (("checkpoint", job.checkpoint), ("savepoint", job.savepoint),
                      ("rescaled", job.rescaled)):
        _dump(os.path.join(directory, "metadata"), f"{name}.json", st.read_file(url))
        for i, snap in enumerate(load_checkpoint(url).metadata.snapshots):
            for j, comp in enumerate(snap.components):
                if isinstance(comp, ChangelogComponent):
                    _dump(os.path.join(directory, "handle"), f"{name}-{i}-{j}.json",
                          comp.handle.to_json().encode())
    for i, url in enumerate(job.files(".dstm")):
        _dump(os.path.join(directory, "materialized"), f"state{i}.dstm", st.read_file(url))
    for i, url in enumerate(job.files(".dstl")[:8]):
        _dump(os.path.join(directory, "format"), f"job{i}.dstl", st.read_file(url))
    recs = records_of(job)
    framed = b"".join(len(r).to_bytes(4, "little") + r for r in recs)
    assert read_prefixed(framed, 0, len(framed), len(recs), "record", None, 0)[0] == recs
    _dump(os.path.join(directory, "records"), "all.bin", framed)
    for i, r in enumerate(sorted(set(recs), key=lambda r: (r[1], len(r)))[::7]):
        _dump(os.path.join(directory, "records"), f"rec{i}.bin", r)
    ser = TaggedSerializer()
    for i, v in enumerate(VALUES):
        _dump(os.path.join(directory, "records"), f"value{i}.bin", ser.serialize(v))
