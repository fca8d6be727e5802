"""The project's text: a README that fits on a screen, pages that stay pages, links and
figures that are there, a flag reference that holds every flag, and words about the
project itself, never about the rounds of work or tickets behind it."""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT
from markdown.extensions.toc import slugify

README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
RESULTS_PAGE = os.path.join(DOCS, "benchmarks.md")
IMAGES = os.path.join(DOCS, "images")
PAGES = sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))


def _flag_reference():
    """The site's flag reference hook (docs/hooks/flag_reference.py), imported as MkDocs
    imports it."""
    spec = importlib.util.spec_from_file_location(
        "flag_reference", os.path.join(DOCS, "hooks", "flag_reference.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


flag_reference = _flag_reference()

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


def _lines(path: str) -> int:
    with open(path, encoding="utf-8") as text:
        return text.read().count("\n")


def test_the_readme_fits_on_a_screen_or_two():
    lines = _lines(README)
    assert lines <= 200, f"README.md has {lines} lines: the manual is docs/, the README its door"


def test_the_results_page_is_at_most_1000_lines():
    lines = _lines(RESULTS_PAGE)
    assert lines <= 1000, f"docs/benchmarks.md has {lines} lines: keep the current results only"


@pytest.mark.parametrize(
    "page", [page for page in PAGES if page != RESULTS_PAGE], ids=lambda page: page[len(DOCS) + 1 :]
)
def test_any_other_page_is_at_most_400_lines(page):
    assert _lines(page) <= 400, f"{page} is long: split it by task"


def test_ci_runs_the_readme_set_up_and_first_training_command_as_written():
    with open(README, encoding="utf-8") as readme:
        blocks = re.findall(r"```bash\n(.*?)```", readme.read(), re.DOTALL)
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as script:
        ci = [line for line in script.read().splitlines() if line and not line.startswith("#")]
    # Its output may be kept for a check (`| tee FILE`): the command itself is as written.
    ci = [line.split(" | tee ")[0] for line in ci]
    set_up, first_run = blocks[0].splitlines(), blocks[1].splitlines()
    assert set_up == ['pip install -e ".[test]"', "python -m pytest -q tests"]
    assert first_run == ["ncf-main --dataset synthetic --train_epochs 3 --seed 1"]
    expected = [*set_up, *first_run, "mkdocs build --strict"]
    assert [line for line in ci if line in expected] == expected


def _without_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def _heading_texts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as page:
        headings = re.findall(r"^#{1,6} (.+)$", _without_code(page.read()), re.MULTILINE)
    # As rendered: code spans and links keep their text only.
    return [
        re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "") for heading in headings
    ]


@functools.cache
def _anchors(path: str, github: bool) -> frozenset[str]:
    """The heading anchors of the page at `path`: GitHub's (README links are read
    there) or MkDocs' (the site's pages)."""
    found, seen = set(), {}
    for text in _heading_texts(path):
        if github:
            slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        else:
            slug = slugify(text, "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(f"{slug}{'-' if github else '_'}{count}" if count else slug)
    return frozenset(found)


def _broken_links(path: str, github: bool) -> list[str]:
    with open(path, encoding="utf-8") as page:
        text = _without_code(page.read())
    generated = {os.path.join(DOCS, program.page) for program in flag_reference.PROGRAMS}
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # another site
        file, _, anchor = target.partition("#")
        linked = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if linked in generated and not anchor:
            continue
        if not os.path.exists(linked):
            broken.append(target)
        elif anchor and linked.endswith(".md") and anchor not in _anchors(linked, github):
            broken.append(target)
    return broken


def test_every_link_of_the_readme_reaches_a_file_and_heading_on_github():
    assert _broken_links(README, github=True) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page[len(DOCS) + 1 :])
def test_every_link_of_a_page_reaches_a_page_and_heading_of_the_site(page):
    assert _broken_links(page, github=False) == []


def _helpfull_flags(module: str) -> set[str]:
    """The flags ``python -m MODULE --helpfull`` lists, but for absl's and TensorFlow's,
    which every program has."""
    result = subprocess.run(
        [sys.executable, "-m", module, "--helpfull"], capture_output=True, text=True
    )
    flags, owner = set(), None
    for line in result.stdout.splitlines():
        if re.fullmatch(r"\S+:", line):
            owner = line[:-1]
        elif match := re.match(r"  (?:-\S+,)?--(?:\[no\])?([\w.-]+):", line):
            if owner and not owner.startswith(("absl.", "tensorflow.")):
                flags.add(match.group(1))
    assert flags, f"python -m {module} --helpfull listed no flags:\n{result.stderr[-2000:]}"
    return flags


@pytest.mark.integration
@pytest.mark.parametrize("program", flag_reference.PROGRAMS, ids=lambda program: program.name)
def test_the_flag_reference_holds_every_flag_the_program_lists(program):
    page = flag_reference.reference_page(program)
    documented = set(re.findall(r"^\| `--([\w.-]+)`", page, re.MULTILINE))
    assert documented == _helpfull_flags(program.module)


def test_every_figure_shown_is_there_and_every_figure_there_is_shown():
    shown = set()
    for path in PAGES:
        with open(path) as page:
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
