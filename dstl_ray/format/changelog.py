"""The versioned changelog file format (docs/architecture.md "File format").

One physical file per flush::

    header   magic "DSTL" | u16 version | u16 flags | u32 reserved | u32 crc32c(header)
    section* one per log (writer): a run of key-group blocks, ascending key group
      block  magic "KGB1" | 16B log id | u32 key group | u32 flags | u64 sqn_min | u64 sqn_max
             | u32 changesets | u32 stored length | u32 raw length | u32 crc32c(header+payload)
             | payload (zstd when flags bit 0): per changeset u64 sqn | u32 n | n * (u32 len | bytes)
    footer   magic "DIDX" | u32 n | n * (16B log id | u32 kg | u64 sqn_min | u64 sqn_max
             | u64 offset | u32 length) | u32 crc32c(footer)
    trailer  u64 footer offset | u32 footer length | u32 crc32c(trailer) | magic "DEND"

A section is encoded by its writer (so compression runs where the changes are made) and node
actors only concatenate sections; a handle names (file, offset, length, log id, sqn range) and a
restore reads only that byte range. Every block carries a CRC32C, so a torn or corrupt file
raises :class:`~dstl_ray.errors.FormatError` naming file and offset instead of returning wrong
data. Lengths are checked against the bytes at hand before anything is allocated.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import google_crc32c

from ..errors import FormatError

FILE_MAGIC = b"DSTL"
BLOCK_MAGIC = b"KGB1"
FOOTER_MAGIC = b"DIDX"
TRAILER_MAGIC = b"DEND"
VERSION = 1
FILE_SUFFIX = ".dstl"

FLAG_ZSTD = 1
KNOWN_FLAGS = FLAG_ZSTD

_HEADER = struct.Struct("<4sHHI")  # + u32 crc
_BLOCK = struct.Struct("<4s16sIIQQIII")  # + u32 crc
_FOOTER_HEAD = struct.Struct("<4sI")
_INDEX_ENTRY = struct.Struct("<16sIQQQI")
_TRAILER = struct.Struct("<QI")  # + u32 crc + magic
_U32 = struct.Struct("<I")
_CS_HEAD = struct.Struct("<QI")

HEADER_SIZE = _HEADER.size + 4
BLOCK_HEADER_SIZE = _BLOCK.size + 4
TRAILER_SIZE = _TRAILER.size + 4 + 4
MAX_RAW_BLOCK = 1 << 31  # refuse to inflate a block beyond 2 GiB, whatever a length field says


def crc32c(data: bytes | memoryview) -> int:
    return google_crc32c.value(bytes(data))


@dataclass(frozen=True)
class Changeset:
    """Changes appended between two sqn boundaries; ``entries`` are (key group, value)."""

    sqn: int
    entries: tuple[tuple[int, bytes], ...]


@dataclass(frozen=True)
class BlockIndex:
    """Footer entry: where one (log, key group) block lies and which sqns it holds. (Ray
    pickles it inside a persist request by its fields: its shape is what lets a writer of
    one version use a node of another by Ray calls.)"""

    log_id: bytes
    key_group: int
    sqn_min: int
    sqn_max: int
    offset: int
    length: int


@dataclass(frozen=True)
class Block:
    """A decoded key-group block: every changeset of one log for one key group."""

    log_id: bytes
    key_group: int
    offset: int
    changesets: tuple[tuple[int, tuple[bytes, ...]], ...]  # (sqn, values)


@dataclass(frozen=True)
class EncodedSection:
    """One log's part of a file, encoded by its writer; offsets in ``index`` are relative."""

    log_id: bytes
    data: bytes
    index: tuple[BlockIndex, ...]
    sqn_min: int
    sqn_max: int
    flags: int


def _compressor():  # imported lazily: only files written with zstd need it
    import zstandard

    return zstandard.ZstdCompressor(level=3)


