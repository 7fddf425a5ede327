"""The tracked tree stays small enough to travel (clone, copy to a machine) quickly."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 55


def test_tracked_files_stay_under_the_size_limit():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [ROOT / p for p in listed.decode().split("\0") if p]
    sizes = sorted(((p.stat().st_size, p.relative_to(ROOT)) for p in paths if p.is_file()), reverse=True)
    total = sum(size for size, _ in sizes)
    largest = ", ".join(f"{path} {size / 2**20:.1f} MiB" for size, path in sizes[:8])
    assert total <= LIMIT_MIB * 2**20, f"tracked files: {total / 2**20:.1f} MiB > {LIMIT_MIB} MiB; largest: {largest}"
