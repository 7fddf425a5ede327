"""Model level: the target's verify logits for a draft tree are the same whichever attention backend runs,
and greedy speculative decoding gives identical output with the hybrid ("cpu") and the naive ("reference")
attention.

Every comparison runs the whole pipeline under the backend being tested: prefill (causal chunks over a
growing prefix) and then one verify pass of a tree. Tolerances on fp32 logits (tiny random models, logits
of magnitude ~1-5): atol 1e-4, rtol 1e-4. bf16: the models differ in where activations get rounded, so
logits are compared at atol 0.15 plus the greedy choice per node must agree where the reference's top-2 gap
exceeds 0.3 (a bf16 rounding step of the logits is ~0.03 at |x| ~ 4).
"""

from __future__ import annotations

import pytest
import torch

from kernels import aten_prefix
from kernels.dispatch import triton_available
from spyglass.drafters.ngram import NgramDrafter
from spyglass.engine import EngineConfig, SpecEngine
from spyglass.models.llama import Segment, Transformer, load_transformer
from spyglass.sampling import SamplingParams
from spyglass.tree import DraftTree
from tests.tiny import free_tokens_curve


def random_tree(n: int, vocab: int, gen: torch.Generator) -> DraftTree:
    """A random draft tree: node i hangs under a random earlier node, tokens random (ids >= 3)."""
    parents = [-1] + [int(torch.randint(max(0, i - 4), i, (), generator=gen)) for i in range(1, n)]
    return DraftTree(torch.randint(3, vocab, (n,), generator=gen), parents)


def verify_logits(model: Transformer, prompt: torch.Tensor, tree: DraftTree, backend: str) -> torch.Tensor:
    """Prefill `prompt` and verify `tree` after it, all with `backend`; returns fp32 logits [n, vocab]."""
    old = model.attention_backend
    model.attention_backend = backend
    try:
        cache = model.new_cache(prompt.shape[0] + len(tree) + 8, 1)
        slot = cache.allocate()
        model.prefill(cache, slot, prompt, chunk_size=48)  # several chunks: the prefill sees a prefix too
        start = cache.lengths[slot]
        seg = Segment(slot, start, tree.tokens, tree.positions(start), tree.mask(), "all")
        return model([seg], cache)[0]
    finally:
        model.attention_backend = old


def make_inputs(model: Transformer, seed: int, prompt_len: int = 150, tree_size: int = 24):
    g = torch.Generator().manual_seed(seed)
    vocab = model.args.vocab_size
    return torch.randint(3, vocab, (prompt_len,), generator=g), random_tree(tree_size, vocab, g)


@pytest.fixture(params=["matmul", "flash", "split"])
def prefix_path(request, monkeypatch):
    """Force the hybrid's prefix part through two matmuls or ATen's flash kernel for CPU, whole or
    split into 3 key chunks (plus a remainder) run as one batch."""
    rows = 10**9 if request.param == "matmul" else 0
    monkeypatch.setattr(aten_prefix, "MATMUL_PREFIX_MAX_ROWS", {torch.float32: rows, torch.bfloat16: rows})
    parts = 3 if request.param == "split" else 1
    monkeypatch.setattr(aten_prefix, "kv_split_parts", lambda dtype, keys: parts)
    return request.param


@pytest.mark.parametrize("other", ["reference", "eager", "sdpa_masked"])
def test_verify_logits_hybrid_equals_other_backends(tiny_target, prefix_path, other):
    prompt, tree = make_inputs(tiny_target, seed=3)
    assert tree.mask() is not None, "the test needs a real tree, not a chain"
    hybrid = verify_logits(tiny_target, prompt, tree, "cpu")
    base = verify_logits(tiny_target, prompt, tree, other)
    assert torch.allclose(hybrid, base, atol=1e-4, rtol=1e-4), f"max diff {(hybrid - base).abs().max():.3g}"
    assert torch.equal(hybrid.argmax(-1), base.argmax(-1))


def test_verify_logits_chain_and_single_token(tiny_target):
    """A chain (mask None -> causal) and a root-only tree (plain decode step) through the hybrid path."""
    prompt, _ = make_inputs(tiny_target, seed=4)
    for tree in (DraftTree.chain(5, [6, 7, 8, 9, 10]), DraftTree.root_only(11)):
        hybrid = verify_logits(tiny_target, prompt, tree, "cpu")
        ref = verify_logits(tiny_target, prompt, tree, "reference")
        assert torch.allclose(hybrid, ref, atol=1e-4, rtol=1e-4)


