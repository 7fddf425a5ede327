"""Held-out long-context tasks shared by the drafting benchmarks (suffix, LongSpec, DFlash, TokenSwift).

Every source comes from a corpus group that `spyglass.training.data.split_of` puts in the *eval* split (the
salted hash of its package or document), so no training run of ours ever saw it; the choice of files below was
made by size only (2K-7K tokens of context), before any drafter was measured on them.

Kinds: `code` (raw completion of a Python file cut inside it), `edit` (the file in a chat prompt and a request
to rewrite one of its functions), `summary` (a documentation page and a request to summarise it).
"""

from __future__ import annotations

import ast
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


def code_completion(tokenizer, file: str) -> HeldOutTask:
    """The file up to a function body's first line, as raw text to continue (about 80% of the budget in)."""
    module = file.removesuffix(".py")
    _check_heldout(f"code:{module}")
    source = _fit(tokenizer, (STDLIB / file).read_text(), MAX_TOKENS - 200)
    lines = source.splitlines(keepends=True)
    cut = len(lines)
    for i in range(int(len(lines) * 0.8), 0, -1):  # just after a `def` line: the model writes the body
        if lines[i].lstrip().startswith("def ") and lines[i].rstrip().endswith(":"):
            cut = i + 1
            break
    ids = tokenizer.encode("".join(lines[:cut]), add_special_tokens=False)
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
