"""Integration on the real default model (SmolLM2-135M-Instruct, fp32, and bf16 where marked): logits against HF
transformers, and greedy identity of every drafter against plain decoding in the same dtype on real prompts, batch 1
and batch 4."""

from __future__ import annotations

import pytest
import torch

from spyglass.demo import code_edit_task
from spyglass.drafters.ngram import NgramDrafter
from spyglass.drafters.small_lm import SmallLMDrafter, truncated_draft
from spyglass.engine import EngineConfig, SpecEngine, plain_generate
from spyglass.models.llama import Segment
from spyglass.sampling import SamplingParams
from tests.tiny import DTYPES, free_tokens_curve

pytestmark = pytest.mark.slow

SHORT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three uses of a binary search tree.",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def target_in(request, dtype):
    """The session's SmolLM2 (model, tokenizer) in `dtype`."""
    return request.getfixturevalue("smollm2" if dtype == torch.float32 else "smollm2_bf16")


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    _, tok = smollm2
    long_prompt = chat_ids(tok, code_edit_task("shlex.py", max_chars=8000).prompt)
    assert len(long_prompt) >= 2000
    return [long_prompt] + [chat_ids(tok, p) for p in SHORT_PROMPTS]


def test_logits_match_hf(smollm2, prompts):
    from transformers import AutoModelForCausalLM

    from spyglass.models.loader import resolve_model

    model, _ = smollm2
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(None).path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts[1])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    cache = model.new_cache(256, 1)
    slot = cache.allocate()
    ours = model([Segment(slot, 0, ids, torch.arange(len(ids)))], cache)[0]
    assert (ours - ref).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    # and plain greedy decoding equals HF's greedy generate
    params = SamplingParams(max_new_tokens=24)
    with torch.no_grad():
        hf_out = hf.generate(ids[None], max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    assert plain_generate(model, prompts[1], params) == hf_out


REFERENCE_TOKENS = 48


@pytest.fixture(scope="module")
def references(request, prompts):
    """`references(dtype)`: plain decoding's first REFERENCE_TOKENS tokens of every prompt, decoded once per dtype
    (greedy: the first n of them are its output at n)."""
    done = {}

    def of(dtype: torch.dtype) -> list[list[int]]:
        if dtype not in done:
            model, _ = target_in(request, dtype)
            done[dtype] = [plain_generate(model, p, SamplingParams(max_new_tokens=REFERENCE_TOKENS)) for p in prompts]
        return done[dtype]

    return of


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_identity_real_prompts(request, dtype, prompts, references):
    model, _ = target_in(request, dtype)
    params = SamplingParams(max_new_tokens=40)  # the 8-layer draft accepts little: enough tokens to see some
    reference = [r[: params.max_new_tokens] for r in references(dtype)]
    drafters = [
        ("ngram", lambda: NgramDrafter()),
        ("small-lm", lambda: SmallLMDrafter(truncated_draft(model, 8), gamma=4, max_batch=4, max_context=4096)),
    ]
    for name, make in drafters:
        for batch, chosen in ((1, prompts[:3]), (4, prompts)):
            engine = SpecEngine(
                model, make(), EngineConfig(max_batch=batch, max_context=4096, controller=free_tokens_curve())
            )
            seqs = engine.run(chosen, params)
            for i, seq in enumerate(seqs):
                assert seq.output_ids == reference[i], f"{name} batch {batch} prompt {i} differs ({dtype})"
            assert sum(s.stats.summary(s.num_generated)["tau"] for s in seqs) / len(seqs) > 1.0


def draft_modules(obj, target, seen=None):
    """The modules a drafter holds (a composite's parts' too), but the target and the modules it shares."""
    seen = set() if seen is None else seen
    if id(obj) in seen or obj is target:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        if not any(obj is m for m in target.modules()):
            yield obj
        return
    if isinstance(obj, list | tuple):
        for item in obj:
            yield from draft_modules(item, target, seen)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("spyglass.drafters"):
        for value in vars(obj).values():
            yield from draft_modules(value, target, seen)


# One method per shipped draft (the composites and the other variants load the same weights)
SHIPPED_DRAFT_METHODS = ("longspec-span", "glide", "dflash-dels-span", "tokenswift")


@pytest.mark.parametrize("dtype", DTYPES)
def test_shipped_drafts_run_in_the_targets_dtype(request, dtype):
    """Each shipped draft on a real code-editing prompt, batch 1: output equal to plain decoding in the target's
    dtype, and every draft weight in that dtype (but the DeLS local head's, which runs in fp32 whatever the target,
    as its model card says)."""
    from spyglass.drafters import build_drafter
    from spyglass.models.drafts.dels import LocalHead

    model, tok = target_in(request, dtype)
    prompt = chat_ids(tok, code_edit_task("shlex.py", max_chars=1000).prompt)
    params = SamplingParams(max_new_tokens=16)
    reference = plain_generate(model, prompt, params)
    differ = []
    for name in SHIPPED_DRAFT_METHODS:
        drafter = build_drafter(name, model, max_batch=1, max_context=1024)
        engine = SpecEngine(model, drafter, EngineConfig(1, 1024, controller=free_tokens_curve()))
        (seq,) = engine.run([prompt], params)
        if seq.output_ids != reference:
            differ.append(name)
        modules = list(draft_modules(drafter, model))
        assert modules, f"{name}: no draft module found"
        for module in modules:
            if isinstance(module, LocalHead):
                continue
            wrong = {t.dtype for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()} - {dtype}
            assert not wrong, f"{name}: {type(module).__name__} holds {wrong} tensors beside a {dtype} target"
    assert not differ, f"differ from plain decoding ({dtype}): {differ}"


def test_small_lm_draft_model_from_a_source(smollm2):
    """`draft_model: SOURCE` (CLI `--draft-model`, the verifier's YAML) loads a model in the target's dtype."""
    from spyglass.drafters import build_drafter
    from spyglass.models.loader import resolve_model

    model, _ = smollm2
    source = str(resolve_model(None, dtype="float32").path)
    draft = build_drafter("small-lm", model, max_batch=1, max_context=256, draft_model=source).draft
    assert draft is not model and draft.dtype == model.dtype
    assert torch.equal(draft.embed.weight, model.embed.weight)


def test_longspec_spans_equal_plain_decoding_on_a_copying_prompt(smollm2, prompts, references):
    """The shipped LongSpec draft with spans on a code-editing prompt, whose output copies its context: chains
    ending in copies and chains that are a copy's continuation alone (no draft step) are proposed, verified, and
    the output is plain decoding's, batch 1 and 4."""
    from spyglass.drafters import build_drafter
    from spyglass.tree import SPAN_SOURCE

    model, _ = smollm2
    params = SamplingParams(max_new_tokens=REFERENCE_TOKENS)
    reference = references(torch.float32)
    for batch, chosen in ((1, prompts[:1]), (4, prompts)):
        drafter = build_drafter("longspec-span", model, max_batch=batch, max_context=4096)
        firsts = []
        propose = drafter.propose

        def watched(seqs, wants, propose=propose, firsts=firsts):
            trees = propose(seqs, wants)
            firsts += [t.sources[1] for t in trees if t.sources is not None]
            return trees

        drafter.propose = watched
        engine = SpecEngine(model, drafter, EngineConfig(batch, 4096, controller=free_tokens_curve()))
        seqs = engine.run(chosen, params)
        for i, seq in enumerate(seqs):
            assert seq.output_ids == reference[i], f"batch {batch} prompt {i} differs from plain decoding"
        assert seqs[0].stats.summary(seqs[0].num_generated)["tau"] > 1.5
        assert 1 in firsts and SPAN_SOURCE in firsts  # copies after a drafted token, and a copy's continuation
