"""bench/long_context.py: its held-out long prompts, the methods it can run for a model, and a --smoke run end to end
(SmolLM2, short prompts, a real redis-server as the context cache)."""

from __future__ import annotations

import json
import math

import pytest

from bench.long_context import copied_share, main, method_builders, parse_lengths
from bench.tasks import LONG_KINDS, long_tasks
from spyglass.models.llama import PREFILL_CHUNK
from spyglass.training.data import CorpusConfig, split_of


def test_lengths_parse_sort_and_fit_the_window():
    assert parse_lengths("8k,4k,3000", 32768, 128) == [("3000", 3000), ("4k", 4096), ("8k", 8192)]
    assert parse_lengths("32k", 32768, 128) == [("32k", 32768 - 128 - 16)]  # room for the generation
    for bad in ("8x", "k", "40"):
        with pytest.raises(SystemExit):
            parse_lengths(bad, 100, 32)


def test_copied_share_counts_output_tokens_that_end_a_prompt_ngram():
    prompt = [1, 2, 3, 4, 5, 6]
    assert copied_share(prompt, [7, 8]) == 0.0  # nothing of it in the prompt
    assert copied_share([9, 9, 9, 1, 2, 3, 4], [1, 2, 3, 4]) == 0.25  # only the last one ends a prompt 4-gram
    assert copied_share(prompt + [1, 2, 3], [4, 5, 6]) == 1.0  # the prompt's last tokens continue as they did
    assert copied_share(prompt, []) == 0.0


def test_long_tasks_are_held_out_and_sized(smollm2):
    _, tokenizer = smollm2
    tasks = long_tasks(tokenizer, [("1k", 1024), ("2k", 2048)], LONG_KINDS, 1)
    assert [t.kind for t in tasks] == list(LONG_KINDS) * 2
    for task in tasks:
        n = 1024 if task.name.endswith("@1k") else 2048
        assert 0.85 * n <= len(task.prompt_ids) <= n, task.name
        assert all(split_of(g, CorpusConfig()) == "eval" for g in task.group.split("+")), task.group
    repo = tokenizer.decode(tasks[0].prompt_ids)
    assert repo.startswith("# repository: prometheus_client") and repo.count("# file: prometheus_client/") >= 2
    quote = tokenizer.decode(tasks[2].prompt_ids)
    opening = quote.split('begins with "')[1].split('"')[0]
    assert len(opening.split()) == 8 and quote.count(opening) >= 2  # in the text, as the request quotes it


def test_methods_without_a_draft_for_the_model_are_skipped(tiny_target):
    builders, skipped = method_builders(["ar", "suffix", "longspec", "best-composite"], tiny_target, 256)
    assert list(builders) == ["ar", "suffix"]
    assert builders["ar"]() is None and builders["suffix"]().name == "suffix"
    assert "no LongSpec draft ships for this model" in skipped["longspec"]
    assert skipped["best-composite"].startswith("composite-span: no LongSpec draft")
    with pytest.raises(SystemExit, match="unknown method"):
        method_builders(["ar", "medusa"], tiny_target, 256)
    with pytest.raises(SystemExit, match="must include ar"):
        method_builders(["suffix"], tiny_target, 256)


@pytest.mark.heavy
def test_smoke_run_writes_figures_and_every_output_is_plain_decoding(tmp_path):
    path = main(["--smoke", "--out-dir", str(tmp_path), "--methods", "ar,suffix,ngram", "--kinds", "repo,quote"])
    doc = json.loads(path.read_text())
    figures, rows, meta = doc["figures"], doc["raw"], doc["meta"]
    assert figures["identical_all"] is True
    assert (tmp_path / "long_context_smoke.png").is_file()
    assert meta["lengths"] == {"256": 256, "512": 512} and len(rows) == 4
    keys = ("speedup_512_default", "e2e_speedup_512_ngram", "cache_hit_ttft_speedup_512", "prefill_tok_s_512_vs_256")
    for key in keys:
        assert figures[key] > 0, key
    per_token = meta["kv_bytes_per_token"]
    assert figures["kv_slot_bytes"] == per_token * meta["window"]  # one slot at the model's full window
    block = meta["context_cache"]["block_size"]
    for row in rows.values():
        n = row["prompt_tokens"]
        assert row["miss"]["cached_prefix_tokens"] == 0
        assert row["miss"]["cache_bytes"] > 0 and sum(c["tokens"] for c in row["miss"]["chunks"]) == n
        for method, run in row["methods"].items():
            assert run["identical"], method
            # the prefill came from the cache in whole blocks, and whole prefill chunks where they have a fixed size
            grain = block if meta["prefill_row_invariant"] else math.lcm(block, PREFILL_CHUNK)
            assert run["cached_prefix_tokens"] == (n - 1) // grain * grain
            assert run["kv_bytes"] == per_token * (n + run["generated"] - 1)
        assert row["methods"]["suffix"]["draft_state_bytes"] > 0 and row["methods"]["ar"]["draft_state_bytes"] == 0
        assert 0.0 <= row["output_copied"] <= 1.0 and isinstance(row["output_start"], str)


@pytest.mark.bf16
@pytest.mark.heavy
def test_smoke_run_in_bf16_beside_fp32(tmp_path):
    """--dtype float32,bfloat16: every prompt in both dtypes, each output plain decoding's in its own dtype, the bf16
    figures beside the fp32 ones, K/V bytes per token halved."""
    argv = ["--smoke", "--out-dir", str(tmp_path), "--methods", "ar,suffix", "--kinds", "repo", "--lengths", "256"]
    path = main([*argv, "--dtype", "float32,bfloat16"])
    doc = json.loads(path.read_text())
    figures, rows, meta = doc["figures"], doc["raw"], doc["meta"]
    assert meta["dtypes"] == ["float32", "bfloat16"] and len(rows) == 2
    assert {name.endswith(" [bf16]") for name in rows} == {True, False}
    assert figures["kv_bytes_per_token"] == 2 * figures["kv_bytes_per_token_bf16"]
    assert figures["kv_bytes_per_token_bf16_vs_fp32"] == 0.5
    assert figures["ar_tok_s_256_bf16_vs_fp32"] > 0 and figures["speedup_256_default_bf16"] > 0
    for name, row in rows.items():
        per_token = figures["kv_bytes_per_token_bf16" if name.endswith(" [bf16]") else "kv_bytes_per_token"]
        assert row["methods"]["ar"]["kv_bytes"] == per_token * (
            row["prompt_tokens"] + row["methods"]["ar"]["generated"] - 1
        )
    with pytest.raises(SystemExit, match="--dtype takes"):
        main([*argv, "--dtype", "float16"])
    assert figures["identical_all_bf16"] is True  # greedy output equals plain bf16 decoding
    assert figures["identical_all"] is True
