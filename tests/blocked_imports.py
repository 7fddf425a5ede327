"""Packages the GPU machines' image lacks, made unimportable in a subprocess, so a test proves the core runs without
them: `python -c "import tests.blocked_imports as b; b.install(); ..."`. An import of one raises ImportError, as on
a machine where it is not installed (optional imports then take their fallback, hard ones fail the test)."""

from __future__ import annotations

import importlib.abc
import sys

BLOCKED = ("ray", "redis", "deepspeed", "flash_attn")


class Blocker(importlib.abc.MetaPathFinder):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ImportError(f"{fullname} is not installed here (blocked by tests/blocked_imports.py)", name=fullname)
        return None


def install(names: tuple[str, ...] = BLOCKED) -> None:
    """Block `names` (and their submodules) for the rest of this process; modules already imported are dropped."""
    for mod in [m for m in sys.modules if m.split(".")[0] in names]:
        del sys.modules[mod]
    for name in names:  # as when absent: `import` raises ModuleNotFoundError, `importlib.util.find_spec` gives None
        sys.modules[name] = None
    sys.meta_path.insert(0, Blocker(names))


def run_script(argv: list[str]) -> None:
    """`python -c "import tests.blocked_imports as b; b.run_script(sys.argv[1:])" script.py args...`: block, then run
    the script as __main__ with its arguments."""
    import runpy

    install()
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
