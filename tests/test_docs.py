"""The project's documents speak of the project: no tracked text file numbers working sessions, and every results
file a document cites (README, BENCHMARKS, RELIABILITY, docs/, infra/README, the model cards) exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

# The word followed by a number, with a space, "-" or "_" between or none, singular or plural (examples in
# test_the_session_check_tells_the_two_senses_apart). Other senses of the word (a pytest session-scoped fixture,
# an HTTP or Ray session, a process session) are not followed by a number.
NUMBERED_SESSION = re.compile(r"\b[Ss]essions?[ _-]?\d+")
# A results file named in a document: `bench/results/NAME.json` or a bare `NAME.png`.
CITED = re.compile(r"(?<![\w/<*.-])((?:bench/results/)?[A-Za-z0-9][\w.-]*\.(?:json|png))\b")
PLACEHOLDER = re.compile(r"[A-Z]{3,}")  # NAME.json, controller_RULE.json: a pattern, not a file
RECORDED = "bench/results/"  # the benches' recorded outputs


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [name for name in out.decode().split("\0") if name]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (NUL bytes or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def numbered_sessions(text: str) -> list[str]:
    return [m.group(0) for m in NUMBERED_SESSION.finditer(text)]


def documents(files: list[str]) -> list[str]:
    return [
        f
        for f in files
        if f in ("README.md", "BENCHMARKS.md", "RELIABILITY.md", "infra/README.md")
        or (f.startswith("docs/") and f.endswith(".md"))
        or (f.startswith("spyglass/drafts/") and f.endswith(".md"))
    ]


def missing_results(text: str, tracked_names: set[str]) -> list[str]:
    """Results files the text cites that do not exist: a `bench/results/...` path must exist there; a bare name
    must be a file in bench/results/ or some tracked file's name (a model card's `training.json`)."""
    missing = []
    for name in sorted({m.group(1) for m in CITED.finditer(text)}):
        if PLACEHOLDER.search(name):
            continue
        if name.startswith(RECORDED):
            ok = (REPO / name).is_file()
        else:
            ok = (RESULTS / name).is_file() or name in tracked_names
        if not ok:
            missing.append(name)
    return missing


def test_no_tracked_text_file_numbers_sessions():
    found = []
    for name in tracked_files():
        if not (REPO / name).is_file():
            continue
        text = text_of(REPO / name)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), start=1):
            found += [f"{name}:{lineno}: {hit}" for hit in numbered_sessions(line)]
    assert found == [], "documents, comments and configs speak of the project, not of sessions:\n" + "\n".join(found)


def test_the_session_check_tells_the_two_senses_apart():
    word = "ses" + "sion"  # spelled in two parts so that this file passes its own check
    for text in (f"measured in {word} 12", f"{word.title()}-4's run", f"{word}s 18-19", f"{word}_9"):
        assert numbered_sessions(text), text
    for text in (f'@pytest.fixture(scope="{word}")', f"start_new_{word}=True", f"the test {word}'s Ray cluster"):
        assert not numbered_sessions(text), text


def test_every_results_file_a_document_cites_exists():
    files = tracked_files()
    names = {Path(f).name for f in files}
    problems = []
    for doc in documents(files):
        problems += [f"{doc}: {name}" for name in missing_results((REPO / doc).read_text(), names)]
    assert problems == [], "documents cite results that do not exist:\n" + "\n".join(problems)


def test_the_citation_check_finds_a_missing_file():
    names = {"training.json"}
    text = (
        "See `bench/results/peers.json` and ([plot](bench/results/peers.png)); `training.json` beside the card; "
        "`bench/results/<name>.json` and `controller_RULE.json` are patterns; gone: `bench/results/peers_old.json`, "
        "`dflash_gone.png`."
    )
    assert missing_results(text, names) == ["bench/results/peers_old.json", "dflash_gone.png"]
