"""bench/gpu_check.py in its --tiny mode: the GPU check's code paths (kernels against references, the engine's
lossless output for every drafter it covers, the verifier's served engine path, the speed section's measurements and
the results file and plot) on the CPU with tiny shapes, so the script a GPU machine runs cannot rot between device
runs. It runs in a subprocess with ray, redis, deepspeed and flash-attn made unimportable (the GPU machines' image has
none of them) and the Triton kernel interpreted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_tiny(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", "import sys, tests.blocked_imports as b; b.run_script(sys.argv[1:])",
           "bench/gpu_check.py", "--tiny", "--budget", "280", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=330)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    fig = doc["figures"]
    assert fig["all_ok"] and not doc["failures"], log
    assert doc["meta"]["tiny"] and doc["meta"]["device"] == "cpu"
    kernels = [c["what"] for c in doc["checks"] if c["section"] == "kernels"]
    for kind in ("tree_kernel ", "tree_kernel batch", "prefix ", "hybrid ", "hybrid batch"):
        assert any(w.startswith(kind) for w in kernels), (kind, kernels)
    assert any("merge_err" in c for c in doc["checks"])  # the merge of two key halves, beside each prefix check
    assert fig["kernels"]["prefix_kernel"] == {"bfloat16": "cpu_flash", "float16": "cpu_flash"}
    engine = {c["what"] for c in doc["checks"] if c["section"] == "engine"}
    for method in ("ar", "ngram", "longspec", "dflash-span"):
        for batch in (1, 4):
            assert f"{method} llama float32 batch {batch}" in engine
    runs = fig["engine"]["float32"]["llama"]
    assert runs["ngram"]["batch4"]["accepted"] > 0  # the identity check verified drafts that were accepted
    served = {c["what"]: c for c in doc["checks"] if c["section"] == "served"}  # the verifier's build_engine path
    for method in ("suffix", "ngram", "ar"):
        assert served[f"{method} float32 served batch"]["ok"]
    assert served["replica auto: on cpu in float32"]["ok"]  # device and dtype "auto" resolved here
    assert served["context cache round trip float32"]["loaded_tokens"] > 0  # through the in-process store
    runs = fig["served"]["identity"]["float32"]
    assert runs["suffix"]["drafted"] + runs["ngram"]["drafted"] > 0
    assert fig["served"]["info"]["auto"]["kernels"]["attention_backend"] == "cpu"
    assert set(fig["served"]["speed"]["ar"]) == {"batch1", "batch4", "batch16"}
    speed = fig["speed"]
    assert speed["decode"]["64"]["eager"]["ms"] > 0 and set(speed["verify_cost"]) == {
        f"ctx{c}_b{b}" for c in (64, 256) for b in (1, 2)
    }
    assert speed["attention"]["256"]["hybrid"] > 0
    assert speed["decode"]["64"]["compile"]["dynamo"]["graphs"] >= 1  # the blocks traced (Dynamo only, on CPU)
    assert (tmp_path / "gpu_check.png").stat().st_size > 0


def test_tiny_output_stays_out_of_bench_results():
    from bench.gpu_check import default_out

    assert default_out(tiny=True) == ROOT / ".cache" / "gpu_check"
    assert default_out(tiny=False) == ROOT / "bench" / "results"