def encode_section(
    log_id: bytes, changesets: Sequence[Changeset], compression: str = "none"
) -> EncodedSection:
    """Encode one log's changesets (ascending sqn) as key-group blocks."""
    if len(log_id) != 16:
        raise ValueError("log id must be 16 bytes")
    if not changesets:
        raise ValueError("a section needs at least one changeset")
    per_kg: dict[int, list[tuple[int, list[bytes]]]] = {}
    for cs in changesets:  # each changeset grouped flat, then one run per key group
        groups: dict[int, list[bytes]] = {}
        get = groups.get
        for kg, value in cs.entries:
            values = get(kg)
            if values is None:
                groups[kg] = [value]
            else:
                values.append(value)
        for kg, values in groups.items():
            runs = per_kg.get(kg)
            if runs is None:
                per_kg[kg] = [(cs.sqn, values)]
            else:
                runs.append((cs.sqn, values))
    flags = FLAG_ZSTD if compression == "zstd" else 0
    comp = _compressor() if flags & FLAG_ZSTD else None
    out: list[bytes] = []
    index: list[BlockIndex] = []
    pos = 0
    pack_u32, pack_cs = _U32.pack, _CS_HEAD.pack
    for kg in sorted(per_kg):
        runs = per_kg[kg]
        parts: list[bytes] = []
        add = parts.append
        for sqn, values in runs:
            add(pack_cs(sqn, len(values)))
            for v in values:
                add(pack_u32(len(v)))
                add(v)
        raw = b"".join(parts)
        stored = comp.compress(raw) if comp is not None else raw
        head = _BLOCK.pack(BLOCK_MAGIC, log_id, kg, flags, runs[0][0], runs[-1][0], len(runs),
                           len(stored), len(raw))
        crc = google_crc32c.extend(google_crc32c.value(head), stored)
        block = b"".join((head, _U32.pack(crc), stored))
        out.append(block)
        index.append(BlockIndex(log_id, kg, runs[0][0], runs[-1][0], pos, len(block)))
        pos += len(block)
    return EncodedSection(log_id, b"".join(out), tuple(index), changesets[0].sqn,
                          changesets[-1].sqn, flags)


def encode_header(flags: int) -> bytes:
    head = _HEADER.pack(FILE_MAGIC, VERSION, flags, 0)
    return head + _U32.pack(crc32c(head))


def assemble_file(sections: Sequence[EncodedSection]) -> tuple[bytes, list[int]]:
    """Concatenate sections into one file; returns the file and each section's offset."""
    flags = 0
    for s in sections:
        flags |= s.flags
    parts = [encode_header(flags)]
    pos = HEADER_SIZE
    offsets: list[int] = []
    pack = _INDEX_ENTRY.pack
    entries: list[bytes] = []  # each section's index entries, shifted to where it lands
    for s in sections:
        offsets.append(pos)
        entries.extend([pack(e.log_id, e.key_group, e.sqn_min, e.sqn_max, e.offset + pos,
                             e.length) for e in s.index])
        parts.append(s.data)
        pos += len(s.data)
    footer_bytes = b"".join([_FOOTER_HEAD.pack(FOOTER_MAGIC, len(entries)), *entries])
    footer_bytes += _U32.pack(crc32c(footer_bytes))
    trailer = _TRAILER.pack(pos, len(footer_bytes))
    trailer += _U32.pack(crc32c(trailer)) + TRAILER_MAGIC
    parts.append(footer_bytes)
    parts.append(trailer)
    return b"".join(parts), offsets


# ---------------------------------------------------------------------------------- reading


def _decompress(stored: bytes, raw_len: int, path: str | None, offset: int) -> bytes:
    import zstandard

    try:
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_len)
    except zstandard.ZstdError as e:
        raise FormatError(f"cannot decompress block ({e})", path=path, offset=offset) from None
    return raw


