"""Materialized state files (FLIP-158 "Materializing state changes", step 3).

A materialization (or a savepoint) is uploaded as ONE file per backend, with one section per
key group so a rescaled restore reads only the key groups it owns (FLIP-158 "Recovery and
rescaling", FLINK-5053 "key-group aware"). Sections hold "set" records of
:mod:`dstl_ray.state.records`, i.e. a compacted changelog. Format, version 1::

    header  b"DSTM" | u16 version | u16 flags (0) | u32 crc32c(previous 8 bytes)
    section b"KGM1" | u32 key group | u32 records | u32 payload length
            | u32 crc32c(previous 16 bytes + payload) | payload
    payload (u32 length | record)*

The section index (key group, offset, length) travels in the checkpoint metadata
(:class:`MaterializedHandle`), so reading needs no footer. Every section carries a CRC32C: a
torn or corrupt file raises :class:`~dstl_ray.errors.FormatError` naming file and offset.
"""

from __future__ import annotations

import enum
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError, HandleError
from ..keygroups import KeyGroupRange
from ..storage.base import Storage, join
from .changelog import crc32c, read_prefixed
from .segment import check_relative_path, non_negative_int, show

MAT_SUFFIX = ".dstm"
MAGIC = b"DSTM"
SECTION_MAGIC = b"KGM1"
VERSION = 1
_HEAD = struct.Struct("<4sHH")
_SEC = struct.Struct("<4sIII")
_U32 = struct.Struct("<I")
HEADER_SIZE = _HEAD.size + 4
SECTION_HEADER_SIZE = _SEC.size + 4

# index = state id of the writing backend: (name, kind), or (name, kind, ttl ms) for a state
# whose values carry write timestamps (dstl_ray.state.ttl), or (name, kind, ttl ms or None,
# schema) for a typed state (schema: its canonical DDL, dstl_ray.state.schema) or a dropped
# one (schema DROPPED: its id stays taken, so later ids keep their places)
StateSpec = tuple[str, str] | tuple[str, str, int] | tuple[str, str, int | None, str]
DROPPED = "!dropped"
MAX_SCHEMA = 65536  # characters of one state's schema DDL
StatesSpec = tuple[StateSpec, ...]




class StateKind(enum.StrEnum):
    """The kinds of keyed state a file's state spec names (the records of each kind:
    :mod:`dstl_ray.state.records`)."""

    VALUE = "value"
    LIST = "list"
    MAP = "map"


_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_KINDS = frozenset(k.value for k in StateKind)


def parse_job(job: object) -> str | None:
    if job is None:
        return None
    if not isinstance(job, str) or not _JOB.match(job):
        raise HandleError(f"bad job directory name {show(job)}")
    return job


def parse_states(value: object) -> StatesSpec:
    """A component's states, ``[[name, kind], ...]`` (the index is the writer's state id): at
    most 65535 (state ids are u16), names as a :class:`StateDescriptor` allows, each once
    among the states not dropped. Options as a third item: ``{"ttl_ms": n}`` (the values
    carry timestamps), ``{"schema": ddl}`` (a typed state), ``{"dropped": true}`` (a state
    removed, whose id stays taken)."""
    if not isinstance(value, list) or len(value) > 65535:
        raise HandleError(f"states must be a list of at most 65535, got {show(value)}")
    out: list[StateSpec] = []
    seen: set[str] = set()
    for s in value:
        if (not isinstance(s, list) or len(s) not in (2, 3) or not isinstance(s[0], str)
                or not 0 < len(s[0]) <= 200 or not isinstance(s[1], str)
                or s[1] not in _KINDS):
            raise HandleError(f"bad state spec {show(s)}")
        ttl, schema = _state_options(s[2]) if len(s) == 3 else (None, None)
        if schema != DROPPED:
            if s[0] in seen:
                raise HandleError(f"state {show(s[0])} is listed twice")
            seen.add(s[0])
        if schema is not None:
            out.append((s[0], s[1], ttl, schema))
        elif ttl is not None:
            out.append((s[0], s[1], ttl))
        else:
            out.append((s[0], s[1]))
    return tuple(out)


