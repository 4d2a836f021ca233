"""Handles of incremental RocksDB materializations (Flink's incremental RocksDB checkpoints,
under FLIP-158's changelog: "Materializing state changes" with a RocksDB state table).

A materialization of the ``rocksdb`` state table (:mod:`dstl_ray.state.rocksdb`) is a local
RocksDB checkpoint: immutable SST files plus a few small private files (MANIFEST, CURRENT,
OPTIONS). Each SST file is uploaded once, under a name of its own (``mat/<uuid>.sst``), and
every later materialization that still has it names the uploaded file again: the shared state
registry counts its references by file name, as Flink's ``SharedStateRegistry`` does for
``shared/`` SSTs. The private files are uploaded anew each time as one bundle file
(``mat/<uuid>.rdbm``), format version 1::

    b"DSRB" | u16 version | u16 count | (u16 name length | name | u64 size | bytes)*

Each uploaded file's size and CRC32C travel in the handle, so a restore checks every file it
downloads and names the one that is missing, short or corrupt.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError, HandleError
from ..keygroups import KeyGroupRange
from ..storage.base import join
from .materialized import StatesSpec, parse_job, parse_states, states_json
from .segment import check_relative_path, non_negative_int, show

SST_SUFFIX = ".sst"
BUNDLE_SUFFIX = ".rdbm"
BUNDLE_MAGIC = b"DSRB"
BUNDLE_VERSION = 1
_BHEAD = struct.Struct("<4sHH")
_BNAME = struct.Struct("<H")
_BSIZE = struct.Struct("<Q")
# RocksDB's own file names: NNNNNN.sst, MANIFEST-NNNNNN, CURRENT, OPTIONS-NNNNNN, NNNNNN.log
_LOCAL = re.compile(r"^[0-9]{1,20}\.sst$|^(MANIFEST|OPTIONS)-[0-9]{1,20}$|^CURRENT$"
                    r"|^[0-9]{1,20}\.log$")
MAX_FILES = 1_000_000


@dataclass(frozen=True)
class UploadedFile:
    """One file of a RocksDB checkpoint as uploaded: its local ``name`` in the database
    directory, ``path`` relative to the job directory, ``size`` and CRC32C."""

    name: str
    path: str
    size: int
    crc: int

    def to_json(self) -> list[Any]:
        return [self.name, self.path, self.size, self.crc]

    @classmethod
    def from_json(cls, v: object, suffix: str) -> UploadedFile:
        if not isinstance(v, list) or len(v) != 4 or not isinstance(v[0], str):
            raise HandleError(f"bad uploaded file entry {show(v)}")
        name, path = v[0], check_relative_path(v[1])
        if suffix == SST_SUFFIX and not (_LOCAL.match(name) and name.endswith(SST_SUFFIX)):
            raise HandleError(f"bad SST file name {show(name)}")
        if not path.endswith(suffix):
            raise HandleError(f"uploaded file {path!r} is not a {suffix} file")
        crc = non_negative_int("file CRC32C", v[3])
        if crc >= 1 << 32:
            raise HandleError(f"file CRC32C {crc} exceeds 32 bits")
        return cls(name, path, non_negative_int("file size", v[2]), crc)


@dataclass(frozen=True)
class RocksDBHandle:
    """One incremental materialization of a rocksdb state table: its SST files (shared with
    other materializations of the same database) and the bundle of its private files.
    ``job`` names the job directory the paths are relative to."""

    job: str
    key_group_range: KeyGroupRange
    states: StatesSpec
    ssts: tuple[UploadedFile, ...]
    bundle: UploadedFile
    sqn: int = 0  # last materialized sqn of the writing backend (informative)

    def files(self) -> tuple[UploadedFile, ...]:
        return (*self.ssts, self.bundle)

    def urls(self, base_path: str) -> list[str]:
        root = join(base_path, self.job)
        return [join(root, f.path) for f in self.files()]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files())

    def to_dict(self) -> dict[str, Any]:
        return {"type": "rocksdb", "job": self.job, "key_groups": self.key_group_range.to_json(),
                "states": states_json(self.states), "sqn": self.sqn,
                "ssts": [f.to_json() for f in self.ssts], "bundle": self.bundle.to_json()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RocksDBHandle:
        """Parse and validate a handle read from checkpoint metadata (plain relative paths,
        RocksDB's own local names, each SST once)."""
        try:
            job = parse_job(d["job"])
            kgr = KeyGroupRange.from_json(d["key_groups"])
            states = parse_states(d["states"])
            raw, bundle = d["ssts"], d["bundle"]
        except KeyError as e:
            raise HandleError(f"rocksdb handle lacks {e}") from None
        if job is None:
            raise HandleError("a rocksdb handle must name its job directory")
        if not isinstance(raw, list) or len(raw) > MAX_FILES:
            raise HandleError(f"rocksdb handle's ssts must be a list, got {show(raw)}")
        ssts = tuple(UploadedFile.from_json(v, SST_SUFFIX) for v in raw)
        if len({f.name for f in ssts}) != len(ssts):
            raise HandleError("rocksdb handle lists an SST file twice")
        return cls(job, kgr, states, ssts, UploadedFile.from_json(bundle, BUNDLE_SUFFIX),
                   non_negative_int("rocksdb sqn", d.get("sqn", 0)))


def local_name_ok(name: str) -> bool:
    """Whether ``name`` is one of RocksDB's own file names (what a bundle may hold)."""
    return bool(_LOCAL.match(name))


def encode_bundle(files: list[tuple[str, bytes]]) -> bytes:
    """The private files of a checkpoint, ``(name, bytes)`` each, as one bundle."""
    parts = [_BHEAD.pack(BUNDLE_MAGIC, BUNDLE_VERSION, len(files))]
    for name, data in files:
        raw = name.encode("ascii")
        parts += (_BNAME.pack(len(raw)), raw, _BSIZE.pack(len(data)), data)
    return b"".join(parts)


def decode_bundle(data: bytes, path: str) -> list[tuple[str, bytes]]:
    """``(name, bytes)`` of a bundle; a torn or foreign one raises :class:`FormatError`."""
    if len(data) < _BHEAD.size:
        raise FormatError("torn rocksdb bundle header", path=path, offset=0)
    magic, version, count = _BHEAD.unpack_from(data)
    if magic != BUNDLE_MAGIC:
        raise FormatError("not a rocksdb bundle file", path=path, offset=0)
    if version != BUNDLE_VERSION:
        raise FormatError(f"unsupported rocksdb bundle version {version}", path=path, offset=4)
    out, pos = [], _BHEAD.size
    for _ in range(count):
        if pos + _BNAME.size > len(data):
            raise FormatError("torn rocksdb bundle entry", path=path, offset=pos)
        (n,) = _BNAME.unpack_from(data, pos)
        name_end = pos + _BNAME.size + n
        if name_end + _BSIZE.size > len(data):
            raise FormatError("torn rocksdb bundle entry", path=path, offset=pos)
        name = data[pos + _BNAME.size:name_end].decode("ascii", "replace")
        if not local_name_ok(name) or name.endswith(SST_SUFFIX):
            raise FormatError(f"rocksdb bundle holds a file named {name!r}", path=path,
                              offset=pos)
        (size,) = _BSIZE.unpack_from(data, name_end)
        start = name_end + _BSIZE.size
        if start + size > len(data):
            raise FormatError(f"rocksdb bundle entry {name!r} runs past the file", path=path,
                              offset=pos)
        out.append((name, data[start:start + size]))
        pos = start + size
    if pos != len(data):
        raise FormatError("rocksdb bundle has trailing bytes", path=path, offset=pos)
    return out
