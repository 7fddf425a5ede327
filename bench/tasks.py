"""Held-out long-context tasks shared by the drafting benchmarks (suffix, LongSpec, DFlash, TokenSwift), and the
4K-32K-token ones of bench/long_context.py (`long_tasks`, below).

Every source comes from a corpus group that `spyglass.training.data.split_of` puts in the *eval* split (the
salted hash of its package or document), so no training run of ours ever saw it; the choice of files below was
made by size only (2K-7K tokens of context), before any drafter was measured on them.

Kinds: `code` (raw completion of a Python file cut inside it), `edit` (the file in a chat prompt and a request
to rewrite one of its functions), `summary` (a documentation page and a request to summarise it).
"""

from __future__ import annotations

import ast
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from spyglass.training.data import CorpusConfig, split_of

STDLIB = Path(sysconfig.get_paths()["stdlib"])
DOCS = Path("/usr/share/doc/python3.11/html/_sources")
CODE_FILES = ["calendar.py", "plistlib.py", "configparser.py", "base64.py"]
DOC_FILES = ["library/heapq.rst.txt", "library/fractions.rst.txt", "howto/ipaddress.rst.txt", "library/pprint.rst.txt"]
MIN_TOKENS, MAX_TOKENS = 2000, 7000


@dataclass(frozen=True)
class HeldOutTask:
    name: str
    kind: str  # code | edit | summary
    prompt_ids: list[int]
    group: str  # the corpus group it comes from (in the eval split)


def _check_heldout(group: str) -> None:
    if split_of(group, CorpusConfig()) != "eval":
        raise RuntimeError(f"{group} is in the training split: it cannot be a held-out benchmark source")


def _chat(tokenizer, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def _fit(tokenizer, text: str, budget: int) -> str:
    """The longest prefix of `text` (whole lines) within `budget` tokens."""
    lines = text.splitlines(keepends=True)
    lo, hi = 1, len(lines)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.encode("".join(lines[:mid]), add_special_tokens=False)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo])


def _longest_function(source: str) -> str | None:
    try:
        funcs = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    except SyntaxError:
        return None
    return max(funcs, key=lambda f: (f.end_lineno or f.lineno) - f.lineno).name if funcs else None


def _after_def(lines: list[str], at: float = 0.8) -> int:
    """Where to cut `lines` for completion: just after the last one-line `def ...:` at or before `at` of the way in
    (the model writes the body); all of them if there is none."""
    for i in range(int(len(lines) * at), 0, -1):
        if lines[i].lstrip().startswith("def ") and lines[i].rstrip().endswith(":"):
            return i + 1
    return len(lines)


def code_completion(tokenizer, file: str) -> HeldOutTask:
    """The file up to a function body's first line, as raw text to continue (about 80% of the budget in)."""
    module = file.removesuffix(".py")
    _check_heldout(f"code:{module}")
    source = _fit(tokenizer, (STDLIB / file).read_text(), MAX_TOKENS - 200)
    lines = source.splitlines(keepends=True)
    ids = tokenizer.encode("".join(lines[: _after_def(lines)]), add_special_tokens=False)
    return HeldOutTask(f"code:{file}", "code", ids, f"code:{module}")


def code_edit(tokenizer, file: str) -> HeldOutTask:
    module = file.removesuffix(".py")
    _check_heldout(f"code:{module}")
    source = _fit(tokenizer, (STDLIB / file).read_text(), MAX_TOKENS - 300)
    fn = _longest_function(source) or "the first function"
    ask = f"Rewrite the function `{fn}` from the file above with full type hints. Keep its logic unchanged."
    text = f"Here is the file `{file}`:\n\n```python\n{source}\n```\n\n{ask} Output only the code."
    return HeldOutTask(f"edit:{file}", "edit", _chat(tokenizer, text), f"code:{module}")


def summary(tokenizer, doc: str) -> HeldOutTask:
    _check_heldout(f"prose:{doc}")
    body = _fit(tokenizer, (DOCS / doc).read_text(), MAX_TOKENS - 300)
    text = f"{body}\n\nSummarise the documentation above in a few paragraphs, naming its main functions and terms."
    return HeldOutTask(f"summary:{doc}", "summary", _chat(tokenizer, text), f"prose:{doc}")


