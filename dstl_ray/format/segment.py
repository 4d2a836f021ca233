"""A segment of a changelog file, and the checks every persisted handle's JSON passes.

A :class:`Segment` is one byte range of one changelog file (docs/architecture.md "Handles and
metadata"): writers get it back from their node, nodes and transports pass it along, and
handles of every kind (changelog, materialized, RocksDB) are made of such ranges. Paths in
handles are relative to the job directory and may not escape it; numbers read from storage are
checked before use. Everything here is read back from shared storage, so it is JSON, never
pickle, and bad input raises :class:`~dstl_ray.errors.HandleError` naming what is wrong.
"""

from __future__ import annotations

import json
import re
import reprlib
from dataclasses import dataclass
from typing import Any

from ..errors import HandleError

_PART = r"[A-Za-z0-9][A-Za-z0-9._=-]{0,199}"  # one plain name: never "." or ".."
_SAFE_PART = re.compile(_PART)  # matched whole
_SAFE_PATH = re.compile(f"{_PART}(?:/{_PART})*")  # a whole path of such parts


def show(value: object) -> str:
    """A short, depth-limited repr of a value read from storage, for error messages."""
    return reprlib.repr(value)


def non_negative_int(what: str, value: object) -> int:
    """``value`` if it is a JSON integer >= 0 (not a bool, not a float), else
    :class:`HandleError` naming ``what``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HandleError(f"{what} must be a non-negative int, got {show(value)}")
    return value


def loads(text: str | bytes, what: str) -> Any:
    """Parse JSON read from storage; any malformed input (bad UTF-8, bad syntax, nesting
    too deep for the parser) raises :class:`HandleError` naming ``what``."""
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise HandleError(f"{what} is not valid JSON: {type(e).__name__}: {e}") from None


def check_relative_path(path: object) -> str:
    """A path relative to the job directory, made of plain names only (no ``..``, no
    absolute paths, no URL schemes, no backslashes)."""
    if not isinstance(path, str) or not path or len(path) > 1024:
        raise HandleError(f"bad file path in handle: {show(path)}")
    parts = path.split("/")
    for p in parts:
        if not _SAFE_PART.fullmatch(p) or p in (".", ".."):
            raise HandleError(f"file path {path!r} escapes the job directory or is not a plain "
                              f"relative path")
    return path


@dataclass(frozen=True)
class Segment:
    """One byte range of one file holding a log's changesets ``sqn_min..sqn_max``."""

    path: str  # relative to the job directory, e.g. "dstl/<node>/<uuid>.dstl"
    offset: int
    length: int
    sqn_min: int
    sqn_max: int
    flushed_by: str = ""  # node actor that wrote the file (for releasing unused uploads)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "offset": self.offset, "length": self.length,
                "sqn": [self.sqn_min, self.sqn_max], "node": self.flushed_by}

    @classmethod
    def from_json(cls, d: object) -> Segment:
        """The segment ``d`` describes, checked: a checkpoint's completion, a restore and
        every handle read back parse each segment of every handle, so the well-formed one
        is recognized in one pass (:func:`_plain`), and the rest goes through the checks
        that name what is wrong."""
        if type(d) is dict:
            got = _plain(d)
            if got is not None:
                return cls(*got)
        return cls._checked(d)

    @classmethod
    def _checked(cls, d: object) -> Segment:
        if not isinstance(d, dict):
            raise HandleError(f"segment must be an object, got {type(d).__name__}")
        try:
            path = check_relative_path(d["path"])
            offset, length = d["offset"], d["length"]
            sqn_min, sqn_max = d["sqn"]
            node = d.get("node", "")
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, HandleError):
                raise
            raise HandleError(f"malformed segment {show(d)}: {e}") from None
        for name, v in (("offset", offset), ("length", length), ("sqn_min", sqn_min),
                        ("sqn_max", sqn_max)):
            non_negative_int(f"segment {name}", v)
        if sqn_max < sqn_min or not isinstance(node, str):
            raise HandleError(f"malformed segment {show(d)}")
        return cls(path, offset, length, sqn_min, sqn_max, node)


def _plain(d: dict[str, Any]) -> tuple[str, int, int, int, int, str] | None:
    """``Segment``'s fields from a well-formed segment object in one pass, or None: then
    :meth:`Segment._checked` decides, and names what is wrong. Accepts a subset of what
    that does (exact types, a plain relative path matched whole)."""
    path, offset, length, sqn, node = (d.get("path"), d.get("offset"), d.get("length"),
                                       d.get("sqn"), d.get("node", ""))
    if (type(path) is str and len(path) <= 1024 and type(offset) is int
            and type(length) is int and type(sqn) is list and len(sqn) == 2
            and type(node) is str and offset >= 0 and length >= 0):
        lo, hi = sqn
        if type(lo) is int and type(hi) is int and 0 <= lo <= hi \
                and _SAFE_PATH.fullmatch(path) is not None:
            return path, offset, length, lo, hi, node
    return None
