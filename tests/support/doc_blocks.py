"""The fenced blocks of README.md and docs/*.md, and how a block's text is compared with what a
command printed (tests/test_doc_snippets.py, and tests/test_smoke_nemo.py for the smoke run's
output, which only that run produces)."""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
_FENCE = re.compile(r"^```(\w*)\s*$")
_NUMBER = re.compile(r"-?\d+\.\d+")


@dataclass(frozen=True)
class Block:
    file: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str

    @property
    def key(self) -> str:
        """The file and the block's first line: stable while other blocks move."""
        return f"{self.file}: {self.text.splitlines()[0].strip()}"[:90]


def blocks(files: Sequence[str] = DOCS) -> List[Block]:
    found = []
    for name in files:
        lines, start = (ROOT / name).read_text().splitlines(), None
        for i, line in enumerate(lines):
            fence = _FENCE.match(line)
            if fence and start is None:
                start, lang = i, fence.group(1)
            elif line.rstrip() == "```" and start is not None:
                found.append(Block(name, start + 1, lang, "\n".join(lines[start + 1:i]) + "\n"))
                start = None
    return found


def find(file: str, start: str) -> Block:
    """The one block of ``file`` whose text starts with ``start``."""
    found = [b for b in blocks([file]) if b.text.lstrip().startswith(start)]
    if len(found) != 1:
        raise LookupError(f"{len(found)} blocks of {file} start with {start!r}")
    return found[0]


def _norm(line: str, numbers: bool) -> str:
    if numbers:  # timings differ run to run: a number stands for any number, columns re-flow
        line = " ".join(_NUMBER.sub("#", line).split())
    return line.rstrip()


def _same(expected: str, actual: str, numbers: bool) -> bool:
    want, got = _norm(expected, numbers), _norm(actual, numbers)
    if want.endswith("..."):  # the rest of the line elided
        return got.startswith(want[:-3].rstrip())
    return want == got


def missing_lines(expected: str, actual: str, *, numbers: bool = False,
                  consecutive: bool = False) -> List[str]:
    """The lines of ``expected`` not found, in order, in ``actual``. A line ending in ``...`` is
    a prefix; a line starting with ``...`` is a comment on elided lines and is skipped. With
    ``consecutive``, the lines of each paragraph of ``expected`` follow one another with nothing
    between (a table is one table); otherwise, and between paragraphs, lines the block leaves
    out may lie between them."""
    got = actual.splitlines()
    at, missing, follow = 0, [], False
    for line in expected.splitlines():
        if line.strip().startswith("...") or not line.strip():
            follow = False
            continue
        stop = at + 1 if consecutive and follow else len(got)
        hit = next((i for i in range(at, min(stop, len(got))) if _same(line, got[i], numbers)),
                   None)
        if hit is None:
            missing.append(line)
        else:
            at, follow = hit + 1, True
    return missing
