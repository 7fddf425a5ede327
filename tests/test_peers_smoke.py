"""`bench/peers.py --smoke`: the peer benchmark's plumbing on the real model, with no peer engine installed (its
--peers-dir points at an empty folder), in fp32 and in bf16 in one run: spyglass's methods run in their worker process
and equal its plain decoding in the same dtype, and vLLM and llama.cpp are reported as skipped, their figures null,
never as passing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny import DTYPES

pytestmark = pytest.mark.heavy  # make test-heavy
ROOT = Path(__file__).resolve().parents[1]
SPYGLASS_METHODS = ("ar", "suffix", "ngram", "composite-dflash")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run in both dtypes (each engine in fp32, then in bf16): its stdout and results."""
    tmp_path = tmp_path_factory.mktemp("peers-smoke")
    out = tmp_path / "peers_smoke.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "peers.py"),
            "--smoke",
            "--dtypes",
            "float32,bfloat16",
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
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.exists() and out.with_suffix(".png").exists()
    return proc.stdout, json.loads(out.read_text())


def test_peers_smoke_both_dtypes(smoke):
    stdout, doc = smoke
    assert "SKIPPED vllm: not installed" in stdout
    assert "SKIPPED llamacpp: not installed" in stdout
    assert set(doc) == {"figures", "raw", "meta"}
    figures, meta = doc["figures"], doc["meta"]
    assert meta["smoke"] is True and meta["dtypes"] == ["float32", "bfloat16"]
    assert meta["lanes"] == [f"spyglass:{m}{tag}" for tag in ("", "@bf16") for m in SPYGLASS_METHODS]
    assert set(meta["skipped"]) == {"vllm", "llamacpp"}
    assert "make peers" in meta["skipped"]["vllm"]
    assert meta["cpu"] and set(meta["probes"]) == set(doc["raw"]["per_prompt"])  # a probe before each prompt
    assert all(p["read_bandwidth_gbs"] > 0 and p["matmul_peak_gflops"] > 0 for p in meta["probes"].values())
    assert figures["bf16_vs_fp32_plain"] > 0  # both dtypes ran: spyglass's own bf16 / fp32 plain decode
    assert set(figures["identical_to_own_plain"]) == set(meta["lanes"])
    assert figures["bf16_identical_all"] is True
    assert figures["vllm_bf16_identical_prompts"] is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_peers_smoke_without_peers(smoke, dtype):
    _, doc = smoke
    figures, meta = doc["figures"], doc["meta"]
    name = str(dtype).removeprefix("torch.")
    tag, fig = ("", "") if dtype == torch.float32 else ("@bf16", "_bf16")
    engine = f"spyglass{tag.replace('@', '-')}"
    assert meta["engines"][engine]["info"]["kv_dtype"] == name

    # Skipped peers: their figures are null and named in `skipped`, not reported as met.
    assert set(figures["skipped"]) == {"vllm", "llamacpp"}
    for key in ("plain_vs_vllm", "ttft_vs_vllm", "default_vs_vllm_suffix", "decode_bandwidth_fraction_vllm"):
        assert figures[key + fig] is None, key + fig
    for key in ("plain_vs_llamacpp_f32", "default_vs_llamacpp_pld", "decode_bandwidth_fraction_llamacpp"):
        assert figures[key] is None, key

    # spyglass itself: every method's greedy output equals its plain decoding in this dtype, and the readout is
    # filled in (the bandwidth from this dtype's bytes per weight and K/V element).
    assert figures["default_identical_to_plain" + fig] is True
    assert [figures["identical_to_own_plain"][f"spyglass:{m}{tag}"] for m in SPYGLASS_METHODS] == [True] * 4
    assert 0 < figures["decode_bandwidth_fraction" + fig] and 0 < figures["prefill_peak_fraction" + fig]
    ((task, row),) = doc["raw"]["per_prompt"].items()
    assert row["prompt_tokens"] == 160
    plain = row["runs"][f"spyglass:ar{tag}"]
    assert plain["step_bytes"] == pytest.approx(
        meta["model"]["params"] * (2 if tag else 4) + 30 * 2 * 3 * 64 * (160 + 8 / 2) * (2 if tag else 4)
    )
    for m in SPYGLASS_METHODS:
        run = row["runs"][f"spyglass:{m}{tag}"]
        assert run["identical_to_own_plain"] and run["first_diff_vs_own_plain"] is None, (task, m)
        assert run["new_tokens"] == run["output_len"] == meta["max_new_tokens"] == 8
        assert run["ttft_s"] > 0 and run["tok_s"] > 0
        # only the other dtype's spyglass worker sat beside it: no peer engine ran
        assert set(run["cpu"]["idle_engines_cores"]) <= {"spyglass", "spyglass-bf16"} - {engine}