def read_prefixed(buf: bytes, pos: int, end: int, count: int, what: str, path: str | None,
                  offset: int) -> tuple[list[bytes], int]:
    """``count`` values, each a u32 length then its bytes, from ``buf[pos:end]``; returns the
    values and the position after them. Every length is checked against ``end`` before use."""
    values = []
    unpack_u32 = _U32.unpack_from
    for _ in range(count):
        if pos + 4 > end:
            raise FormatError(f"{what} length runs past its end", path=path, offset=offset)
        (ln,) = unpack_u32(buf, pos)
        pos += 4
        if ln > end - pos:
            raise FormatError(f"{what} runs past its end", path=path, offset=offset)
        values.append(buf[pos:pos + ln])
        pos += ln
    return values, pos


def _decode_payload(raw: bytes, n_changesets: int, path: str | None, offset: int
                    ) -> tuple[tuple[int, tuple[bytes, ...]], ...]:
    out: list[tuple[int, tuple[bytes, ...]]] = []
    pos, end = 0, len(raw)
    unpack_cs = _CS_HEAD.unpack_from
    for _ in range(n_changesets):
        if pos + _CS_HEAD.size > end:
            raise FormatError("changeset header runs past its block", path=path, offset=offset)
        sqn, n = unpack_cs(raw, pos)
        pos += _CS_HEAD.size
        if n * 4 > end - pos:
            raise FormatError(f"changeset {sqn} claims {n} entries, more than its block holds",
                              path=path, offset=offset)
        values, pos = read_prefixed(raw, pos, end, n, "entry", path, offset)
        out.append((sqn, tuple(values)))
    if pos != end:
        raise FormatError("block payload has trailing bytes", path=path, offset=offset)
    return tuple(out)


def iter_blocks(data: bytes, *, base_offset: int = 0, path: str | None = None
                ) -> Iterator[Block]:
    """Decode every key-group block in ``data`` (a section or a run of sections).

    ``base_offset`` is the file offset of ``data[0]``, used in error messages and results.
    Raises :class:`FormatError` on any torn or corrupt byte.
    """
    pos, end = 0, len(data)
    while pos < end:
        at = base_offset + pos
        if end - pos < BLOCK_HEADER_SIZE:
            raise FormatError("torn block header", path=path, offset=at)
        (magic, log_id, kg, flags, sqn_min, sqn_max, n_cs, stored_len,
         raw_len) = _BLOCK.unpack_from(data, pos)
        if magic != BLOCK_MAGIC:
            raise FormatError(f"bad block magic {magic!r}", path=path, offset=at)
        if flags & ~KNOWN_FLAGS:
            raise FormatError(f"unknown block flags {flags:#x}", path=path, offset=at)
        if stored_len > end - pos - BLOCK_HEADER_SIZE:
            raise FormatError("block runs past the end of the data (torn file?)", path=path,
                              offset=at)
        if raw_len > MAX_RAW_BLOCK or (not flags & FLAG_ZSTD and raw_len != stored_len):
            raise FormatError(f"implausible block length {raw_len}", path=path, offset=at)
        (crc,) = _U32.unpack_from(data, pos + _BLOCK.size)
        body_start = pos + BLOCK_HEADER_SIZE
        stored = data[body_start:body_start + stored_len]
        actual = google_crc32c.extend(google_crc32c.value(data[pos:pos + _BLOCK.size]), stored)
        if actual != crc:
            raise FormatError(f"CRC32C mismatch (stored {crc:#010x}, computed {actual:#010x})",
                              path=path, offset=at)
        raw = _decompress(stored, raw_len, path, at) if flags & FLAG_ZSTD else stored
        if len(raw) != raw_len:
            raise FormatError("decompressed length differs from the block header", path=path,
                              offset=at)
        changesets = _decode_payload(raw, n_cs, path, at)
        if changesets and (changesets[0][0] != sqn_min or changesets[-1][0] != sqn_max):
            raise FormatError("block sqn range disagrees with its changesets", path=path,
                              offset=at)
        yield Block(log_id, kg, at, changesets)
        pos = body_start + stored_len


@dataclass(frozen=True)
class FileContents:
    version: int
    flags: int
    size: int
    index: tuple[BlockIndex, ...]
    blocks: tuple[Block, ...]


