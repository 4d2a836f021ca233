"""README.md and docs/*.md as the tests read them: fenced code blocks with their language,
the inline code of the prose, and the README's Python blocks made runnable.

The README's Python blocks run as tests (tests/integration/test_readme.py for the blocks
without Spark, tests/spark/test_readme.py for those with it), one after the other in one
namespace, as a reader reads them. Their example paths under ``/data/`` and ``/out/`` are
moved into the test's temporary directory (:func:`runnable`); nothing else is changed."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = (README, *sorted((ROOT / "docs").glob("*.md")))
# what a fence may say: Python runs as a test; everything else must say what it is
LANGUAGES = {"python", "bash", "sh", "console", "text"}
PLACEHOLDER_DIRS = ("/data/", "/out/")  # example paths of the README, see runnable()

_FENCE = re.compile(r"^```(.*)$")
_INLINE = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Block:
    """One fenced code block: the file, the line of its opening fence, its language."""

    path: Path
    line: int
    lang: str
    source: str

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, in order."""
    out: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path.name}:{i + 1}: a code block is never closed")
        out.append(Block(path, i + 1, m.group(1).strip(), "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return out


def python_blocks(path: Path = README) -> list[Block]:
    return [b for b in blocks(path) if b.lang == "python"]


def readme_runs() -> tuple[list[Block], list[Block]]:
    """The README's Python blocks in two runs: those before the first block that uses
    Spark, and that block with every one after it (they go on with its names: the Spark
    session, ``KeyedStatefulOperator``, ``op``)."""
    py = python_blocks(README)
    first = next((i for i, b in enumerate(py) if "spark" in b.source), len(py))
    return py[:first], py[first:]


def prose(path: Path) -> str:
    """``path`` without its fenced blocks (their lines left empty, so spans never join
    across a block)."""
    lines = path.read_text().splitlines()
    fenced: set[int] = set()
    for b in blocks(path):
        fenced.update(range(b.line - 1, b.line + b.source.count("\n") + 1))
    return "\n".join("" if i in fenced else line for i, line in enumerate(lines))


def inline_code(path: Path) -> list[str]:
    """The text of every inline code span (`like this`) of ``path``'s prose, line breaks
    inside a span read as spaces."""
    return [" ".join(m.group(1).split()) for m in _INLINE.finditer(prose(path))]


def runnable(block: Block, tmp: Path) -> str:
    """``block``'s source with the README's example directories (``/data/...``,
    ``/out/...``) moved under ``tmp``: ``file:///data/dstl`` becomes
    ``file://{tmp}/data/dstl``."""
    source = block.source
    for d in PLACEHOLDER_DIRS:
        source = source.replace(d, f"{tmp}{d}")
    return source