def _state_options(opts: object) -> tuple[int | None, str | None]:
    """(ttl ms, schema or DROPPED) of a state spec's options."""
    if (not isinstance(opts, dict) or not opts
            or not set(opts) <= {"ttl_ms", "schema", "dropped"}):
        raise HandleError(f"bad state spec options {show(opts)} (expected any of "
                          f"{{\"ttl_ms\": positive int, \"schema\": DDL string, "
                          f"\"dropped\": true}})")
    ttl = opts.get("ttl_ms")
    if "ttl_ms" in opts and (isinstance(ttl, bool) or not isinstance(ttl, int)
                             or not 0 < ttl < 2**63):
        raise HandleError(f"bad state spec options {show(opts)}: ttl_ms must be a positive "
                          f"int")
    if "dropped" in opts:
        if opts["dropped"] is not True or len(opts) != 1:
            raise HandleError(f"bad state spec options {show(opts)}: a dropped state has "
                              f"{{\"dropped\": true}} alone")
        return None, DROPPED
    schema = opts.get("schema")
    if schema is not None and (not isinstance(schema, str) or not 0 < len(schema) <= MAX_SCHEMA
                               or schema == DROPPED):
        raise HandleError(f"bad state spec options {show(opts)}: schema must be a DDL string")
    return ttl, schema


def spec_schema(spec: Sequence[Any]) -> str | None:
    """The declared schema (canonical DDL) of one entry of a state spec; None if untyped
    (and for a dropped state: see :func:`spec_dropped`)."""
    schema = spec[3] if len(spec) > 3 else None
    return None if schema == DROPPED else schema


def spec_dropped(spec: Sequence[Any]) -> bool:
    """Whether one entry of a state spec is a dropped state's place."""
    return len(spec) > 3 and spec[3] == DROPPED


def states_json(states: StatesSpec) -> list[list[Any]]:
    """``states`` as handles write them (:func:`parse_states` reads them back); a state
    without options is ``[name, kind]``, exactly as before TTL existed."""
    out: list[list[Any]] = []
    for s in states:
        if spec_dropped(s):
            out.append([s[0], s[1], {"dropped": True}])
            continue
        opts: dict[str, Any] = {}
        if len(s) > 2 and s[2] is not None:
            opts["ttl_ms"] = s[2]
        if spec_schema(s) is not None:
            opts["schema"] = s[3]  # type: ignore[misc]
        out.append([s[0], s[1], opts] if opts else [s[0], s[1]])
    return out