def test_verify_logits_bf16(tiny_dir):
    model = load_transformer(tiny_dir["llama"], torch.bfloat16)
    prompt, tree = make_inputs(model, seed=5)
    hybrid = verify_logits(model, prompt, tree, "cpu")
    ref = verify_logits(model, prompt, tree, "reference")
    assert torch.allclose(hybrid, ref, atol=0.15, rtol=0.0), f"max diff {(hybrid - ref).abs().max():.3g}"
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.3
    assert torch.equal(hybrid.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.skipif(not triton_available(), reason="triton kernel cannot run (no GPU, no TRITON_INTERPRET=1)")
def test_verify_logits_triton_backend(tiny_dir):
    """The GPU code path (torch prefix fallback + Triton tree kernel, interpreted on CPU) in a real model."""
    model = load_transformer(tiny_dir["llama"])
    prompt, tree = make_inputs(model, seed=6, prompt_len=40, tree_size=12)
    old = model.attention_backend
    model.attention_backend = "triton"
    try:  # prefill with the hybrid, verify with Triton (the interpreter costs ~0.3 s per launch)
        cache = model.new_cache(64, 1)
        slot = cache.allocate()
        model.attention_backend = "cpu"
        model.prefill(cache, slot, prompt)
        seg = Segment(slot, 40, tree.tokens, tree.positions(40), tree.mask(), "all")
        model.attention_backend = "triton"
        got = model([seg], cache)[0]
        model.attention_backend = "reference"
        want = model([seg], cache)[0]
    finally:
        model.attention_backend = old
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"max diff {(got - want).abs().max():.3g}"


@pytest.mark.skipif(not triton_available(), reason="triton kernel cannot run (no GPU, no TRITON_INTERPRET=1)")
def test_batched_verify_triton_backend(tiny_dir):
    """Three sequences with different committed lengths (one empty) and trees of different shapes (a tree, a
    chain, a root-only step) in one forward: the "triton" backend attends to all of them in one batched call
    per layer (prefixes read in place by slot) and gives each the logits it gets alone with the reference."""
    model = load_transformer(tiny_dir["llama"])
    g = torch.Generator().manual_seed(8)
    vocab = model.args.vocab_size
    lengths = {0: 37, 1: 0, 2: 21}
    trees = {0: random_tree(9, vocab, g), 1: DraftTree.chain(5, [6, 7, 8]), 2: DraftTree.root_only(12)}
    old = model.attention_backend
    try:
        results = {}
        for backend in ("reference", "triton"):
            model.attention_backend = "cpu"
            cache = model.new_cache(64, 4)
            slots = [cache.allocate() for _ in range(4)][1:]  # slot 0 stays unused: slot ids != batch rows
            for i, slot in enumerate(slots):
                if lengths[i]:
                    model.prefill(cache, slot, torch.randint(3, vocab, (lengths[i],), generator=g.manual_seed(i)))
            segs = [
                Segment(slot, lengths[i], trees[i].tokens, trees[i].positions(lengths[i]), trees[i].mask(), "all")
                for i, slot in enumerate(slots)
            ]
            model.attention_backend = backend
            results[backend] = model(segs, cache)
    finally:
        model.attention_backend = old
    for got, want in zip(results["triton"], results["reference"], strict=True):
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"max diff {(got - want).abs().max():.3g}"


def test_engine_greedy_identical_with_reference_attention(tiny_target):
    """Speculative greedy decoding (n-gram drafter, batch 2) gives the same tokens with hybrid attention
    as with the naive reference attention."""
    g = torch.Generator().manual_seed(11)
    vocab = tiny_target.args.vocab_size
    prompts = []
    for length in (12, 40, 70):
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        prompts.append(ids + ids[: length // 2] + ids)  # repeats so that n-gram drafts get accepted
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outputs = {}
    old = tiny_target.attention_backend
    try:
        for backend in ("cpu", "reference"):
            tiny_target.attention_backend = backend
            drafter = NgramDrafter(n_min=1, n_max=3, draft_len=6, max_candidates=3)
            engine = SpecEngine(
                tiny_target, drafter, EngineConfig(max_batch=2, max_context=512, controller=free_tokens_curve())
            )
            seqs = engine.run(prompts, params)
            outputs[backend] = [s.output_ids for s in seqs]
            if backend == "cpu":
                taus = [s.stats.summary(s.num_generated)["tau"] for s in seqs]
                assert max(taus) > 1.0, "nothing was accepted: the test would not exercise tree verification"
    finally:
        tiny_target.attention_backend = old
    assert outputs["cpu"] == outputs["reference"]
