"""The lane codec (dstl_ray.transport.lane_codec) refuses a frame whose indices or lengths
point anywhere but at the caller's own bytes: a blob index out of range (a negative one, as
Python would read it from the end), a blob named twice or by nobody, and index entries
outside their section. Each refusal names what is wrong and keeps the call id, so the server
answers that call alone. A section's index travels packed, without log ids: an entry of
another log cannot be sent (the encoder refuses it) nor received."""

from __future__ import annotations

import json
import struct

import pytest

from dstl_ray.errors import DstlError
from dstl_ray.format.changelog import BlockIndex, EncodedSection
from dstl_ray.transport.base import PersistRequest
from dstl_ray.transport.lane_codec import INDEX_ENTRY, decode_call, encode_call
from dstl_ray.transport.sender import Caller

_U32 = struct.Struct(">I")


def _req(tag: str) -> PersistRequest:
    log = bytes(range(16))
    body = tag.encode() * 4
    section = EncodedSection(log, body, (BlockIndex(log, 3, 1, 2, 0, len(body)),), 1, 2, 0)
    return PersistRequest("job", section, tag, (), 7, Caller("ns"), 4, "inc-1", 6)


def _split(body: bytes) -> tuple[dict, bytes]:
    (n,) = _U32.unpack_from(body)
    return json.loads(body[4:4 + n]), body[4 + n:]


def _join(header: dict, blobs: bytes) -> bytes:
    head = json.dumps(header).encode()
    return _U32.pack(len(head)) + head + blobs


def _edited(method: str, edit) -> bytes:
    reqs = [_req("first"), _req("second")]
    args = (reqs,) if method == "persist_many" else (reqs, "node-b", 2.0, 1.0)
    header, blobs = _split(encode_call(11, method, args))
    edit(header)
    return _join(header, blobs)


@pytest.mark.parametrize("method", ["persist_many", "persist_batch"])
def test_a_negative_blob_index_is_refused_not_read_from_the_end(method):
    """Before the fix blob -2 decoded as blob 0: request 'second' carried 'first's bytes."""
    body = _edited(method, lambda h: h["r"][1]["sec"].__setitem__("data", -2))
    with pytest.raises(DstlError, match="names blob -2, the frame has 2") as e:
        decode_call(body)
    assert e.value.call_id == 11  # answered as that call's error; the lane lives on


@pytest.mark.parametrize("method", ["persist_many", "persist_batch"])
def test_a_blob_named_twice_or_by_nobody_is_refused(method):
    twice = _edited(method, lambda h: h["r"][1]["sec"].__setitem__("data", 0))
    with pytest.raises(DstlError, match="blob 0 is named by two requests"):
        decode_call(twice)
    beyond = _edited(method, lambda h: h["r"][1]["sec"].__setitem__("data", 2))
    with pytest.raises(DstlError, match="names blob 2, the frame has 2"):
        decode_call(beyond)

    def drop_second(h):
        del h["r"][1]

    with pytest.raises(DstlError, match="1 of its 2 blobs named by no request"):
        decode_call(_edited(method, drop_second))


def _packed(*entries: tuple[int, int, int, int, int]) -> str:
    return b"".join(INDEX_ENTRY.pack(*e) for e in entries).hex()


@pytest.mark.parametrize("entry, what", [
    ((3, 1, 2, 0, 99), "bytes 0\\+99\\) outside its section of 20 bytes"),
    ((3, 1, 2, 19, 2), "bytes 19\\+2\\)"),
    ((3, 5, 2, 0, 4), "sqns 5..2"),
])
def test_index_entries_outside_their_section_are_refused(entry, what):
    def edit(h):
        h["r"][0]["sec"]["idx"] = _packed(entry)

    with pytest.raises(DstlError, match=what):
        decode_call(_edited("persist_many", edit))


@pytest.mark.parametrize("idx, what", [
    ("00" * (INDEX_ENTRY.size + 3), f"not whole entries of {INDEX_ENTRY.size}"),
    ("zz", "section index is not hex"),
    ([[0, 3, 1, 2, 0, 4]], "section index is list"),  # the JSON lists of protocol /1
])
def test_a_section_index_that_is_not_packed_entries_is_refused(idx, what):
    with pytest.raises(DstlError, match=what) as e:
        decode_call(_edited("persist_batch", lambda h: h["r"][1]["sec"].__setitem__(
            "idx", idx)))
    assert e.value.call_id == 11


def test_section_sqns_and_a_mark_with_blobs_are_refused():
    with pytest.raises(DstlError, match="section sqns 3..1"):
        decode_call(_edited("persist_many", lambda h: h["r"][0]["sec"].__setitem__(
            "sqn", [3, 1])))
    header, _ = _split(encode_call(4, "mark", ("job", "log", 4, None, None)))
    header["b"] = [3]
    with pytest.raises(DstlError, match="blobs named by no request"):
        decode_call(_join(header, b"abc"))


def test_a_well_formed_frame_still_decodes():
    reqs = [_req("first"), _req("second")]
    assert decode_call(encode_call(1, "persist_many", (reqs,))) == (1, "persist_many", (reqs,))


def test_an_index_entry_of_another_log_is_never_sent_and_entries_are_their_sections():
    """The node must never index one request's bytes as another log's block: the encoder
    refuses such a section before anything goes out (the call fails with that error, its
    requests sent again with the writers' next ones), and a decoded entry is always of its
    section's log."""
    log, other = bytes(range(16)), b"\xff" * 16
    section = EncodedSection(log, b"abcd", (BlockIndex(other, 3, 1, 2, 0, 4),), 1, 2, 0)
    with pytest.raises(DstlError, match="indexes another log's block"):
        encode_call(1, "persist_many", ([PersistRequest("job", section, "s")],))
    (req,) = decode_call(encode_call(1, "persist_many", ([_req("first")],)))[2][0]
    assert {e.log_id for e in req.section.index} == {log}


def test_an_index_field_beyond_its_width_is_refused_before_sending():
    log = bytes(range(16))
    section = EncodedSection(log, b"abcd", (BlockIndex(log, 1 << 32, 1, 2, 0, 4),), 1, 2, 0)
    with pytest.raises(DstlError, match="index entry the lane cannot carry"):
        encode_call(1, "persist_many", ([PersistRequest("job", section, "s")],))


@pytest.mark.parametrize("sqns", [[0, 2], [1, 3], [0, 5]])
def test_index_entry_sqns_outside_their_sections_are_refused(sqns):
    """The section holds sqns 1..2; before the fix an entry claiming others decoded."""
    def edit(h):
        h["r"][0]["sec"]["idx"] = _packed((3, sqns[0], sqns[1], 0, 4))

    with pytest.raises(DstlError, match=f"sqns {sqns[0]}..{sqns[1]}.* section's sqns 1..2"):
        decode_call(_edited("persist_batch", edit))
