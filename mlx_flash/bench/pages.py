"""The generated sections of the results pages (docs/results/*.md): a table written from a record sits
between two markers that name it,

    <!-- begin generated: decode -->
    ...
    <!-- end generated: decode -->

and everything outside the markers is prose a person wrote. `python -m mlx_flash.bench results`
rewrites what lies between each pair and nothing else, so a page's history shows figures and stamps
changing and its prose kept. A numeric table outside the markers is a figure typed by hand: `hand_tables`
finds them, and the tests refuse a page that has one."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import FlashError

BEGIN = re.compile(r"^<!-- begin generated: ([a-z0-9-]+) -->$")
END = re.compile(r"^<!-- end generated: ([a-z0-9-]+) -->$")
NUMBER = re.compile(r"\d")


@dataclass(frozen=True)
class Section:
    name: str
    first: int  # index of the line after the begin marker
    end: int  # index of the end marker


def sections(text: str, where: str = "page") -> list[Section]:
    """The page's generated sections in order; a marker without its partner, a nested or a repeated
    section is refused with the line it is on."""
    out, open_name, first = [], None, 0
    seen = set()
    for i, line in enumerate(text.split("\n")):
        if m := BEGIN.match(line):
            if open_name is not None:
                raise FlashError(f"{where}:{i + 1}: section {m[1]!r} begins inside {open_name!r}")
            if m[1] in seen:
                raise FlashError(f"{where}:{i + 1}: section {m[1]!r} appears twice")
            open_name, first = m[1], i + 1
            seen.add(m[1])
        elif m := END.match(line):
            if m[1] != open_name:
                inside = "no section is open" if open_name is None else f"{open_name!r} is open"
                raise FlashError(f"{where}:{i + 1}: end of {m[1]!r} where {inside}")
            out.append(Section(open_name, first, i))
            open_name = None
    if open_name is not None:
        raise FlashError(f"{where}: section {open_name!r} has no end marker")
    return out


def replace(text: str, bodies: dict[str, str], where: str = "page") -> str:
    """The page with each named section's lines replaced by its new body (sections not in `bodies`
    kept as they are)."""
    lines = text.split("\n")
    for s in reversed(sections(text, where)):
        if s.name in bodies:
            lines[s.first : s.end] = bodies[s.name].split("\n")
    return "\n".join(lines)


def hand_tables(text: str, where: str = "page") -> list[int]:
    """Line numbers (1-based) of the first row of each markdown table outside the generated sections
    whose body rows hold a digit: a figure typed by hand. A table of words (which page holds what) is
    prose."""
    inside = set()
    for s in sections(text, where):
        inside.update(range(s.first - 1, s.end + 1))
    out, start, numeric = [], None, False
    lines = text.split("\n") + [""]
    for i, line in enumerate(lines):
        row = line.startswith("|") and i not in inside
        if row and start is None:
            start, numeric = i, False
        elif row and i - start >= 2:  # past the header and its |---| line
            numeric = numeric or bool(NUMBER.search(line))
        elif not row and start is not None:
            if numeric:
                out.append(start + 1)
            start = None
    return out
