"""bench/load.py's merging of an earlier results file, its repeats, how it stops a server, and the bench plots' palette
(the tracked tree's size limit)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from bench.common import plot_panels
from bench.load import Server, earlier_runs, figures_of, median_row, run_order


def _results(path, dtype="float32"):
    raw = {
        "runs": {
            "long_c1": {"spyglass-suffix": {"duration": 10.0, "output_throughput": 2.0}},
            "copy_c1": {"spyglass-suffix": {"output_throughput": 3.0}, "spyglass-ar": {"output_throughput": 2.0}},
        },
        "texts_equal": {"long_c1": [True], "copy_c1": [True, False]},
        "cache_followup": {"cached_fraction": 1.0},
    }
    path.write_text(json.dumps({"figures": {}, "raw": raw, "meta": {"dtype": dtype, "load_at_write": {"time": "t"}}}))
    return path


def test_merge_keeps_the_loads_not_rerun(tmp_path):
    kept = earlier_runs(_results(tmp_path / "load.json"), {"copy_c1"}, "float32")
    assert set(kept["runs"]) == {"long_c1"}
    assert kept["texts_equal"] == {"long_c1": [True]}
    assert kept["merged_from"]["loads"] == ["long_c1"]
    assert kept["cache_followup"] == {"cached_fraction": 1.0}  # no long_c1 / long_c2 in this run
    # a run that makes long_c1 measures its own follow-up
    assert "cache_followup" not in earlier_runs(tmp_path / "load.json", {"long_c1"}, "float32")
    # what this run makes next to what it kept: the figures see both
    raw = {**kept, "runs": {**kept["runs"], "copy_c1": {"spyglass-suffix": {"output_throughput": 3.0},
                                                       "spyglass-ar": {"output_throughput": 2.0}}}}  # fmt: skip
    assert figures_of(raw)["default_vs_plain_copy_c1"] == 1.5


def test_four_streams_over_one_only_within_one_run():
    """A merged file may hold 1 and 4 streams from runs on different days (or VM speeds): no ratio across them."""

    def row(run, tpot, tput):
        return {"spyglass-suffix": {"run": run, "median_tpot_ms": tpot, "output_throughput": tput}}

    raw = {"runs": {"long_c1": row("a", 40.0, 4.0), "long_c4": row("a", 80.0, 6.0)}, "texts_equal": {}}
    f = figures_of(raw)
    assert f["median_tpot_c4_vs_c1"] == 2.0 and f["throughput_c4_vs_c1_long"] == 1.5
    raw["runs"]["long_c1"] = row("b", 30.0, 5.0)
    f = figures_of(raw)
    assert f["median_tpot_c4_vs_c1"] is None and f["throughput_c4_vs_c1_long"] is None


def test_repeats_run_in_mirrored_order_and_give_medians():
    assert run_order(["a", "b", "c"], 1) == [(0, "a"), (0, "b"), (0, "c")]
    assert [s for _, s in run_order(["a", "b", "c"], 3)] == list("abccbaabc")
    one = {"duration": 10.0, "commit": "x", "run": "r", "at": "t0"}
    assert median_row([one]) is one
    two = {"duration": 14.0, "p99_itl_ms": None, "commit": "x", "run": "r", "at": "t1"}
    row = median_row([{**one, "p99_itl_ms": 3.0}, two])
    assert row["duration"] == 12.0 and "p99_itl_ms" not in row  # a figure one repeat lacks is not made up
    assert row["at"] == "t1" and row["commit"] == "x" and len(row["repeats"]) == 2


def test_merge_refuses_another_dtype_and_starts_empty_without_a_file(tmp_path):
    with pytest.raises(SystemExit, match="bfloat16"):
        earlier_runs(_results(tmp_path / "load.json", "bfloat16"), set(), "float32")
    assert earlier_runs(tmp_path / "none.json", set(), "float32") == {}


def test_plots_are_written_with_a_small_palette(tmp_path):
    series = {f"s{i}": (list(range(20)), [x * (i + 1) for x in range(20)]) for i in range(12)}
    path = plot_panels(tmp_path / "p.png", [{"title": "t", "xlabel": "x", "ylabel": "y", "series": series}])
    with Image.open(path) as img:
        assert img.mode == "P"
        assert len(img.getcolors(256)) <= 64


SERVER = """
import signal, subprocess, sys, time
out = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a daemon the server started
def term(*_):
    time.sleep(0.5)
    open(out, "w").write(f"{child.pid} {child.poll() is None}")
    sys.exit(0)  # leaves the child behind
signal.signal(signal.SIGTERM, term)
open(out + ".ready", "w").write("")
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except FileNotFoundError:
        return True


def test_stop_signals_the_server_before_its_session_and_leaves_nothing(tmp_path):
    """The server gets SIGTERM while what it started still runs (its own shutdown stops those: `spyglass serve`'s Ray
    cluster); then whatever its session still holds is stopped too."""
    out = tmp_path / "term"
    server = Server("fake", [sys.executable, "-c", SERVER, str(out)], {}, 0, tmp_path / "log")
    deadline = time.monotonic() + 60
    while not Path(f"{out}.ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    server.stop(grace_s=30)
    pid, alive = out.read_text().split()
    assert alive == "True"  # its child had not been signalled when the server was
    assert server.proc.returncode == 0 and _gone(int(pid))
