"""JSON of snapshots made once: what a checkpoint path encodes and decodes again and again.

A checkpoint's snapshots mostly repeat the one before: a backend's materialized state stays
the same object until its next materialization, and a subtask without changes hands out the
same changelog handle. Along the path of a checkpoint through a
:class:`~dstl_ray.checkpoint.hub.CheckpointHub` the same components are encoded by the
participant that answers, decoded with all their checks by the hub, and encoded again into
``_metadata``; for four subtasks that came to 0.8 ms of a 3.3 ms checkpoint without changes
in one process, twice that under load. Two memos keep the results:

- :class:`TextMemo`: an object's JSON text, by object (held while kept, so its ``id`` stays
  its own);
- :class:`DecodeMemo`: what a decoder made of some JSON, by a name the JSON carries (a file, a
  log), handed out again only for JSON equal to a private copy of the JSON it came from.
  Equal as Python compares JSON values (``1`` and ``1.0`` alike), so it belongs where the
  JSON comes from a trusted writer (the hub's participants, who hold its token), not to
  files read back, where a decode must refuse every malformed field.

Both are bounded in entries and in bytes of JSON: a full memo starts over.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

MAX_ENTRIES = 1024
MAX_BYTES = 32 << 20  # of JSON text kept (a large job's materialized index is megabytes)


def json_list(texts: Iterable[str]) -> str:
    """A JSON array of values that are JSON text already."""
    return "[" + ",".join(texts) + "]"


def json_with(fields: dict[str, Any], **encoded: str) -> str:
    """The JSON object of ``fields`` (keys sorted, compact) with members whose values are
    JSON text already (``encoded``, after them)."""
    head = json.dumps(fields, separators=(",", ":"), sort_keys=True)
    tail = "".join(f",{json.dumps(k)}:{v}" for k, v in encoded.items())
    return head[:-1] + tail + "}" if fields else "{" + tail[1:] + "}"


class _Bounded(Generic[T]):
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._memo: dict[Hashable, T] = {}
        self._bytes = 0
        self.hits = 0

    def _keep(self, key: Hashable, value: T, size: int) -> None:
        if size > self.max_bytes:
            return
        if len(self._memo) >= self.max_entries or self._bytes + size > self.max_bytes:
            self._memo.clear()  # (one thread clears while another reads: a miss, no more)
            self._bytes = 0
        self._memo[key] = value
        self._bytes += size


class TextMemo(_Bounded[tuple[Any, str]]):
    """JSON text of objects encoded lately (immutable ones: a frozen dataclass's text never
    changes), by object."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        super().__init__(max_entries, max_bytes)

    def text(self, obj: Any, encode: Callable[[Any], str]) -> str:
        kept = self._memo.get(id(obj))
        if kept is not None and kept[0] is obj:
            self.hits += 1
            return kept[1]
        text = encode(obj)
        self._keep(id(obj), (obj, text), len(text))
        return text


class DecodeMemo(_Bounded[tuple[Any, Any]]):
    """What ``decode`` made of JSON values seen lately, by the name each carries."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        super().__init__(max_entries, max_bytes)

    def decode(self, name: Hashable | None, value: Any, decode: Callable[[Any], T]) -> T:
        """``decode(value)``, or what it gave for an equal value under ``name`` (None: not
        kept). Raises what ``decode`` raises."""
        if name is not None:
            kept = self._memo.get(name)
            if kept is not None and kept[0] == value:
                self.hits += 1
                return kept[1]  # type: ignore[no-any-return]
        out = decode(value)
        if name is not None:
            try:
                text = json.dumps(value)
                copy = json.loads(text)  # (the caller's value may change later)
            except (TypeError, ValueError, RecursionError):
                return out  # not plain JSON: not kept
            self._keep(name, (copy, out), len(text))
        return out
