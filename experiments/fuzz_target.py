"""libFuzzer targets (atheris) for everything dstl-ray reads back from shared storage.

    python -m experiments.fuzz_target {format,handle,metadata,materialized,records}
        [libFuzzer flags] [corpus dirs]

Every input must decode or raise dstl-ray's own error (a :class:`~dstl_ray.errors.DstlError`
such as FormatError / HandleError / RestoreError): any other exception, a failed invariant
(``AssertionError``), a hang (-timeout) or a memory blow-up (-rss_limit_mb) is a finding.

* ``format``: ``.dstl`` changelog file bytes -> ``decode_file`` and ``iter_blocks``.
* ``handle``: changelog handle JSON -> ``StateChangelogHandle.from_json``.

``metadata`` and ``handle`` mutate inputs half as bytes, half as parsed JSON
(:func:`mutate_json`: wrong types, huge or negative numbers, escaping paths, other schemes).
* ``metadata``: ``_metadata`` JSON -> ``load_checkpoint`` (as the file at
  ``$DSTL_FUZZ_METADATA``, whose base path holds the seed job's real files), then the restore's
  reads of every component at parallelism 2. A loaded checkpoint must name only files under its
  base path and survive ``to_json``/``from_json`` unchanged.
* ``materialized``: ``.dstm`` bytes -> ``read_sections`` (whole-file and range reads) with the
  index a writer would have put in the metadata, as stored and with every CRC recomputed so
  mutations reach the record decoder behind the checksum; records applied and deserialized.
* ``records``: state change records -> ``apply_records``, checked against record-by-record
  ``apply_record``, then every key and value through ``TaggedSerializer.deserialize``.
"""

from __future__ import annotations

# every standard and third-party module is loaded before the instrumented block (the
# package's imports pull in fsspec, asyncio, email...): instrumenting those cost ~7 s of each
# target's 10 s start and gave no coverage the targets are after (json stays instrumented)
import asyncio  # noqa: F401
import concurrent.futures  # noqa: F401
import copy
import email  # noqa: F401
import importlib.metadata  # noqa: F401
import os
import random
import socket  # noqa: F401
import ssl  # noqa: F401
import struct
import subprocess  # noqa: F401
import sys
import tempfile
import zipfile  # noqa: F401

import atheris
import fsspec  # noqa: F401

with atheris.instrument_imports():
    import json  # instrumented too: the JSON targets' coverage includes the parser's paths

    from dstl_ray.checkpoint.metadata import CheckpointMetadata, split_metadata_url
    from dstl_ray.checkpoint.recovery import load_checkpoint
    from dstl_ray.errors import DstlError, FormatError, HandleError
    from dstl_ray.format.changelog import crc32c, decode_file, iter_blocks, read_prefixed
    from dstl_ray.format.materialized import (
        HEADER_SIZE,
        SECTION_HEADER_SIZE,
        MaterializedHandle,
        read_sections,
    )
    from dstl_ray.keygroups import MAX_KEY_GROUPS, KeyGroupRange
    from dstl_ray.log.handle import StateChangelogHandle
    from dstl_ray.state.records import StateKind, TaggedSerializer, apply_record, apply_records
    from dstl_ray.storage.local import LocalStorage

    from .fuzz_seeds import (
        EVIL,
        METADATA_ENV,
        BytesStorage,
        Tables,
        build_job,
        deserialize_tables,
        json_slots,
        restore_reads,
    )

_SER = TaggedSerializer()
_SEC = struct.Struct("<4sIII")


# ---------------------------------------------------------------------- format, handle

def target_format(data: bytes) -> None:
    try:
        decode_file(data, "fuzz.dstl")
    except FormatError:
        pass
    try:
        for _ in iter_blocks(data, path="fuzz.dstl"):
            pass
    except FormatError:
        pass


def target_handle(data: bytes) -> None:
    try:
        StateChangelogHandle.from_json(data)
    except HandleError:
        pass


# ---------------------------------------------------------------------- shared helpers

# ---------------------------------------------------------------------- metadata

_METADATA_URL: str | None = None


def metadata_url() -> str:
    """The URL inputs are loaded as: ``$DSTL_FUZZ_METADATA``, or a seed job built now."""
    global _METADATA_URL
    if _METADATA_URL is None:
        url = os.environ.get(METADATA_ENV)
        if not url:
            url = build_job("file://" + tempfile.mkdtemp(prefix="fuzz-meta-")).savepoint
        _METADATA_URL = url
    return _METADATA_URL


def target_metadata(data: bytes) -> None:
    url = metadata_url()
    storage = BytesStorage({url: data}, LocalStorage(fsync=False))
    try:
        cc = load_checkpoint(url, storage)
    except DstlError:
        return
    base, own_dir = split_metadata_url(url)
    for name, u in cc.files.items():
        assert u.startswith(base + "/") and "/../" not in u and u.endswith("/" + name), u
    again = CheckpointMetadata.from_json(cc.metadata.to_json(), url)
    assert again == cc.metadata, (again, cc.metadata)
    try:
        restore_reads(cc, storage, 2)
    except DstlError:
        pass


# ---------------------------------------------------------------------- materialized

