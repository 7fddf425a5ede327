"""Training-side library code (no Ray here): offline corpora, Anchor-Offset positions, the draft networks' losses
(the networks themselves: `spyglass.models.drafts`) and the DFlash / DeLS and TokenSwift trainers.

The Ray parts (extraction actors, the Ray Train trainer, job entry points) live in `actors/`.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (a checkout or an editable install)


def repo_relative(path: str | Path) -> str:
    """A shipped record names no path of the machine it was trained on."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name
