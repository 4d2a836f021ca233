"""The lane's messages (dstl_ray.transport.lane), without pickle: a JSON header and the
sections' bytes as binary blobs. Only the calls a lane carries and their answers exist,
each decoded into its dataclasses with every field's type checked, so a frame can never make
the node actor run code, and a malformed one fails with a :class:`DstlError` naming it.

A frame: u64 body length | body. The first bytes of a connection are the protocol's hello and
the node's token, raw. Body of a frame: u32 header length | header (JSON, UTF-8) | blobs (lengths in ``header["b"]``).
Each request names its section's blob by index: every blob exactly once, and every index
entry within its section (its bytes, its sqns), or the frame is refused (it could otherwise
hand one request another's bytes). A section's index goes packed (:data:`INDEX_ENTRY` per
key-group block, hex in the header) without the log id, which every entry shares with its
section: decoding it is one ``struct`` pass, not a JSON list checked field by field (that cost
a node ~1 ms per call of four writers' requests, on every checkpoint's critical path).
"""

from __future__ import annotations

import json
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from .. import errors
from ..errors import DstlError
from ..format.changelog import BlockIndex, EncodedSection
from ..format.segment import Segment
from .base import PersistRequest
from .sender import Caller

_U32 = struct.Struct(">I")
# one index entry of a section: key group, sqn min, sqn max, offset, length (the widths of
# the file footer's entry, dstl_ray.format.changelog; the log id is the section's)
INDEX_ENTRY = struct.Struct(">IQQQI")
# what a lane carries (a writer's two calls, and a child node's batch); the rest goes by Ray
METHODS = ("persist_many", "mark", "persist_batch")


# ---------------------------------------------------------------------- frames

# /2: a section's index packed (/1 sent it as JSON lists); a peer of another version is
# refused at the hello and talks to the node by Ray calls instead
PROTOCOL = b"DSTL-LANE/"
HELLO = PROTOCOL + b"2"  # (a hello's length is fixed: the node reads exactly that many)
TOKEN_BYTES = 32  # the token's length in hex characters
_LEN = struct.Struct(">Q")
MAX_FRAME = 1 << 36  # 64 GiB: a length beyond it is a corrupt frame, not a request


def machine_id() -> str:
    """Names this machine (host name, boot id and network namespace): a Unix lane is used
    only between processes that share it, where a Unix socket path means the same socket.
    Processes in different network namespaces are hosts of their own to each other (each its
    own IP, as containers or the test clusters of ``dstl_ray.local.hosts``): they talk over
    the network, by host lane or Ray, even where a shared file system would let a Unix
    socket through."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        net = os.readlink("/proc/self/ns/net")
    except OSError:
        net = ""
    return f"{socket.gethostname()}/{boot}/{net}"


def frame(body: bytes) -> bytes:
    """One frame: an 8-byte length, then the body (a call or an answer, below)."""
    return _LEN.pack(len(body)) + body


def hello_bytes(token: str) -> bytes:
    """The first bytes of a connection: the protocol and the node's token, raw (the node
    compares them before it reads anything else)."""
    raw = token.encode("ascii")
    if len(raw) != TOKEN_BYTES:
        raise DstlError(f"a lane token has {TOKEN_BYTES} characters, got {len(raw)}")
    return HELLO + raw


def frame_length(header: bytes) -> int:
    (n,) = _LEN.unpack(header)
    if n > MAX_FRAME:
        raise DstlError(f"lane frame of {n} bytes: not a frame of this protocol")
    return n


@dataclass(frozen=True)
class Sent:
    """What releasing a late answer's segment needs of its request (never its bytes)."""

    job_id: str
    log_id: str
    caller: Any  # dstl_ray.transport.sender.Caller | None


def sent_of(method: str, args: tuple[Any, ...]) -> tuple[Sent, ...]:
    """What a late answer to this call would need to release its segments."""
    if method in ("persist_many", "persist_batch") and args:
        return tuple(Sent(r.job_id, r.log_id, r.caller) for r in args[0])
    return ()


class _Blobs:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def add(self, data: bytes) -> int:
        self.parts.append(data)
        return len(self.parts) - 1


def _pack(header: dict[str, Any], blobs: _Blobs) -> bytes:
    header["b"] = [len(p) for p in blobs.parts]
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([_U32.pack(len(head)), head, *blobs.parts])


def _unpack(body: bytes) -> tuple[dict[str, Any], list[memoryview]]:
    try:
        (n,) = _U32.unpack_from(body)
        header = json.loads(bytes(body[4:4 + n]))
        lengths = header["b"]
        blobs, pos = [], 4 + n
        view = memoryview(body)
        for ln in lengths:
            if not isinstance(ln, int) or ln < 0 or pos + ln > len(body):
                raise ValueError("blob lengths beyond the frame")
            blobs.append(view[pos:pos + ln])
            pos += ln
        if pos != len(body) or not isinstance(header, dict):
            raise ValueError("bytes after the last blob")
        return header, blobs
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise DstlError(f"malformed lane frame: {type(e).__name__}: {e}") from None


