"""Real long-context prompts available offline: code-editing tasks over Python standard-library sources.

Used by `make run` (the demo) and by the benchmarks, so both exercise the same kind of workload:
a whole source file in context and an instruction whose answer copies much of it.
"""

from __future__ import annotations

import ast
import sysconfig
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODULE = "textwrap.py"


@dataclass(frozen=True)
class Task:
    name: str
    source: str  # path of the file put in context
    prompt: str


def stdlib_file(name: str) -> Path:
    path = Path(sysconfig.get_paths()["stdlib"]) / name
    if not path.is_file():
        raise FileNotFoundError(f"standard-library source {path} not found (is the Python source installed?)")
    return path


def code_edit_task(module: str = DEFAULT_MODULE, max_chars: int | None = None) -> Task:
    """Put a stdlib module in context and ask for one of its longest functions rewritten with type hints."""
    path = stdlib_file(module)
    source = path.read_text()
    if max_chars is not None:
        source = source[:max_chars]
    try:
        tree = ast.parse(source)
        funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    except SyntaxError:
        funcs = []
    if funcs:
        target = max(funcs, key=lambda f: (f.end_lineno or f.lineno) - f.lineno).name
        ask = f"Rewrite the function `{target}` from the file above with full type hints. Keep its logic unchanged."
    else:
        ask = "Rewrite the first function of the file above with full type hints."
    prompt = f"Here is the file `{module}`:\n\n```python\n{source}\n```\n\n{ask} Output only the code."
    return Task(name=f"code_edit:{module}", source=str(path), prompt=prompt)