@dataclass(frozen=True)
class MaterializedHandle:
    """One materialized (or savepoint) file of one backend and its per key group index.

    ``job`` names the job directory (under the base path) holding ``path``; ``None`` means the
    directory of the snapshot's own ``_metadata`` (self-contained savepoints)."""

    job: str | None
    path: str
    key_group_range: KeyGroupRange
    states: StatesSpec
    sections: tuple[tuple[int, int, int], ...]  # (key group, offset, length)
    size: int
    sqn: int = 0  # last materialized sqn of the writing backend (informative)
    # where this logical file starts in the physical file ``path`` (FLIP-306
    # "SegmentFileStateHandle": path, offset, length = size); 0 for a file of its own
    offset: int = 0

    def root(self, base_path: str, own_dir: str) -> str:
        return join(base_path, self.job) if self.job is not None else own_dir

    def url(self, base_path: str, own_dir: str) -> str:
        return join(self.root(base_path, own_dir), self.path)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "materialized", "job": self.job, "path": self.path,
                "key_groups": self.key_group_range.to_json(),
                "states": states_json(self.states),
                "sections": [list(s) for s in self.sections], "size": self.size,
                "sqn": self.sqn, **({"offset": self.offset} if self.offset else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MaterializedHandle:
        """Parse and validate a handle read from checkpoint metadata: a plain relative
        ``.dstm`` path, and every section (int key group in range, offset and length) inside
        ``size``, so no read can be steered outside the file or sized by a forged field."""
        try:
            path = check_relative_path(d["path"])
            kgr = KeyGroupRange.from_json(d["key_groups"])
            states = parse_states(d["states"])
            raw_sections, size, sqn = d["sections"], d["size"], d.get("sqn", 0)
            offset = d.get("offset", 0)
        except KeyError as e:
            raise HandleError(f"materialized handle lacks {e}") from None
        if not path.endswith(MAT_SUFFIX):
            raise HandleError(f"materialized path {path!r} is not a {MAT_SUFFIX} file")
        size = non_negative_int("materialized size", size)
        sqn = non_negative_int("materialized sqn", sqn)
        offset = non_negative_int("materialized offset", offset)
        if not isinstance(raw_sections, list):
            raise HandleError(f"materialized sections must be a list, got {show(raw_sections)}")
        sections = []
        for s in raw_sections:
            if not isinstance(s, list) or len(s) != 3:
                raise HandleError(f"materialized section must be [key group, offset, length], "
                                  f"got {show(s)}")
            kg, off, ln = (non_negative_int("materialized section field", v) for v in s)
            if kg not in kgr or off < HEADER_SIZE or ln < SECTION_HEADER_SIZE or off + ln > size:
                raise HandleError(f"materialized section {(kg, off, ln)!r} lies outside key "
                                  f"groups {kgr.start}..{kgr.end} or the file's {size} bytes")
            sections.append((kg, off, ln))
        return cls(parse_job(d.get("job")), path, kgr, states, tuple(sections), size, sqn,
                   offset)


def encode_file(sections: Iterable[tuple[int, Sequence[bytes]]]
                ) -> tuple[bytes, tuple[tuple[int, int, int], ...]]:
    """One file of ``sections``, (key group, its records) in key group order, each record
    already encoded (``dstl_ray.state.files.encode_tables`` makes them from a snapshot of
    tables); a key group without records gets no section. Returns the file bytes and its
    section index."""
    head = _HEAD.pack(MAGIC, VERSION, 0)
    parts = [head, _U32.pack(crc32c(head))]
    pos = HEADER_SIZE
    index = []
    pack = _U32.pack
    for kg, records in sections:
        if not records:
            continue
        framed: list[bytes] = []
        for r in records:
            framed.append(pack(len(r)))
            framed.append(r)
        payload = b"".join(framed)
        sec = _SEC.pack(SECTION_MAGIC, kg, len(records), len(payload))
        crc = crc32c(sec + payload)
        parts += (sec, pack(crc), payload)
        length = SECTION_HEADER_SIZE + len(payload)
        index.append((kg, pos, length))
        pos += length
    return b"".join(parts), tuple(index)


def check_header(data: bytes, path: str) -> None:
    """Magic, CRC32C, version and flags of a whole file's header (a file of another version
    is refused, not misread)."""
    if len(data) < HEADER_SIZE or data[:4] != MAGIC:
        raise FormatError("not a materialized state file", path=path, offset=0)
    _, version, flags = _HEAD.unpack_from(data)
    (crc,) = _U32.unpack_from(data, _HEAD.size)
    if crc32c(data[:_HEAD.size]) != crc:
        raise FormatError("header CRC32C mismatch", path=path, offset=0)
    if version != VERSION:
        raise FormatError(f"unsupported materialized format version {version} (this reader "
                          f"knows {VERSION})", path=path, offset=4)
    if flags:
        raise FormatError(f"unknown materialized file flags {flags:#x}", path=path, offset=6)


def decode_section(data: bytes, kg: int, path: str, offset: int) -> Iterator[bytes]:
    """Records of one section, after checking its magic, key group, lengths and CRC32C."""
    if len(data) < SECTION_HEADER_SIZE:
        raise FormatError("torn materialized section header", path=path, offset=offset)
    magic, got_kg, n, plen = _SEC.unpack_from(data)
    if magic != SECTION_MAGIC:
        raise FormatError(f"bad section magic {magic!r}", path=path, offset=offset)
    if got_kg != kg:
        raise FormatError(f"section holds key group {got_kg}, index says {kg}", path=path,
                          offset=offset)
    if plen != len(data) - SECTION_HEADER_SIZE:
        raise FormatError("section length disagrees with the index (torn file?)", path=path,
                          offset=offset)
    (crc,) = _U32.unpack_from(data, _SEC.size)
    payload = data[SECTION_HEADER_SIZE:]
    actual = crc32c(data[:_SEC.size] + payload)
    if actual != crc:
        raise FormatError(f"CRC32C mismatch (stored {crc:#010x}, computed {actual:#010x})",
                          path=path, offset=offset)
    records, pos = read_prefixed(payload, 0, len(payload), n, "record", path, offset)
    yield from records
    if pos != len(payload):
        raise FormatError("section has trailing bytes", path=path, offset=offset)


def read_sections(storage: Storage, url: str, handle: MaterializedHandle,
                  key_groups: KeyGroupRange) -> Iterator[tuple[int, Iterator[bytes]]]:
    """(key group, records) for every section of ``handle`` within ``key_groups``; reads
    the whole file at once when most of it is needed, else only the wanted byte ranges."""
    wanted = [s for s in handle.sections if s[0] in key_groups]
    if not wanted:
        return
    base = handle.offset  # the logical file's start in the physical file
    if sum(ln for _, _, ln in wanted) * 2 >= handle.size:
        data = (storage.read_range(url, base, handle.size) if base or _merged(url)
                else storage.read_file(url))
        if len(data) != handle.size:
            raise FormatError(f"file has {len(data)} bytes at offset {base}, handle says "
                              f"{handle.size}", path=url)
        check_header(data, url)
        for kg, off, ln in wanted:
            yield kg, decode_section(data[off:off + ln], kg, url, base + off)
    else:
        for kg, off, ln in wanted:
            yield kg, decode_section(storage.read_range(url, base + off, ln), kg, url,
                                     base + off)


SHARED_DIR = "shared"  # FLIP-306 4.3: ${checkpointBaseDir}/shared/<subtask>/ (merged files)


def _merged(url: str) -> bool:
    """A physical file of file merging (several logical files; see :mod:`.merging`)."""
    return f"/{SHARED_DIR}/" in url