def walk_sections(data: bytes) -> list[tuple[int, int, int]]:
    """The (key group, offset, length) index a writer would record for ``data``."""
    out, pos = [], HEADER_SIZE
    while pos + SECTION_HEADER_SIZE <= len(data) and len(out) < 1000:
        _, kg, _, plen = _SEC.unpack_from(data, pos)
        out.append((kg, pos, SECTION_HEADER_SIZE + plen))
        pos += SECTION_HEADER_SIZE + plen
    return out


def with_crcs(data: bytes, sections: list[tuple[int, int, int]]) -> bytes:
    """``data`` with the header's and every section's CRC32C made to match."""
    out = bytearray(data)
    if len(out) >= HEADER_SIZE:
        struct.pack_into("<I", out, 8, crc32c(bytes(out[:8])))
    for _, off, ln in sections:
        if off + ln <= len(out):
            struct.pack_into("<I", out, off + _SEC.size,
                             crc32c(bytes(out[off:off + _SEC.size] + out[off + 20:off + ln])))
    return bytes(out)


_STATES = (("v", "value"), ("l", "list"), ("m", "map"))


def read_materialized(data: bytes, sections: list[tuple[int, int, int]]) -> None:
    url = "memory://fuzz/job/mat/x.dstm"
    st = BytesStorage({url: data})
    handle = MaterializedHandle("job", "mat/x.dstm", KeyGroupRange(0, MAX_KEY_GROUPS - 1),
                                _STATES, tuple(sections), len(data))
    first = sections[0][0] if sections and sections[0][0] < MAX_KEY_GROUPS else 0
    for key_groups in (handle.key_group_range, KeyGroupRange(first, first)):
        t = Tables()
        sid_map = t.sid_map(_STATES)
        try:
            for kg, recs in read_sections(st, url, handle, key_groups):
                apply_records(recs, t.tables, t.kinds, kg, sid_map)
            deserialize_tables(t.tables, t.kinds)
        except DstlError:
            pass


def target_materialized(data: bytes) -> None:
    sections = walk_sections(data)
    read_materialized(data, sections)
    read_materialized(with_crcs(data, sections), sections)


# ---------------------------------------------------------------------- records

def _apply(recs: list[bytes], one_by_one: bool, sid_map: list[int] | None
           ) -> tuple[list[dict], str | None]:
    kinds = [StateKind.VALUE, StateKind.LIST, StateKind.MAP]
    tables: list[dict] = [{}, {}, {}]
    try:
        if one_by_one:
            for r in recs:
                apply_record(r, tables, kinds, 7, sid_map)
        else:
            apply_records(recs, tables, kinds, 7, sid_map)
    except DstlError as e:
        return tables, str(e)
    try:
        deserialize_tables(tables, kinds)
    except DstlError:
        pass
    return tables, None


def target_records(data: bytes) -> None:
    try:
        _SER.deserialize(data)
    except DstlError:
        pass
    recs, pos = [], 0  # the input as a run of u32-length-prefixed records (a .dstm payload)
    while pos < len(data):
        try:
            (rec,), pos = read_prefixed(data, pos, len(data), 1, "record", None, 0)
        except FormatError:
            break
        recs.append(rec)
    for batch in ([data], recs):
        for sid_map in (None, [2, 0, 1]):
            fast = _apply(batch, False, sid_map)
            slow = _apply(batch, True, sid_map)
            assert fast == slow, (fast, slow)


# ---------------------------------------------------------------------- JSON mutator

def mutate_json(data: bytes, max_size: int, seed: int) -> bytes:
    """Half libFuzzer's byte mutations, half structural ones on the parsed document (a field
    replaced by an EVIL value or another field's value, dropped, or bumped by one), so inputs
    stay JSON and reach the checks behind the parser."""
    rng = random.Random(seed)
    try:
        doc = json.loads(data) if rng.random() < 0.5 else None
    except (ValueError, RecursionError):
        doc = None
    slots = json_slots(doc) if doc is not None else []
    if not slots:
        return atheris.Mutate(data, max_size)
    for _ in range(rng.randint(1, 3)):
        container, key = rng.choice(slots)
        op = rng.random()
        if op < 0.5:
            container[key] = copy.deepcopy(rng.choice(EVIL))
        elif op < 0.7:
            other, okey = rng.choice(slots)
            container[key] = copy.deepcopy(other[okey])  # a copy: never a cycle
        elif op < 0.85 and isinstance(container[key], int) and not isinstance(
                container[key], bool):
            container[key] += rng.choice((-1, 1))
        elif isinstance(container, dict):
            del container[key]
        else:
            container.append(container[key])
        slots = json_slots(doc)
        if not slots:
            break
    try:
        out = json.dumps(doc).encode()
    except (ValueError, RecursionError):
        return atheris.Mutate(data, max_size)
    return out if len(out) <= max_size else atheris.Mutate(data, max_size)


TARGETS = {"format": target_format, "handle": target_handle, "metadata": target_metadata,
           "materialized": target_materialized, "records": target_records}


def main() -> None:
    target = TARGETS[sys.argv[1]]
    if target is target_metadata:
        metadata_url()  # build the seed job (if needed) before fuzzing starts
    if target in (target_metadata, target_handle):
        atheris.Setup([sys.argv[0], *sys.argv[2:]], target, custom_mutator=mutate_json)
    else:
        atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
