"""Property tests of the changelog file format: round trip, and corruption is always caught."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dstl_ray.errors import FormatError
from dstl_ray.format.changelog import (
    Changeset,
    assemble_file,
    decode_file,
    encode_section,
    iter_blocks,
    read_index,
)

values = st.binary(min_size=0, max_size=40)
entries = st.lists(st.tuples(st.integers(0, 12), values), min_size=1, max_size=12)


@st.composite
def logs(draw):
    n_logs = draw(st.integers(1, 4))
    out = []
    for i in range(n_logs):
        n_cs = draw(st.integers(1, 4))
        start = draw(st.integers(1, 1000))
        changesets = [Changeset(start + j, tuple(draw(entries))) for j in range(n_cs)]
        out.append((bytes([i + 1]) * 16, changesets))
    return out


def expected_of(log_changesets):
    """{(log, kg): [(sqn, values...)]} as the file should hold it."""
    exp: dict[tuple[bytes, int], list[tuple[int, tuple[bytes, ...]]]] = {}
    for log_id, changesets in log_changesets:
        for cs in changesets:
            per_kg: dict[int, list[bytes]] = {}
            for kg, v in cs.entries:
                per_kg.setdefault(kg, []).append(v)
            for kg, vs in per_kg.items():
                exp.setdefault((log_id, kg), []).append((cs.sqn, tuple(vs)))
    return exp


def build(log_changesets, compression):
    sections = [encode_section(lid, css, compression) for lid, css in log_changesets]
    data, offsets = assemble_file(sections)
    return sections, data, offsets


def decoded(data):
    out = {}
    for b in decode_file(data).blocks:
        out[(b.log_id, b.key_group)] = list(b.changesets)
    return out


@settings(max_examples=150, deadline=None)
@given(logs(), st.sampled_from(["none", "zstd"]))
def test_round_trip(log_changesets, compression):
    sections, data, offsets = build(log_changesets, compression)
    assert decoded(data) == expected_of(log_changesets)
    index = read_index(data)
    assert len(index) == sum(len(s.index) for s in sections)
    # a handle reads only its section's byte range and gets exactly that log's changes
    for s, off in zip(sections, offsets, strict=True):
        blocks = list(iter_blocks(data[off:off + len(s.data)], base_offset=off))
        assert {b.log_id for b in blocks} == {s.log_id}
        got = {(b.log_id, b.key_group): list(b.changesets) for b in blocks}
        want = {k: v for k, v in expected_of(log_changesets).items() if k[0] == s.log_id}
        assert got == want


@settings(max_examples=150, deadline=None)
@given(entries, st.integers(1, 1000), st.sampled_from(["none", "zstd"]))
def test_one_changeset_encodes_as_the_general_path_does(es, sqn, compression):
    """A section of one changeset (a checkpoint's usual request) is byte for byte the one of
    that changeset followed by an empty one: an empty changeset adds no block and no run."""
    log = b"\x07" * 16
    one = encode_section(log, [Changeset(sqn, tuple(es))], compression)
    general = encode_section(log, [Changeset(sqn, tuple(es)), Changeset(sqn + 1, ())],
                             compression)
    assert (one.data, one.index) == (general.data, general.index)
    assert (one.sqn_min, one.sqn_max) == (sqn, sqn)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logs(), st.sampled_from(["none", "zstd"]), st.data())
def test_flipped_byte_is_an_error_or_correct(log_changesets, compression, data_strategy):
    _, data, _ = build(log_changesets, compression)
    pos = data_strategy.draw(st.integers(0, len(data) - 1))
    bit = data_strategy.draw(st.integers(0, 7))
    corrupt = bytearray(data)
    corrupt[pos] ^= 1 << bit
    try:
        result = decoded(bytes(corrupt))
    except FormatError as e:
        assert "offset" in str(e)
        return
    assert result == expected_of(log_changesets)


@settings(max_examples=150, deadline=None)
@given(logs(), st.sampled_from(["none", "zstd"]), st.data())
def test_truncated_file_is_an_error(log_changesets, compression, data_strategy):
    _, data, _ = build(log_changesets, compression)
    cut = data_strategy.draw(st.integers(0, len(data) - 1))
    with pytest.raises(FormatError):
        decode_file(data[:cut])


@settings(max_examples=150, deadline=None)
@given(logs(), st.sampled_from(["none", "zstd"]), st.data())
def test_segment_read_detects_corruption(log_changesets, compression, data_strategy):
    """What a handle reads (one section's byte range): a flipped or missing byte never
    yields wrong data."""
    sections, data, offsets = build(log_changesets, compression)
    s, off = sections[0], offsets[0]
    seg = bytearray(data[off:off + len(s.data)])
    pos = data_strategy.draw(st.integers(0, len(seg) - 1))
    seg[pos] ^= 0xFF
    with pytest.raises(FormatError):
        list(iter_blocks(bytes(seg), base_offset=off, path="x.dstl"))
    # a cut inside a block is caught here; a cut at a block boundary is caught by the handle,
    # which knows the segment's length (tests/unit/log/test_handle.py)
    cut = bytes(data[off:off + pos])
    boundaries = {e.offset for e in s.index}
    if pos not in boundaries:
        with pytest.raises(FormatError):
            list(iter_blocks(cut, base_offset=off))


def test_error_names_file_and_offset():
    sec = encode_section(b"\x01" * 16, [Changeset(1, ((0, b"abc"),))])
    data, offsets = assemble_file([sec])
    bad = bytearray(data)
    bad[offsets[0] + 60] ^= 1  # inside the first block's payload
    with pytest.raises(FormatError, match=r"CRC32C mismatch .* in /x/y.dstl at offset 16"):
        decode_file(bytes(bad), "/x/y.dstl")


def test_unknown_version_is_refused():
    sec = encode_section(b"\x01" * 16, [Changeset(1, ((0, b"abc"),))])
    data, _ = assemble_file([sec])
    import struct

    from dstl_ray.format.changelog import crc32c
    head = struct.pack("<4sHHI", b"DSTL", 99, 0, 0)
    forged = head + struct.pack("<I", crc32c(head)) + data[16:]
    with pytest.raises(FormatError, match="unsupported format version 99"):
        decode_file(forged)


def test_huge_length_field_does_not_allocate():
    """A block claiming gigabytes fails on the bounds check, not with MemoryError."""
    sec = encode_section(b"\x01" * 16, [Changeset(1, ((0, b"abc"),))], "zstd")
    import struct

    data = bytearray(sec.data)
    struct.pack_into("<I", data, 52, 1 << 30)  # raw length
    with pytest.raises(FormatError):
        list(iter_blocks(bytes(data)))
