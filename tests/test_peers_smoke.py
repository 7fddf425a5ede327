"""`bench/peers.py --smoke`: the peer benchmark's plumbing on the real model, with no peer engine installed (its
--peers-dir points at an empty folder): spyglass's methods run in their worker process and equal its plain decoding,
and vLLM and llama.cpp are reported as skipped, their figures null, never as passing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPYGLASS_METHODS = ("ar", "suffix", "ngram", "composite-dflash")


def test_peers_smoke_without_peers(tmp_path):
    out = tmp_path / "peers_smoke.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "peers.py"),
            "--smoke",
            "--out",
            str(out),
            "--peers-dir",
            str(tmp_path / "no-peers"),
            "--threads",
            "1",
        ],  # one thread, as every test: speed is not measured here
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SKIPPED vllm: not installed" in proc.stdout
    assert "SKIPPED llamacpp: not installed" in proc.stdout
    assert out.exists() and out.with_suffix(".png").exists()

    doc = json.loads(out.read_text())
    assert set(doc) == {"figures", "raw", "meta"}
    figures, meta = doc["figures"], doc["meta"]
    assert meta["smoke"] is True
    assert meta["lanes"] == [f"spyglass:{m}" for m in SPYGLASS_METHODS]
    assert set(meta["skipped"]) == {"vllm", "llamacpp"}
    assert all("make peers" in why for why in meta["skipped"].values())
    assert meta["cpu"] and set(meta["probes"]) == set(doc["raw"]["per_prompt"])  # a probe before each prompt
    assert all(p["read_bandwidth_gbs"] > 0 and p["matmul_peak_gflops"] > 0 for p in meta["probes"].values())

    # Skipped peers: their figures are null and named in `skipped`, not reported as met.
    assert set(figures["skipped"]) == {"vllm", "llamacpp"}
    for name in (
        "plain_vs_vllm",
        "ttft_vs_vllm",
        "default_vs_vllm_suffix",
        "plain_vs_llamacpp_f32",
        "default_vs_llamacpp_pld",
        "decode_bandwidth_fraction_vllm",
        "decode_bandwidth_fraction_llamacpp",
    ):
        assert figures[name] is None, name

    # spyglass itself: every method's greedy output equals its plain decoding, and the readout is filled in.
    assert figures["default_identical_to_plain"] is True
    assert figures["identical_to_own_plain"] == {f"spyglass:{m}": True for m in SPYGLASS_METHODS}
    assert 0 < figures["decode_bandwidth_fraction"] and 0 < figures["prefill_peak_fraction"]
    ((task, row),) = doc["raw"]["per_prompt"].items()
    assert row["prompt_tokens"] == 160
    for m in SPYGLASS_METHODS:
        run = row["runs"][f"spyglass:{m}"]
        assert run["identical_to_own_plain"] and run["first_diff_vs_own_plain"] is None, (task, m)
        assert run["new_tokens"] == run["output_len"] == meta["max_new_tokens"] == 8
        assert run["ttft_s"] > 0 and run["tok_s"] > 0
        assert run["cpu"]["idle_engines_cores"] == {}  # no other engine ran
