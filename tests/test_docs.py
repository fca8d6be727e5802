"""The project's text: a results page that stays a page, figures that are there, and
words about the project itself, never about the rounds of work or tickets behind it."""

from __future__ import annotations

import os
import re

import pytest
from conftest import ROOT

RESULTS_PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
IMAGES = os.path.join(ROOT, "docs", "images")

_ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
# A ticket ("issue 18", "issue #18") or a numbered round of work ("the ninth session",
# "in the 3rd round"); "session" alone is TensorFlow's and ONNX Runtime's word.
_HISTORY = re.compile(
    rf"\bissues? #?\d+|\b(?:{_ORDINALS}|\d+(?:st|nd|rd|th)) (?:work )?(?:session|round)s?\b",
    re.IGNORECASE,
)
_TEXT_SUFFIXES = (".py", ".md", ".sh", ".toml", ".yaml", ".cfg", ".txt")


def _project_text_files() -> list[str]:
    paths = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "pyproject.toml")]
    for folder in ("recommendation", "official", "scripts", "docs", "tests", ".ci"):
        for directory, subfolders, names in os.walk(os.path.join(ROOT, folder)):
            subfolders[:] = [name for name in subfolders if name != "__pycache__"]
            paths += [
                os.path.join(directory, name)
                for name in names
                if name.endswith(_TEXT_SUFFIXES) or folder == ".ci"
            ]
    return sorted(paths)


def test_the_results_page_is_at_most_1000_lines():
    with open(RESULTS_PAGE) as page:
        lines = page.read().count("\n")
    assert lines <= 1000, f"docs/benchmarks.md has {lines} lines: keep the current results only"


def test_every_figure_shown_is_there_and_every_figure_there_is_shown():
    shown = set()
    for name in os.listdir(os.path.join(ROOT, "docs")):
        if name.endswith(".md"):
            with open(os.path.join(ROOT, "docs", name)) as page:
                shown |= set(re.findall(r"!\[[^\]]*\]\(images/([^)]+)\)", page.read()))
    assert shown == set(os.listdir(IMAGES))


@pytest.mark.parametrize(
    "text",
    ["see issue 18", "Issue #7 asked for it", "in the ninth session", "the 3rd round of work"],
)
def test_the_history_pattern_finds_tickets_and_work_rounds(text):
    assert _HISTORY.search(text)


@pytest.mark.parametrize(
    "text",
    ["onnxruntime.InferenceSession", 'scope="session"', "4 interleaved rounds of 128 users"],
)
def test_the_history_pattern_leaves_technical_words_alone(text):
    assert not _HISTORY.search(text)


def test_no_text_names_a_ticket_or_a_work_round():
    found = []
    for path in _project_text_files():
        if path == os.path.abspath(__file__):  # its examples above
            continue
        with open(path, encoding="utf-8", errors="replace") as stream:
            for number, line in enumerate(stream, 1):
                if _HISTORY.search(line):
                    found.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not found, "history belongs in git, not in the project's text:\n" + "\n".join(found)
