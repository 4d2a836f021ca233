"""JSON of snapshots made once: what a checkpoint path encodes and decodes again and again.

A checkpoint's snapshots mostly repeat the one before: a backend's materialized state stays
the same object until its next materialization, and a subtask without changes hands out the
same changelog handle. Along the path of a checkpoint through a
:class:`~dstl_ray.checkpoint.hub.CheckpointHub` the same components are encoded by the
participant that answers, decoded with all their checks by the hub, and encoded again into
``_metadata``; for four subtasks that came to 0.8 ms of a 3.3 ms checkpoint without changes
in one process, twice that under load. So a participant answers with each snapshot's JSON
text, and two memos keep the results:

- :class:`TextMemo`: an object's JSON text, by object (held while kept, so its ``id`` stays
  its own);
- :class:`DecodeMemo`: what a decoder made of a JSON text, by the text (so the same text
  decodes to the same, immutable, result: a field the checks refuse is refused every time).

Both are bounded in entries and in an estimate of the memory they hold (a multiple of the
JSON text): a full memo starts over.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

MAX_ENTRIES = 1024
# of memory held, estimated as OBJECT_FACTOR times the JSON text (a materialized index's
# section is ~19 bytes of text and ~130 bytes as a tuple of ints): a large job's index is
# megabytes of text, so only a few of its components are kept
MAX_BYTES = 64 << 20
OBJECT_FACTOR = 8


def compact_json(value: Any) -> str:
    """``value`` as compact JSON, keys sorted (how snapshots and metadata are written)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def json_list(texts: Iterable[str]) -> str:
    """A JSON array of values that are JSON text already."""
    return "[" + ",".join(texts) + "]"


def json_with(fields: dict[str, Any], **encoded: str) -> str:
    """The JSON object of ``fields`` (keys sorted, compact) with members whose values are
    JSON text already (``encoded``, after them)."""
    if fields.keys() & encoded.keys():
        raise ValueError(f"members given twice: {sorted(fields.keys() & encoded.keys())}")
    head = compact_json(fields)
    tail = "".join(f",{json.dumps(k)}:{v}" for k, v in encoded.items())
    return head[:-1] + tail + "}" if fields else "{" + tail[1:] + "}"


class _Bounded(Generic[T]):
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._memo: dict[Hashable, tuple[int, T]] = {}  # key -> (its size, value)
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0

    def _get(self, key: Hashable) -> T | None:
        kept = self._memo.get(key)
        return None if kept is None else kept[1]

    def _keep(self, key: Hashable, value: T, text_bytes: int) -> None:
        size = text_bytes * OBJECT_FACTOR
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._memo.pop(key, None)
            if old is not None:
                self._bytes -= old[0]
            if len(self._memo) >= self.max_entries or self._bytes + size > self.max_bytes:
                self._memo.clear()
                self._bytes = 0
            self._memo[key] = (size, value)
            self._bytes += size


class TextMemo(_Bounded[tuple[Any, str]]):
    """JSON text of objects encoded lately (immutable ones: a frozen dataclass's text never
    changes), by object."""

    def text(self, obj: Any, encode: Callable[[Any], str]) -> str:
        kept = self._get(id(obj))
        if kept is not None and kept[0] is obj:
            self.hits += 1
            return kept[1]
        text = encode(obj)
        self._keep(id(obj), (obj, text), len(text))
        return text


class DecodeMemo(_Bounded[Any]):
    """What ``decode`` made of JSON texts seen lately, by text."""

    def decode(self, text: str, decode: Callable[[str], T]) -> T:
        """``decode(text)``, or what it gave for the same text lately. Raises what ``decode``
        raises (nothing is kept then)."""
        kept = self._get(text)
        if kept is not None:
            self.hits += 1
            return kept  # type: ignore[no-any-return]
        out = decode(text)
        self._keep(text, out, len(text))
        return out