def heldout_tasks(
    tokenizer, kinds: tuple[str, ...] = ("code", "edit", "summary"), per_kind: int = 3
) -> list[HeldOutTask]:
    """The benchmark prompts (2K-7K tokens each), `per_kind` of each kind, in a fixed order."""
    builders = {
        "code": (code_completion, CODE_FILES),
        "edit": (code_edit, CODE_FILES),
        "summary": (summary, DOC_FILES),
    }
    tasks = []
    for kind in kinds:
        build, sources = builders[kind]
        made = [build(tokenizer, s) for s in sources if (STDLIB / s).exists() or (DOCS / s).exists()]
        made = [t for t in made if MIN_TOKENS <= len(t.prompt_ids) <= MAX_TOKENS]
        tasks.extend(made[:per_kind])
    return tasks


# --------------------------------------------------------------------------- long contexts (4K-32K tokens)
# Kinds: `repo` (several files of one package, then the first part of another file of it, to continue: repository-level
# completion), `edit` (files of a package in a chat prompt and a request to rewrite a function of the last one),
# `quote` (a long run of documentation pages and a request to quote a paragraph deep inside it word for word), `qa`
# (the same kind of text and a question on one of its sections).

# Eval-split packages of the installed environment (site-packages) with 150-600 KB of Python each, whose style is
# unlike the standard library's; chosen by size only, before anything was measured on them. `repo` takes them from
# the first, `edit` from the second (each skips one that is missing or too small for the length asked).
LONG_CODE_PACKAGES = ("prometheus_client", "anyio", "smart_open", "wrapt")
LONG_KINDS = ("repo", "edit", "quote", "qa")
_LONG_MARGIN = 16  # tokens kept free of the budget: pieces counted one by one can merge a token or two when joined


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _package_files(package: str) -> list[Path]:
    """A held-out package's Python files as the training corpus lists them (tests excluded), largest first."""
    from spyglass.training.data import code_documents

    _check_heldout(f"code:{package}")
    files = [Path(d.path) for d in code_documents(CorpusConfig(code_packages=[package]))]
    return sorted(files, key=lambda f: (-f.stat().st_size, str(f)))


def _relative(path: Path, package: str) -> str:
    """`path` from its package's directory on (`anyio/_core/_fileio.py`)."""
    parts = path.parts
    i = max(j for j, p in enumerate(parts) if p in (package, f"{package}.py"))
    return "/".join(parts[i:])


def _fill(tokenizer, blocks: list[str], budget: int) -> tuple[str, int]:
    """Whole `blocks` in order while they fit in `budget` tokens, then the first lines of the next one in the room
    left; returns the text and how many blocks it draws on."""
    text, used = "", 0
    for i, block in enumerate(blocks):
        n = _count(tokenizer, block)
        if used + n > budget:
            part = _fit(tokenizer, block, budget - used) if budget - used > 64 else ""
            return text + part, i + bool(part)
        text += block
        used += n
    return text, len(blocks)


def _repo_header(tokenizer) -> tuple[str, str]:
    """Qwen2.5-Coder's repository format (`<|repo_name|>`, `<|file_sep|>` special tokens) where the tokenizer has it,
    plain comment lines otherwise."""
    vocab = tokenizer.get_vocab()
    if "<|repo_name|>" in vocab and "<|file_sep|>" in vocab:
        return "<|repo_name|>{name}\n", "<|file_sep|>{path}\n"
    return "# repository: {name}\n", "# file: {path}\n"


