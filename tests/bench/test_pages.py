"""mlx_flash/bench/pages.py: generated sections found by their markers, rewritten alone, and a numeric
table outside them found; and the real results pages hold none."""

import os

import pytest

from mlx_flash.bench import pages
from mlx_flash.errors import FlashError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "docs", "results")

PAGE = """# Title

Prose with 3 figures typed in, which prose may hold.

<!-- begin generated: speed -->
| a | b |
|---|---|
| 1 | 2 |
<!-- end generated: speed -->

| word | meaning |
|---|---|
| exact | float arithmetic |
"""


def test_sections_are_found_by_their_markers():
    (s,) = pages.sections(PAGE)
    lines = PAGE.split("\n")
    assert s.name == "speed" and lines[s.first] == "| a | b |" and lines[s.end] == "<!-- end generated: speed -->"


def test_replace_rewrites_the_named_section_and_keeps_the_prose():
    new = pages.replace(PAGE, {"speed": "\n| a | b |\n|---|---|\n| 9 | 9 |\n"})
    assert "| 9 | 9 |" in new and "| 1 | 2 |" not in new
    before, after = PAGE.split("<!-- begin generated: speed -->"), new.split("<!-- begin generated: speed -->")
    assert before[0] == after[0]
    assert PAGE.split("<!-- end generated: speed -->")[1] == new.split("<!-- end generated: speed -->")[1]
    assert pages.replace(new, {"speed": "\n| a | b |\n|---|---|\n| 9 | 9 |\n"}) == new  # same body, same page
    assert pages.replace(PAGE, {}) == PAGE


@pytest.mark.parametrize(
    "text, said",
    [
        ("<!-- begin generated: a -->\n", "has no end marker"),
        ("<!-- begin generated: a -->\n<!-- begin generated: b -->\n", "begins inside 'a'"),
        ("<!-- end generated: a -->\n", "end of 'a' where no section is open"),
        ("<!-- begin generated: a -->\n<!-- end generated: a -->\n" * 2, "appears twice"),
    ],
)
def test_a_broken_marker_is_refused_naming_it(text, said):
    with pytest.raises(FlashError, match=said):
        pages.sections(text, "p.md")


def test_a_numeric_table_outside_the_sections_is_found_and_a_table_of_words_is_not():
    assert pages.hand_tables(PAGE) == []
    typed = PAGE + "\n| engine | tok/s |\n|---|---|\n| ours | 69.9 |\n"
    assert pages.hand_tables(typed) == [len(PAGE.split("\n")) + 1]


def test_no_results_page_has_a_table_typed_by_hand():
    found = {}
    for name in sorted(os.listdir(RESULTS)):
        if name.endswith(".md"):
            with open(os.path.join(RESULTS, name)) as fh:
                lines = pages.hand_tables(fh.read(), name)
            if lines:
                found[name] = lines
    assert not found, f"numeric tables outside generated sections (page: first lines): {found}"
