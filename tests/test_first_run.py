"""What a new user sees first: output text without special tokens (CLI, engine, verifier stream),
`python -m spyglass` working like the `spyglass` script, and the README describing what `make run` prints."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from spyglass.engine import EngineConfig, SpecEngine
from spyglass.sampling import SamplingParams
from spyglass.sequence import Sequence

REPO = Path(__file__).resolve().parents[1]
SPYGLASS = Path(sys.executable).with_name("spyglass")
# SmolLM2-Instruct answers this in ~20 tokens and ends with <|im_end|> (greedy, so always the same answer).
SHORT_ANSWER_PROMPT = "Reply with just the word yes."
SPECIAL = re.compile(r"<\|[a-z_]+\|>")


# --- special tokens -------------------------------------------------------------------------------------------------
def _seq(tokenizer, text: str, tail: list[int], stop: tuple[str, ...] = ()) -> Sequence:
    seq = Sequence([1, 2, 3], SamplingParams(max_new_tokens=64, stop=stop))
    for tok in tokenizer.encode(text, add_special_tokens=False) + tail:
        seq.append(tok)
    return seq


def test_engine_text_drops_special_tokens(smollm2):
    model, tok = smollm2
    engine = SpecEngine(model, None, EngineConfig(max_batch=1, max_context=64), tok)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert im_end in model.args.eos_token_ids
    seq = _seq(tok, "hello world", [im_end])
    assert "<|im_end|>" in tok.decode(seq.output_ids)  # what the text used to be
    assert engine.text(seq) == "hello world"
    # Special tokens anywhere in the output, and stop strings still cut the text without them.
    assert engine.text(_seq(tok, "a", [im_start, im_end])) == "a"
    assert engine.text(_seq(tok, "hello world again", [im_end], stop=("again",))) == "hello world "


@pytest.mark.slow
def test_cli_json_text_has_no_special_tokens():
    """The first-run report: `spyglass generate --json` returned text ending in <|im_end|>."""
    proc = subprocess.run(
        [str(SPYGLASS), "generate", "--prompt", SHORT_ANSWER_PROMPT, "--max-new-tokens", "48", "--json"]
        + ["--threads", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["stats"]["finish_reason"] == "stop"  # ended with EOS: the case that showed the token
    assert out["token_ids"][-1] == 2  # <|im_end|>, still among the ids
    assert out["text"].strip() and not SPECIAL.search(out["text"]), out["text"]


@pytest.mark.slow
def test_verifier_stream_has_no_special_tokens():
    """The serving path: streamed deltas and the final text agree and carry no special tokens."""
    from services.verifier import EngineLoop, VerifierConfig, build_engine

    cfg = VerifierConfig(methods=["ngram"], max_batch=1, max_context=1024, threads=1, prefill_step_s=0.2)
    engine, tok, _ = build_engine(cfg)
    assert engine.config.prefill_step_s == 0.2  # the served prefill step budget reaches the engine
    loop = EngineLoop(engine, tok, cfg, name="first-run")

    async def run():
        return [item async for item in loop.generate({"prompt": SHORT_ANSWER_PROMPT, "max_new_tokens": 48})]

    try:
        items = asyncio.run(run())
    finally:
        loop.stop(drain_timeout_s=1.0)
    final = items[-1]
    assert final.get("final") and final["finish_reason"] == "stop", final
    assert final["output_ids"][-1] in engine.eos_ids
    streamed = "".join(item.get("text", "") for item in items)
    assert streamed == final["full_text"]
    assert streamed.strip() and not SPECIAL.search(streamed), streamed


# --- python -m spyglass ---------------------------------------------------------------------------------------------
def test_python_m_spyglass_works_like_the_script():
    module = subprocess.run([sys.executable, "-m", "spyglass", "--help"], capture_output=True, text=True, timeout=120)
    script = subprocess.run([str(SPYGLASS), "--help"], capture_output=True, text=True, timeout=120)
    assert module.returncode == 0, module.stderr
    assert module.stdout.startswith("usage: spyglass ")
    for command in ("generate", "serve", "health", "extract", "train"):
        assert command in module.stdout
    assert module.stdout == script.stdout


def test_python_m_spyglass_passes_the_exit_status():
    bad = subprocess.run(
        [sys.executable, "-m", "spyglass", "generate", "--prompt", "hi", "--top-p", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2
    assert bad.stderr.startswith("spyglass: error:") and "top_p" in bad.stderr


# --- README vs `make run` -------------------------------------------------------------------------------------------
def make_run_command() -> list[str]:
    recipe = re.search(r"^run:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert recipe, "no run target in the Makefile"
    return shlex.split(recipe.group(1).strip().replace("$(VENV)/bin/", ""))


def readme_make_run_paragraph(text: str) -> str:
    match = re.search(r"^`make run` (.+?)\n\n", text, re.M | re.S)
    assert match, "the README does not describe `make run`"
    return match.group(0)


def make_run_readme_problems(paragraph: str, command: list[str]) -> list[str]:
    """The README's promises against what `spyglass serve --once --demo-tokens N` does (services/app.py:
    serve_main and run_demo): stream N tokens of the demo answer, print its stats, repeat the request against
    the context cache, exit. It runs no plain-decoding comparison (that is `spyglass generate --compare-ar`)."""
    from cli.main import build_parser

    args = build_parser().parse_args(command[1:])
    problems = []
    if args.command != "serve" or not args.once or args.no_demo:
        problems.append(f"`make run` runs {shlex.join(command)}: not the one-shot serve demo the README describes")
    if f"{args.demo_tokens} tokens" not in paragraph:
        problems.append(f"the README does not say the demo streams {args.demo_tokens} tokens")
    for promise in ("context cache", "again"):
        if promise not in paragraph:
            problems.append(f"the README omits the repeated request ({promise!r})")
    for sentence in re.split(r"(?<=\.)\s+", paragraph):
        if "plain decoding" in sentence and "--compare-ar" not in sentence:
            problems.append(f"the README promises a plain-decoding comparison `make run` does not print: {sentence!r}")
    return problems


def test_readme_describes_what_make_run_prints():
    paragraph = readme_make_run_paragraph((REPO / "README.md").read_text())
    assert make_run_readme_problems(paragraph, make_run_command()) == []


def test_readme_check_catches_the_old_description():
    old = (
        "`make run` puts a whole Python standard-library module (about 5,000 tokens) in context, asks the model\n"
        "to rewrite one of its functions, streams the answer generated with n-gram (prompt-lookup) drafting and\n"
        "tree verification, then runs plain decoding on the same prompt and prints both speeds and whether the\n"
        "outputs are identical.\n\n"
    )
    assert make_run_readme_problems(old, make_run_command())
    current = readme_make_run_paragraph((REPO / "README.md").read_text())
    assert make_run_readme_problems(current, ["spyglass", "serve", "--once", "--demo-tokens", "64"])