def read_header(data: bytes, path: str | None = None) -> tuple[int, int]:
    if len(data) < HEADER_SIZE:
        raise FormatError("file shorter than its header (torn file?)", path=path, offset=0)
    magic, version, flags, _ = _HEADER.unpack_from(data, 0)
    if magic != FILE_MAGIC:
        raise FormatError(f"not a dstl changelog file (magic {magic!r})", path=path, offset=0)
    (crc,) = _U32.unpack_from(data, _HEADER.size)
    if crc32c(data[:_HEADER.size]) != crc:
        raise FormatError("header CRC32C mismatch", path=path, offset=0)
    if version != VERSION:
        raise FormatError(f"unsupported format version {version} (this reader knows {VERSION})",
                          path=path, offset=4)
    if flags & ~KNOWN_FLAGS:
        raise FormatError(f"unknown file flags {flags:#x}", path=path, offset=6)
    return version, flags


def read_index(data: bytes, path: str | None = None) -> tuple[BlockIndex, ...]:
    """The footer index of a whole file (header and trailer checked)."""
    read_header(data, path)
    size = len(data)
    if size < HEADER_SIZE + TRAILER_SIZE:
        raise FormatError("file too short for a trailer (torn file?)", path=path, offset=size)
    t = size - TRAILER_SIZE
    if data[t + _TRAILER.size + 4:] != TRAILER_MAGIC:
        raise FormatError("missing trailer magic (torn file?)", path=path, offset=t)
    footer_off, footer_len = _TRAILER.unpack_from(data, t)
    (crc,) = _U32.unpack_from(data, t + _TRAILER.size)
    if crc32c(data[t:t + _TRAILER.size]) != crc:
        raise FormatError("trailer CRC32C mismatch", path=path, offset=t)
    if footer_off < HEADER_SIZE or footer_off + footer_len != t or footer_len < 12:
        raise FormatError("footer position out of bounds", path=path, offset=t)
    footer = data[footer_off:t]
    (fcrc,) = _U32.unpack_from(footer, footer_len - 4)
    if crc32c(footer[:-4]) != fcrc:
        raise FormatError("footer CRC32C mismatch", path=path, offset=footer_off)
    magic, n = _FOOTER_HEAD.unpack_from(footer, 0)
    if magic != FOOTER_MAGIC or _FOOTER_HEAD.size + n * _INDEX_ENTRY.size + 4 != footer_len:
        raise FormatError("malformed footer", path=path, offset=footer_off)
    entries = []
    for i in range(n):
        log_id, kg, lo, hi, off, ln = _INDEX_ENTRY.unpack_from(
            footer, _FOOTER_HEAD.size + i * _INDEX_ENTRY.size)
        if off < HEADER_SIZE or off + ln > footer_off:
            raise FormatError(f"index entry {i} points outside the data", path=path,
                              offset=footer_off)
        entries.append(BlockIndex(log_id, kg, lo, hi, off, ln))
    return tuple(entries)


def decode_file(data: bytes, path: str | None = None) -> FileContents:
    """Decode and verify a whole file: header, every block, footer index and trailer."""
    version, flags = read_header(data, path)
    index = read_index(data, path)
    footer_off = _TRAILER.unpack_from(data, len(data) - TRAILER_SIZE)[0]
    blocks = tuple(iter_blocks(data[HEADER_SIZE:footer_off], base_offset=HEADER_SIZE, path=path))
    if len(blocks) != len(index):
        raise FormatError(f"footer lists {len(index)} blocks, file holds {len(blocks)}",
                          path=path, offset=footer_off)
    for b, e in zip(blocks, index, strict=True):
        if (b.offset, b.log_id, b.key_group) != (e.offset, e.log_id, e.key_group):
            raise FormatError("footer index disagrees with the blocks", path=path,
                              offset=b.offset)
    return FileContents(version, flags, len(data), index, blocks)
