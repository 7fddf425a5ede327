"""The CLI on bad input: a clear one-line error and exit status 2, never a hang; and one real run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli.main import main

SMALL = ["--max-new-tokens", "4"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "--prompt", "hi", "--top-p", "0"], "top_p"),
        (["generate", "--prompt", "hi", "--top-p", "1.5"], "top_p"),
        (["generate", "--prompt", "hi", "--method", "telepathy"], "unknown method"),
        (["generate", "--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file"),
        (["generate", "--prompt", "   ", *SMALL], "prompt is empty"),
        (["generate", "--prompt", "hi", "--model", "/nonexistent/model", *SMALL], "/nonexistent/model"),
        (["generate", "--prompt", "hi", "--method", "small-lm", *SMALL], "needs a draft model"),
        (["generate", "--prompt", "hi", "--max-context", "1", *SMALL], "in [2, 8192] (the model's context window)"),
        (["generate", "--prompt", "hi", "--max-context", "8193", *SMALL], "in [2, 8192] (the model's context window)"),
        (
            ["generate", "--prompt", "hi", "--method", "small-lm", "--draft-model", "/nonexistent/d", *SMALL],
            "/nonexistent/d",
        ),
        (["generate", "--prompt", "hi", "--device", "cuda", *SMALL], "no CUDA device is visible"),  # (a CPU machine)
        (["generate", "--prompt", "hi", "--device", "tpu9", *SMALL], "unknown device"),
        (["serve", "--device", "cuda:1", "--once"], "no CUDA device is visible"),  # refused before Ray starts
    ],
)
def test_bad_input_gives_clear_error(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("spyglass: error:") and needle in err


def test_prompt_longer_than_context(tmp_path, capsys):
    big = tmp_path / "big.txt"
    big.write_text("word " * 9000)
    assert main(["generate", "--prompt-file", str(big), "--raw", *SMALL]) == 2
    assert "context holds" in capsys.readouterr().err


def test_unreadable_prompt_file(tmp_path, capsys):
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00\x80" * 10)
    assert main(["generate", "--prompt-file", str(binary)]) == 2
    assert "cannot read prompt file" in capsys.readouterr().err


@pytest.mark.slow
def test_json_with_compare_ar():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "spyglass",
            "generate",
            "--prompt",
            "Count from one to ten in words.",
            "--max-new-tokens",
            "16",
            "--compare-ar",
            "--json",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"text", "token_ids", "stats", "ar_identical", "speedup"}
    assert out["ar_identical"] is True
    assert len(out["token_ids"]) == out["stats"]["generated_tokens"] <= 16
    assert {"tau", "tokens_per_s", "acceptance_by_depth"} <= set(out["stats"])