def _want(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DstlError(f"malformed lane frame: {what} is {type(value).__name__}")
    return value


# ---------------------------------------------------------------------- values


def _caller_out(c: Caller | None) -> Any:
    return None if c is None else [c.namespace, c.ray_job, c.driver]


def _caller_in(v: Any) -> Caller | None:
    if v is None:
        return None
    ns, job, driver = _want(v, list, "caller")
    return Caller(_want(ns, str, "caller namespace"), _want(job, str, "caller job"),
                  _want(driver, bool, "caller driver"))


def _request_out(r: PersistRequest, blobs: _Blobs) -> dict[str, Any]:
    s = r.section
    return {"job": r.job_id, "src": r.source, "trace": [list(t) for t in r.trace],
            "ckpt": r.checkpoint_id, "caller": _caller_out(r.caller), "sub": r.subsumed,
            "inc": r.incarnation, "named": r.named, "proc": r.process,
            "sec": {"log": s.log_id.hex(), "data": blobs.add(s.data), "idx": _index_out(s),
                    "sqn": [s.sqn_min, s.sqn_max], "flags": s.flags}}


def _index_out(s: EncodedSection) -> str:
    """The section's index, packed (hex): an entry of another log, or a field beyond its
    width, raises here, before anything is sent."""
    pack = INDEX_ENTRY.pack
    try:
        packed = b"".join([pack(e.key_group, e.sqn_min, e.sqn_max, e.offset, e.length)
                           for e in s.index if e.log_id == s.log_id])
    except struct.error as e:
        raise DstlError(f"a section of log {s.log_id.hex()} has an index entry the lane "
                        f"cannot carry: {e}") from None
    if len(packed) != INDEX_ENTRY.size * len(s.index):
        raise DstlError(f"a section of log {s.log_id.hex()} indexes another log's block")
    return packed.hex()


def _ints(values: Any, n: int, what: str) -> list[int]:
    values = _want(values, list, what)
    if len(values) != n:
        raise DstlError(f"malformed lane frame: {what} has {len(values)} items, not {n}")
    return [_want(v, int, what) for v in values]


def _hex(v: Any, what: str) -> bytes:
    try:
        return bytes.fromhex(_want(v, str, what))
    except ValueError:
        raise DstlError(f"malformed lane frame: {what} is not hex") from None


def _blob(v: Any, blobs: list[memoryview], taken: set[int]) -> memoryview:
    """The blob a request names: an index into this frame's blobs, each taken once (a
    negative index, as Python reads it, or a shared one would hand one request another's
    bytes)."""
    i = _want(v, int, "section data")
    if not 0 <= i < len(blobs):
        raise DstlError(f"malformed lane frame: section data names blob {i}, the frame has "
                        f"{len(blobs)}")
    if i in taken:
        raise DstlError(f"malformed lane frame: blob {i} is named by two requests")
    taken.add(i)
    return blobs[i]


def _request_in(d: Any, blobs: list[memoryview], taken: set[int]) -> PersistRequest:
    d = _want(d, dict, "request")
    s = _want(d["sec"], dict, "section")
    data = _blob(s["data"], blobs, taken)
    log_id = _hex(s["log"], "log id")
    smin, smax = _ints(s["sqn"], 2, "section sqns")
    if min(smin, smax) < 0 or smin > smax:
        raise DstlError(f"malformed lane frame: section sqns {smin}..{smax}")
    packed = _hex(s["idx"], "section index")
    if len(packed) % INDEX_ENTRY.size:
        raise DstlError(f"malformed lane frame: a section index of {len(packed)} bytes, not "
                        f"whole entries of {INDEX_ENTRY.size}")
    index, size = [], len(data)
    for kg, emin, emax, off, ln in INDEX_ENTRY.iter_unpack(packed):  # (unsigned fields)
        if emin > emax or off + ln > size:
            raise DstlError(f"malformed lane frame: index entry (key group {kg}, sqns "
                            f"{emin}..{emax}, bytes {off}+{ln}) outside its section of "
                            f"{size} bytes")
        if emin < smin or emax > smax:
            raise DstlError(f"malformed lane frame: index entry (key group {kg}) holds sqns "
                            f"{emin}..{emax}, outside its section's sqns {smin}..{smax}")
        index.append(BlockIndex(log_id, kg, emin, emax, off, ln))
    section = EncodedSection(log_id, bytes(data), tuple(index), smin, smax,
                             _want(s["flags"], int, "flags"))
    trace = tuple((_want(k, str, "trace"), _want(v, str, "trace"))
                  for k, v in (_want(t, list, "trace") for t in _want(d["trace"], list,
                                                                      "trace")))
    return PersistRequest(_want(d["job"], str, "job id"), section, _want(d["src"], str, "source"),
                          trace, _want(d["ckpt"], int, "checkpoint id"),
                          _caller_in(d["caller"]), _want(d["sub"], int, "subsumed"),
                          _want(d["inc"], str, "incarnation"), _want(d["named"], int, "named"),
                          _want(d.get("proc", ""), str, "process"))


def _seconds(v: Any, what: str) -> float | None:
    """A time in seconds (or None); JSON gives an int for a whole number."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise DstlError(f"malformed lane frame: {what} is bool")
    return float(_want(v, (int, float), what))


def _error_out(e: BaseException) -> list[str]:
    return [type(e).__name__, str(e)]


def _error_in(v: Any) -> DstlError:
    """The error as its class when it is one of dstl_ray.errors, else a DstlError naming it."""
    name, message = (_want(x, str, "error") for x in _want(v, list, "error"))
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, DstlError):
        try:
            return cls(message)
        except Exception:  # noqa: BLE001 - a class with another constructor
            pass
    return DstlError(f"{name}: {message}")


# ---------------------------------------------------------------------- calls


def encode_call(call_id: int, method: str, args: tuple[Any, ...]) -> bytes:
    blobs = _Blobs()
    if method == "persist_many":
        (requests,) = args
        header = {"id": call_id, "m": method, "r": [_request_out(r, blobs) for r in requests]}
    elif method == "mark":
        job_id, source, checkpoint_id, caller, named = args
        header = {"id": call_id, "m": method,
                  "a": [job_id, source, checkpoint_id, _caller_out(caller), named]}
    elif method == "persist_batch":
        requests, source, budget_s, sent_at = args
        header = {"id": call_id, "m": method, "r": [_request_out(r, blobs) for r in requests],
                  "a": [source, budget_s, sent_at]}
    else:
        raise DstlError(f"the lane carries {', '.join(METHODS)}, not {method!r}")
    return _pack(header, blobs)


def decode_call(body: bytes) -> tuple[int, str, tuple[Any, ...]]:
    """(call id, method, args); a malformed call raises :class:`DstlError` (its id, when
    readable, is in ``.call_id`` so that call alone can be answered)."""
    header, blobs = _unpack(body)
    call_id = _want(header.get("id"), int, "call id")
    try:
        method = header.get("m")
        taken: set[int] = set()
        args: tuple[Any, ...]
        if method == "persist_many":
            args = ([_request_in(r, blobs, taken)
                     for r in _want(header["r"], list, "requests")],)
        elif method == "mark":
            job_id, source, checkpoint_id, caller, named = _want(header["a"], list, "args")
            args = (_want(job_id, str, "job id"), _want(source, str, "source"),
                    _want(checkpoint_id, int, "checkpoint id"), _caller_in(caller),
                    None if named is None else _want(named, int, "named"))
        elif method == "persist_batch":
            source, budget_s, sent_at = _want(header["a"], list, "args")
            args = ([_request_in(r, blobs, taken)
                     for r in _want(header["r"], list, "requests")],
                    _want(source, str, "source"), _seconds(budget_s, "budget"),
                    _seconds(sent_at, "sent at"))
        else:
            raise DstlError(f"the lane carries {', '.join(METHODS)}, not {method!r}")
        if len(taken) != len(blobs):
            raise DstlError(f"malformed lane frame: {len(blobs) - len(taken)} of its "
                            f"{len(blobs)} blobs named by no request")
        return call_id, method, args
    except (KeyError, TypeError, ValueError, IndexError, DstlError) as e:
        err = e if isinstance(e, DstlError) else DstlError(
            f"malformed lane call: {type(e).__name__}: {e}")
        err.call_id = call_id  # type: ignore[attr-defined]
        raise err from None


def encode_answer(call_id: int, ok: bool, value: Any) -> bytes:
    """``value``: a persist_many result (segments or exceptions), None (mark), or the
    exception the call raised (``ok`` False)."""
    if not ok:
        v: Any = {"err": _error_out(value)}
    elif value is None:
        v = None
    else:
        v = [{"err": _error_out(x)} if isinstance(x, BaseException) else {"seg": x.to_json()}
             for x in value]
    return _pack({"id": call_id, "ok": ok, "v": v}, _Blobs())


def decode_answer(body: bytes) -> tuple[int, bool, Any]:
    """(call id, ok, value); a value that does not decode fails its call (ok False) with a
    :class:`DstlError` saying why."""
    header, _ = _unpack(body)
    call_id = _want(header.get("id"), int, "call id")
    try:
        ok, v = _want(header["ok"], bool, "ok"), header["v"]
        if not ok:
            return call_id, False, _error_in(_want(v, dict, "answer")["err"])
        if v is None:
            return call_id, True, None
        return call_id, True, [_error_in(x["err"]) if "err" in x else Segment.from_json(x["seg"])
                               for x in (_want(y, dict, "result") for y in
                                         _want(v, list, "results"))]
    except (KeyError, TypeError, ValueError, DstlError) as e:
        return call_id, False, DstlError(f"the node's answer could not be read here: "
                                         f"{type(e).__name__}: {e}")
