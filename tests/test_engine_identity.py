"""Greedy identity: every drafter's output equals plain greedy decoding token for token."""

from __future__ import annotations

import pytest
import torch

from spyglass.drafters.ngram import NgramDrafter
from spyglass.drafters.small_lm import SmallLMDrafter, truncated_draft
from spyglass.engine import EngineConfig, SpecEngine, plain_generate
from spyglass.sampling import SamplingParams

N_PROMPTS = 20


def make_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Random prompts of mixed lengths, half of them with repeated spans so n-gram drafting fires."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        length = int(torch.randint(4, 90, (), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        if i % 2:
            ids = ids + ids[: length // 2] + ids
        prompts.append(ids)
    return prompts


def drafters(target):
    yield "ngram", NgramDrafter(n_min=1, n_max=3, draft_len=6, max_candidates=3)
    yield "small-lm", SmallLMDrafter(truncated_draft(target, 1), gamma=4, max_batch=4, max_context=512)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=32, ignore_eos=True),
        SamplingParams(max_new_tokens=24, repetition_penalty=1.3, ignore_eos=True),
    ],
    ids=["plain", "rep-penalty"],
)
def test_greedy_identity_batch1_and_batch4(tiny_target, params):
    prompts = make_prompts(tiny_target.args.vocab_size, N_PROMPTS, seed=len(tiny_target.layers))
    reference = [plain_generate(tiny_target, p, params) for p in prompts]
    for name, drafter in drafters(tiny_target):
        for batch in (1, 4):
            engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=batch, max_context=512))
            seqs = engine.run(prompts, params)
            for i, (seq, ref) in enumerate(zip(seqs, reference, strict=True)):
                assert seq.output_ids == ref, f"{name} batch {batch} prompt {i} differs"
            # the drafter really drafted and something was accepted beyond the bonus token
            taus = [s.stats.summary(s.num_generated)["tau"] for s in seqs]
            assert max(taus) > 1.0, f"{name}: nothing was ever accepted"
            assert engine.cache.free_slots == batch, "KV slots leaked"
            if batch == 4:
                assert max(max(s.stats.batch_sizes) for s in seqs) == 4, "sequences were not batched"


def test_plain_engine_equals_reference(tiny_target):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompts = make_prompts(tiny_target.args.vocab_size, 6, seed=7)
    engine = SpecEngine(tiny_target, None, EngineConfig(max_batch=3, max_context=512))
    seqs = engine.run(prompts, params)
    assert [s.output_ids for s in seqs] == [plain_generate(tiny_target, p, params) for p in prompts]
    assert all(s.stats.summary(s.num_generated)["tau"] == 1.0 for s in seqs)