def repo_completion(tokenizer, package: str, length: int) -> HeldOutTask:
    """Files of `package` (largest first), then the first part of its largest file cut just after a `def` line."""
    files = _package_files(package)
    if len(files) < 2:
        raise ValueError(f"{package} has fewer than two files")
    repo, sep = _repo_header(tokenizer)
    target, others = files[0], files[1:]
    head = _fit(tokenizer, target.read_text(errors="replace"), max(32, min(length // 4, 2048)))
    lines = head.splitlines(keepends=True)
    tail = sep.format(path=_relative(target, package)) + "".join(lines[: _after_def(lines)])
    blocks = [sep.format(path=_relative(f, package)) + f.read_text(errors="replace") + "\n" for f in others]
    top = repo.format(name=package)
    budget = length - _count(tokenizer, top) - _count(tokenizer, tail) - _LONG_MARGIN
    body, _ = _fill(tokenizer, blocks, budget)
    ids = tokenizer.encode(top + body + tail, add_special_tokens=False)
    return HeldOutTask(f"repo:{package}", "repo", ids, f"code:{package}")


def _top_level_prefix(source: str) -> str:
    """`source` up to its last top-level `def`/`class`/decorator line (a cut file then still parses)."""
    lines = source.splitlines(keepends=True)
    for i in range(len(lines) - 1, 0, -1):
        if lines[i].startswith(("def ", "class ", "async def ", "@")):
            return "".join(lines[:i])
    return source


def long_edit(tokenizer, package: str, length: int) -> HeldOutTask:
    """Files of `package` in a chat prompt, its largest file last (its first part, up to a third of the budget), and
    a request to rewrite that file's longest function."""
    files = _package_files(package)
    if len(files) < 2:
        raise ValueError(f"{package} has fewer than two files")
    target, others = files[0], files[1:]
    rel = _relative(target, package)
    source = _top_level_prefix(_fit(tokenizer, target.read_text(errors="replace"), max(32, length // 3)))
    fn = _longest_function(source) or "the first function"
    ask = f"Rewrite the function `{fn}` from `{rel}` above with full type hints. Keep its logic unchanged."

    def file_block(path: str, text: str) -> str:
        return f"### `{path}`\n\n```python\n{text}\n```\n\n"

    last = file_block(rel, source)
    intro = f"Here are files of the Python package `{package}`:\n\n"
    frame = _count(tokenizer, intro + last) + len(_chat(tokenizer, f"{ask} Output only the code."))
    blocks = [file_block(_relative(f, package), f.read_text(errors="replace")) for f in others]
    body, _ = _fill(tokenizer, blocks, length - frame - _LONG_MARGIN)
    text = f"{intro}{body}{last}{ask} Output only the code."
    return HeldOutTask(f"edit:{package}", "edit", _chat(tokenizer, text), f"code:{package}")


def _eval_docs() -> list[Path]:
    """The eval split's documentation pages, largest first (relative paths under the prose root)."""
    from spyglass.training.data import prose_documents

    cfg = CorpusConfig()
    docs = [d for d in prose_documents(cfg) if split_of(d.group, cfg) == "eval"]
    return [Path(d.path) for d in sorted(docs, key=lambda d: (-Path(d.path).stat().st_size, d.path))]


def _doc_run(tokenizer, start: int, budget: int) -> tuple[str, list[str]]:
    """Eval-split pages from the `start`-th largest on (wrapping round), each under its name, within `budget`
    tokens; returns the text and the pages' corpus groups."""
    docs = _eval_docs()
    if not docs:
        raise FileNotFoundError(f"no documentation pages under {DOCS} (apt-get install python3.11-doc)")
    order = docs[start % len(docs) :] + docs[: start % len(docs)]
    names = [str(d.relative_to(DOCS)) for d in order]
    blocks = [f"---- {name} ----\n\n{d.read_text(errors='replace')}\n\n" for name, d in zip(names, order, strict=True)]
    text, used = _fill(tokenizer, blocks, budget)
    groups = [f"prose:{name}" for name in names[:used]]
    for g in groups:
        _check_heldout(g)
    return text, groups


def _deep(items: list[tuple[int, str]], size: int, at: float = 0.65) -> str | None:
    """The first (offset, item) at or after `at` of the way into a text of `size` characters (else the last one)."""
    if not items:
        return None
    return next((item for off, item in items if off >= at * size), items[-1][1])


def _paragraphs(text: str) -> list[tuple[int, str]]:
    """Prose paragraphs (offset, text): at least 200 characters and 8 words on the first line, not markup or a
    title."""
    out, off = [], 0
    for block in text.split("\n\n"):
        s = block.strip("\n")
        prose = s.lstrip()[:1].isalpha() and "\n==" not in s and "\n--" not in s
        if prose and len(s) >= 200 and len(s.lstrip().split("\n", 1)[0].split()) >= 8:
            out.append((off, s))
        off += len(block) + 2
    return out


def _titles(text: str) -> list[tuple[int, str]]:
    """Section titles of reStructuredText (offset, title): a line underlined by a run of one punctuation mark."""
    out, off = [], 0
    lines = text.split("\n")
    for line, under in zip(lines, lines[1:], strict=False):
        title = line.strip()
        if (
            len(title) >= 3
            and line[:1].strip()
            and any(c.isalpha() for c in title)
            and len(under) >= len(title)
            and under[0] in "=-~^*#"
            and under == under[0] * len(under)
        ):
            out.append((off, title))
        off += len(line) + 1
    return out


def _doc_task(tokenizer, start: int, length: int, kind: str, ask, pick, what: str) -> HeldOutTask:
    """Documentation pages from `start` filling `length` tokens with the request `ask(key)` after them, where `key` is
    what `pick(text)` finds about two thirds of the way in (ValueError naming `what` if nothing)."""
    frame = len(_chat(tokenizer, ask("x " * 8)))
    text, groups = _doc_run(tokenizer, start, length - frame - _LONG_MARGIN)
    key = pick(text)
    if key is None:
        raise ValueError(f"no {what} in the documentation run starting at page {start}")
    prompt = _chat(tokenizer, f"{text.rstrip()}\n\n{ask(key)}")
    return HeldOutTask(f"{kind}:{groups[0].split(':', 1)[1]}", kind, prompt, "+".join(groups))


def long_quote(tokenizer, start: int, length: int) -> HeldOutTask:
    """Documentation pages and a request to quote, word for word, a paragraph about two thirds of the way in."""

    def ask(opening: str) -> str:
        return (
            f'Quote, word for word, the paragraph of the documentation above that begins with "{opening}", and the '
            "paragraph after it. Output only the quoted text."
        )

    def opening(text: str) -> str | None:  # the paragraph's first words, spaced as in the text
        para = _deep(_paragraphs(text), len(text))
        return None if para is None else re.match(r"\s*((?:\S+[ \t]+){0,7}\S+)", para).group(1)

    return _doc_task(tokenizer, start, length, "quote", ask, opening, "prose paragraph")


def long_qa(tokenizer, start: int, length: int) -> HeldOutTask:
    """Documentation pages and a question on a section about two thirds of the way in."""

    def ask(title: str) -> str:
        return (
            f'What does the section "{title}" of the documentation above explain? Answer in a few sentences, reusing '
            "the documentation's own wording where you can."
        )

    return _doc_task(tokenizer, start, length, "qa", ask, lambda text: _deep(_titles(text), len(text)), "section title")


def long_task(tokenizer, kind: str, source: str | int, length: int) -> HeldOutTask:
    """One long prompt of `kind` from `source` (a package for repo/edit, a page rank for quote/qa)."""
    if kind == "repo":
        return repo_completion(tokenizer, source, length)
    if kind == "edit":
        return long_edit(tokenizer, source, length)
    if kind == "quote":
        return long_quote(tokenizer, source, length)
    if kind == "qa":
        return long_qa(tokenizer, source, length)
    raise ValueError(f"unknown kind {kind!r}; kinds: {', '.join(LONG_KINDS)}")


def long_tasks(
    tokenizer, lengths: list[tuple[str, int]], kinds: tuple[str, ...] = LONG_KINDS, per_kind: int = 1
) -> list[HeldOutTask]:
    """Per length (label, tokens) and kind, `per_kind` prompts of 85-100% of that many tokens, in a fixed order;
    each task's name ends with its length label (`repo:anyio@16k`). Sources: repo from the first of
    LONG_CODE_PACKAGES on, edit from the second on; quote from the largest eval-split page on, qa from the second
    largest, each next prompt two pages further."""
    sources: dict[str, list] = {
        "repo": list(LONG_CODE_PACKAGES),
        "edit": list(LONG_CODE_PACKAGES[1:] + LONG_CODE_PACKAGES[:1]),
        "quote": list(range(0, 2 * per_kind + 8, 2)),
        "qa": list(range(1, 2 * per_kind + 8, 2)),
    }
    tasks = []
    for label, n in lengths:
        for kind in kinds:
            if kind not in LONG_KINDS:
                raise ValueError(f"unknown kind {kind!r}; kinds: {', '.join(LONG_KINDS)}")
            made, why = [], "no source left"
            for source in sources[kind]:
                try:
                    task = long_task(tokenizer, kind, source, n)
                except (FileNotFoundError, ValueError) as e:  # a package not installed, a source too small
                    why = f"{source}: {e}"
                    continue
                if 0.85 * n <= len(task.prompt_ids) <= n:
                    made.append(HeldOutTask(f"{task.name}@{label}", kind, task.prompt_ids, task.group))
                else:
                    why = f"{source}: {len(task.prompt_ids)} tokens"
                if len(made) == per_kind:
                    break
            if len(made) < per_kind:
                raise RuntimeError(
                    f"only {len(made)} {kind} prompt(s) of ~{n} tokens could be built, {per_kind} asked (last: {why})"
                )
            tasks.extend(made)
    return tasks
