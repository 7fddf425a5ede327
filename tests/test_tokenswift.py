"""TokenSwift and StreamingLLM drafters: the partial KV cache (exact copies, budget, rebuilds, constant memory),
the n-gram table, the tree, heads checkpoints and bad input. Greedy identity and sampling fidelity live in the
shared suites (test_engine_identity.py, test_sampling_fidelity.py)."""

from __future__ import annotations

import json

import pytest
import torch

from spyglass.drafters.base import DraftRequest
from spyglass.drafters.streaming import StreamingDrafter
from spyglass.drafters.tokenswift import CONTEXT_SOURCE, NgramTable, TokenSwiftDrafter, build_tokenswift
from spyglass.engine import EngineConfig, SpecEngine, plain_generate
from spyglass.models.drafts.tokenswift import TokenSwiftHeads, load_heads
from spyglass.partial_kv import PartialKV
from spyglass.sampling import SamplingParams


def _filled_cache(target, length: int, seed: int = 0):
    """A full KVCache slot holding `length` random committed entries (the partial cache only copies them)."""
    a = target.args
    cache = target.new_cache(256, 2)
    slot = cache.allocate()
    g = torch.Generator().manual_seed(seed)
    for layer in range(a.n_layers):
        k, v = cache.layer(slot, layer)
        k[:, :length] = torch.randn(a.n_kv_heads, length, a.head_dim, generator=g)
        v[:, :length] = torch.randn(a.n_kv_heads, length, a.head_dim, generator=g)
    cache.lengths[slot] = length
    return cache, slot


def test_importance_policy_exact_budget_and_rebuild_schedule(tiny_target):
    budget, sinks, prompt = 16, 4, 40
    cache, slot = _filled_cache(tiny_target, 120)
    pkv = PartialKV(budget, sinks, "importance")
    pkv.bind(tiny_target, cache)
    st = pkv.start(slot)
    cache.lengths[slot] = prompt
    pkv.sync(st, slot, query_token=7)
    assert st.rebuilds == 1 and st.filled == budget and pkv.check_exact(st, slot)
    # the selection is the top (budget - sinks) by sum-over-group q.k, best first, per layer and KV head
    q = pkv.queries(slot, prompt, 7)
    a = tiny_target.args
    group = a.n_heads // a.n_kv_heads
    for layer in range(a.n_layers):
        k = cache.layer(slot, layer)[0][:, sinks:prompt]
        scores = torch.einsum("hd,hnd->hn", q[layer].view(a.n_kv_heads, group, -1).sum(1), k)
        want = torch.topk(scores, budget - sinks, dim=-1).indices + sinks
        assert torch.equal(pkv.pos[st.slot, layer, :, sinks:budget], want)
        assert pkv.pos[st.slot, layer, :, :sinks].tolist() == [list(range(sinks))] * a.n_kv_heads
    # new tokens overwrite the least important entries, from the end; the 13th triggers a rebuild
    for n in range(1, 13):
        cache.lengths[slot] = prompt + n
        pkv.sync(st, slot, query_token=7)
        assert st.rebuilds == 1 and st.replaced == n and st.filled == budget
        assert int(pkv.pos[st.slot, 0, 0, budget - n]) == prompt + n - 1
        assert pkv.check_exact(st, slot)
    cache.lengths[slot] = prompt + 13
    pkv.sync(st, slot, query_token=7)
    assert st.rebuilds == 2 and st.replaced == 0 and pkv.check_exact(st, slot)
    # several tokens at once: a rebuild only when they would reach the sinks
    cache.lengths[slot] = prompt + 13 + 12
    pkv.sync(st, slot, query_token=7)
    assert st.rebuilds == 2 and st.replaced == 12
    cache.lengths[slot] = prompt + 13 + 14
    pkv.sync(st, slot, query_token=7)
    assert st.rebuilds == 3 and pkv.check_exact(st, slot)


def test_window_and_static_policies(tiny_target):
    budget, sinks = 12, 2
    cache, slot = _filled_cache(tiny_target, 100, seed=1)
    window, static = PartialKV(budget, sinks, "window"), PartialKV(budget, sinks, "static")
    window.bind(tiny_target, cache)
    static.bind(tiny_target, cache)
    sw, ss = window.start(slot), static.start(slot)
    for length in (5, 12, 30, 31, 37, 60):  # fits, full, over budget, then growing
        cache.lengths[slot] = length
        window.sync(sw, slot, 3)
        static.sync(ss, slot, 3)
        held = sorted(window.pos[sw.slot, 0, 0, : sw.filled].tolist())
        want = list(range(length)) if length <= budget else [0, 1, *range(length - (budget - sinks), length)]
        assert held == want and window.check_exact(sw, slot) and static.check_exact(ss, slot)
        assert sw.filled == min(length, budget) and ss.filled == min(length, budget)
    assert static.pos[ss.slot].max() < 30  # selected once (at 30 tokens), never updated
    assert sw.rebuilds == 0 and ss.rebuilds == 1


def test_partial_cache_in_the_engine_is_exact_and_constant_in_memory(tiny_target):
    drafter = build_tokenswift(tiny_target, "untrained", budget=20, sinks=4)
    engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=1, max_context=400, controller="off"))
    prompt = torch.randint(3, tiny_target.args.vocab_size, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = engine.add_request(prompt, SamplingParams(max_new_tokens=200, ignore_eos=True))
    sizes, rebuilds = [], []
    while not seq.finished:
        engine.step()
        st = seq.drafter_state
        if st is not None and not seq.finished:
            assert drafter.pkv.check_exact(st.partial, seq.slot)
            assert st.partial.filled <= 20
            sizes.append(drafter.partial_bytes(seq))
            rebuilds.append(st.partial.rebuilds)
    assert seq.output_ids == plain_generate(tiny_target, prompt, SamplingParams(max_new_tokens=200, ignore_eos=True))
    assert len(set(sizes)) == 1 and sizes[0] > 0  # constant in the generated length
    assert rebuilds[-1] >= 200 // 16  # one rebuild every (budget - sinks) = 16 generated tokens
    assert drafter.pkv.cache.free_slots == 1  # released


def test_streaming_drafter_memory_constant(tiny_target):
    drafter = StreamingDrafter(budget=24, sinks=4, gamma=3)
    engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=1, max_context=400, controller="off"))
    seq = engine.add_request(list(range(3, 60)), SamplingParams(max_new_tokens=120, ignore_eos=True))
    sizes = set()
    while not seq.finished:
        engine.step()
        if not seq.finished:
            assert drafter.pkv.check_exact(seq.drafter_state.partial, seq.slot)
            sizes.add(drafter.state_bytes(seq))
    assert len(sizes) == 1


def test_ngram_table_incremental_and_top_k():
    tokens = torch.tensor([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 9])
    inc = NgramTable(4)
    for upto in (3, 6, 7, 13):  # in pieces, as tokens get committed
        inc.update(tokens, upto)
    full = NgramTable(4)
    full.update(tokens, 13)
    assert inc.table == full.table and inc.entries == full.entries == 9
    top = inc.top(1, 2)
    assert [c for c, _ in top] == [(2, 3, 4), (2, 3, 5)]  # 2 counts first, then 1
    assert top[0][1] == pytest.approx(2 / 4)
    assert inc.top(42, 5) == [] and inc.top(1, 0) == []


def test_ngram_chains_follow_each_tokens_most_frequent_ngram():
    table = NgramTable(3)
    table.update(torch.tensor([1, 2, 3, 4, 5] * 3), 15)
    pieces = table.extend(2, 7)
    assert [t for cont, _ in pieces for t in cont] == [3, 4, 5, 1, 2, 3, 4]  # the last piece cut to the depth
    assert [len(c) for c, _ in pieces] == [2, 2, 2, 1] and all(0 < f < 1 for _, f in pieces)
    assert table.extend(42, 5) == [] and table.extend(2, 0) == []


def test_free_tree_reaches_ngram_depth_on_a_repeating_passage(tiny_target):
    """Between probes a repeating passage is drafted as deep as `ngram_depth`; 0 keeps the paper's n-grams."""
    vocab = tiny_target.args.vocab_size
    prompt = list(range(vocab)) * 2  # every token, each with one continuation: whatever the root, it repeats
    for depth, expected in ((12, 12), (0, 3)):
        drafter = build_tokenswift(
            tiny_target, "untrained", budget=20, sinks=4, ngram_depth=depth, context_lookup=False
        )
        engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=1, max_context=3 * vocab, controller="off"))
        seq = engine.add_request(prompt, SamplingParams(max_new_tokens=50, ignore_eos=True))
        engine.step()
        tree = drafter.propose([seq], [DraftRequest(free_only=True)])[0]
        assert tree.max_depth == expected
        assert all(tree.scores[i] <= tree.scores[p] for i, p in enumerate(tree.parents) if p >= 0)
        (out,) = engine.run([prompt], SamplingParams(max_new_tokens=30))
        assert out.output_ids == plain_generate(tiny_target, prompt, SamplingParams(max_new_tokens=30))


def test_tree_is_1_3_3_3_plus_ngrams_with_scores(tiny_target):
    drafter = build_tokenswift(tiny_target, "untrained", budget=20, sinks=4, ngram_k=0)
    engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=1, max_context=128, controller="off"))
    seq = engine.add_request([5, 6, 7, 8] * 6, SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.step()
    tree = drafter.propose([seq], [DraftRequest()])[0]
    assert len(tree) == 41 and tree.max_depth == 4
    assert [tree.depths.count(d) for d in range(5)] == [1, 1, 3, 9, 27]
    assert all(tree.scores[i] <= tree.scores[p] + 1e-9 for i, p in enumerate(tree.parents) if p >= 0)
    with_ngrams = build_tokenswift(tiny_target, "untrained", budget=20, sinks=4, ngram_k=20, context_lookup=False)
    engine = SpecEngine(tiny_target, with_ngrams, EngineConfig(max_batch=1, max_context=128, controller="off"))
    seq = engine.add_request([5, 6, 7, 8] * 6, SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.step()
    tree = with_ngrams.propose([seq], [DraftRequest()])[0]
    assert len(tree) >= 41 and len(set(zip(tree.parents, tree.tokens.tolist(), strict=True))) == len(tree)

    # sources: every [1,3,3,3] node carries bit 1, the n-gram paths' nodes bit 2 (nodes on both: 3); a prompt with
    # every token in it, so that whatever p_0's argmax is, the n-gram table continues it
    vocab = tiny_target.args.vocab_size
    engine = SpecEngine(tiny_target, with_ngrams, EngineConfig(max_batch=1, max_context=3 * vocab, controller="off"))
    seq = engine.add_request(list(range(vocab)) * 2, SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()
    tree = with_ngrams.propose([seq], [DraftRequest()])[0]
    assert tree.sources[0] == 0 and all(s in (1, 2, 3) for s in tree.sources[1:])
    assert sum(s & 1 for s in tree.sources) == 40 and any(s == 2 for s in tree.sources)


def test_between_probes_only_the_ngram_table_drafts_from_the_root(tiny_target):
    """With `DraftRequest.free_only` (the controller between probes) the tree is the table's most frequent
    continuations of the root, with no partial-cache pass; greedy and sampled output stay plain decoding's."""
    drafter = build_tokenswift(tiny_target, "untrained", budget=20, sinks=4, ngram_k=3, context_lookup=False)
    no_lookups = build_tokenswift(tiny_target, "untrained", budget=20, ngram_k=0, context_lookup=False)
    assert drafter.traits.free == "part" and no_lookups.traits.free == "none"
    vocab = tiny_target.args.vocab_size  # a prompt with every token: the root has continuations in the table
    engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=1, max_context=3 * vocab, controller="off"))
    seq = engine.add_request(list(range(vocab)) * 2, SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.step()
    synced = seq.drafter_state.partial.synced
    tree = drafter.propose([seq], [DraftRequest(free_only=True)])[0]
    assert seq.drafter_state.partial.synced == synced  # the partial cache was not run
    expected = [cont for cont, _ in seq.drafter_state.ngrams.top(seq.root, 3)]

    def path(node: int) -> tuple[int, ...]:
        return path(tree.parents[node]) + (int(tree.tokens[node]),) if node > 0 else ()

    assert expected and {path(i) for i in range(len(tree)) if tree.depths[i] == 3} == set(expected)
    assert tree.sources[0] == 0 and set(tree.sources[1:]) == {4}
    assert all(tree.scores[i] <= tree.scores[p] for i, p in enumerate(tree.parents) if p >= 0)

    ctl_engine = SpecEngine(tiny_target, build_tokenswift(tiny_target, "untrained", budget=20, sinks=4))
    assert ctl_engine.controller.free_part
    for params in (SamplingParams(max_new_tokens=40), SamplingParams(max_new_tokens=40, temperature=1.0, seed=3)):
        prompt = [5, 6, 7, 8] * 6
        (out,) = ctl_engine.run([prompt], params)
        assert out.output_ids == plain_generate(tiny_target, prompt, params)


def test_context_lookup_drafts_what_followed_the_repeated_suffix(tiny_target):
    """The lookup proposes the continuation of the text's last repeated stretch (between probes, and instead of the
    partial-cache pass where it is likely right); the pass runs where it is not; output stays plain decoding's."""
    vocab = tiny_target.args.vocab_size
    prompt = list(range(vocab)) * 2  # every token once followed by its successor: whatever the root, t -> t + 1
    cfg = EngineConfig(max_batch=1, max_context=3 * vocab, controller="off")

    def path(tree, node: int) -> list[int]:
        return path(tree, tree.parents[node]) + [int(tree.tokens[node])] if node > 0 else []

    for free_only, confident in ((True, 0.25), (False, 0.25), (False, 1.01)):  # 1.01: the lookup is never sure
        drafter = build_tokenswift(tiny_target, "untrained", budget=20, sinks=4, ngram_k=0, confident=confident)
        engine = SpecEngine(tiny_target, drafter, cfg)
        seq = engine.add_request(prompt, SamplingParams(max_new_tokens=50, ignore_eos=True))
        engine.step()
        synced, drafted = seq.drafter_state.partial.synced, drafter.drafted
        tree = drafter.propose([seq], [DraftRequest(free_only=free_only)])[0]
        assert (seq.drafter_state.partial.synced == synced) == (confident < 1)  # the pass ran only where unsure
        assert drafter.drafted - drafted == (confident > 1)
        assert any(s & 1 for s in tree.sources) == (confident > 1)
        looked_up = [i for i in range(len(tree)) if tree.sources[i] & CONTEXT_SOURCE]
        deepest = max(looked_up, key=lambda i: tree.depths[i])
        depth = tree.depths[deepest]
        assert depth >= 2 and path(tree, deepest) == [(seq.root + d) % vocab for d in range(1, depth + 1)]
        assert drafter.state_bytes(seq) > drafter.partial_bytes(seq)  # the lookup's automaton counts

    engine = SpecEngine(tiny_target, build_tokenswift(tiny_target, "untrained", budget=20, sinks=4))
    for params in (SamplingParams(max_new_tokens=40), SamplingParams(max_new_tokens=40, temperature=1.0, seed=3)):
        (out,) = engine.run([prompt], params)
        assert out.output_ids == plain_generate(tiny_target, prompt, params)


def test_draft_pass_off_reads_the_engines_hidden_states(tiny_target):
    heads = TokenSwiftHeads(tiny_target.args.hidden_size, 3)
    drafter = TokenSwiftDrafter(heads, draft_pass=False, ngram_k=4)
    assert drafter.widths == (3, 3, 3)  # one width per head: without the pass there is no p_0 for depth 1
    engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=2, max_context=256))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 5, list(range(10, 40))]
    assert [s.output_ids for s in engine.run(prompts, params)] == [
        plain_generate(tiny_target, p, params) for p in prompts
    ]


def test_heads_checkpoint_round_trip_and_wrong_model(tiny_dir, tmp_path):
    from spyglass.models.llama import load_transformer

    llama, qwen = load_transformer(tiny_dir["llama"]), load_transformer(tiny_dir["qwen2"])
    heads = TokenSwiftHeads(llama.args.hidden_size, 3)
    with torch.no_grad():
        heads.proj.normal_(0, 0.02)
    heads.save(tmp_path / "h", llama)  # stored in bf16, loaded as the fp32 heads run
    loaded = load_heads(tmp_path / "h", llama)
    assert loaded.proj.dtype == torch.float32 and torch.equal(loaded.proj, heads.proj.bfloat16().float())
    with pytest.raises(ValueError, match="trained for another model"):
        load_heads(tmp_path / "h", qwen)
    with pytest.raises(ValueError, match="not a TokenSwift heads checkpoint"):
        load_heads(tmp_path, llama)


def test_budget_larger_than_the_context_is_one_clear_error(tiny_target):
    for drafter in (build_tokenswift(tiny_target, "untrained", budget=512), StreamingDrafter(budget=600)):
        with pytest.raises(ValueError, match="must be smaller than the context"):
            SpecEngine(tiny_target, drafter, EngineConfig(max_batch=1, max_context=512, controller="off"))
    with pytest.raises(ValueError, match="must exceed the sink tokens"):
        PartialKV(4, 4)
    with pytest.raises(ValueError, match="policy"):
        PartialKV(32, 4, "lru")


def test_build_drafter_knows_both_methods(tiny_target):
    from spyglass.drafters import METHODS, build_drafter

    assert "tokenswift" in METHODS and "streaming" in METHODS
    assert isinstance(build_drafter("streaming", tiny_target, partial_budget=32), StreamingDrafter)
    d = build_drafter("tokenswift", tiny_target, draft_checkpoint="untrained", partial_budget=32, ngram_k=0)
    assert isinstance(d, TokenSwiftDrafter) and d.ngram_k == 0
    from spyglass.drafters.tokenswift import DEFAULT_HEADS

    # no shipped heads fit a tiny model: the error names the ones shipped; given explicitly, they are refused
    with pytest.raises(ValueError, match="no TokenSwift heads shipped for this model.*smollm2-135m-tokenswift"):
        build_drafter("tokenswift", tiny_target)
    with pytest.raises(ValueError, match="another model"):
        build_drafter("tokenswift", tiny_target, draft_checkpoint=str(DEFAULT_HEADS))


@pytest.mark.slow
def test_shipped_heads_load_for_smollm2_and_beat_untrained(smollm2):
    from spyglass.drafters import build_drafter
    from spyglass.drafters.tokenswift import DEFAULT_HEADS

    if not DEFAULT_HEADS.is_dir():
        pytest.skip("no TokenSwift heads shipped in this tree")
    target, _ = smollm2
    drafter = build_drafter("tokenswift", target)
    assert drafter.heads.proj.abs().sum() > 0  # trained, not the zero init
    ids = drafter.heads.vocab_ids  # v4 drafts over the 8,192 tokens it was trained on
    assert ids is not None and ids.shape == (8192,) and bool((ids[1:] > ids[:-1]).all())


def test_heads_extraction_cache_never_pairs_states_with_other_contexts(tiny_target, tmp_path):
    """A rebuilt corpus can put other contexts at the same index: the stored shard is then extracted again."""
    from spyglass.training.tokenswift_train import extract

    first, second = torch.randint(0, 100, (2, 3, 16), generator=torch.Generator().manual_seed(0))
    out = tmp_path / "hidden"
    a = extract(tiny_target, first, out, shard=3)
    assert torch.equal(extract(tiny_target, first, out, shard=3), a)  # reused as stored
    b = extract(tiny_target, second, out, shard=3)
    assert not torch.equal(a, b)
    assert torch.equal(b, extract(tiny_target, second, tmp_path / "fresh", shard=3))


def test_distilled_heads_loss_is_cross_entropy_against_the_targets_own_next_token_distribution(tiny_target):
    """Head i at t learns token t+1+i; distilled, its label is the target's distribution there, which the target's
    head gives from the stored hidden state at t+i (no extra extraction)."""
    from spyglass.training.losses import heads_loss

    g = torch.Generator().manual_seed(0)
    d = tiny_target.args.hidden_size
    heads = TokenSwiftHeads(d, gamma=2)
    with torch.no_grad():
        heads.proj.normal_(0, 0.2, generator=g)
    h0 = torch.randn(2, 10, d, generator=g)
    tokens = torch.randint(0, tiny_target.args.vocab_size, (2, 10), generator=g)
    pos = torch.tensor([[0, 1], [1, 4], [1, 6]])
    with torch.no_grad():
        corpus_loss, ces, _ = heads_loss(heads, tiny_target, h0, tokens, pos)
        loss, _, metrics = heads_loss(heads, tiny_target, h0, tokens, pos, distill=1.0)
        streams = heads(h0[pos[:, 0], pos[:, 1]])
        manual, picks_agree, probs = 0.0, [], []
        for i in (1, 2):
            logp = tiny_target.lm_head(tiny_target.norm(streams[i])).log_softmax(-1)
            teacher = tiny_target.lm_head(tiny_target.norm(h0[pos[:, 0], pos[:, 1] + i])).softmax(-1)
            manual += -(teacher * logp).sum(-1).mean()
            picks_agree.append(float((logp.argmax(-1) == teacher.argmax(-1)).float().mean()))
            probs.append(float(teacher.gather(1, logp.argmax(-1, keepdim=True)).mean()))
    assert torch.allclose(corpus_loss, torch.tensor(sum(ces)), atol=1e-5)
    assert torch.allclose(loss, manual, atol=1e-5) and not torch.allclose(loss, corpus_loss, atol=1e-3)
    assert metrics["target_top1"] == pytest.approx(picks_agree) and metrics["target_prob"] == pytest.approx(probs)


def test_heads_loss_under_sampling_matches_what_serving_computes(tiny_target):
    """Trained for a penalised request, head i's teacher at t is the target's sampling distribution for token
    t+1+i (penalty over the window before it, min-p), exactly as `process_in_context` gives it in serving, and the
    head's logits are penalised over the window ending at token t+1, the drafter's start-of-step context. On a
    reduced vocabulary both are the same computation restricted to those columns."""
    from spyglass.sampling import SamplingParams, process_in_context
    from spyglass.training.losses import heads_loss, window_mask

    g = torch.Generator().manual_seed(1)
    d, vocab_size = tiny_target.args.hidden_size, tiny_target.args.vocab_size
    heads = TokenSwiftHeads(d, gamma=2)
    with torch.no_grad():
        heads.proj.normal_(0, 0.2, generator=g)
    h0 = torch.randn(2, 24, d, generator=g)
    tokens = torch.randint(0, 12, (2, 24), generator=g)  # few distinct tokens: windows overlap the predictions
    pos = torch.tensor([[0, 2], [1, 9], [1, 17], [0, 20]])
    params = SamplingParams(temperature=1.0, min_p=0.1, contextual_penalty=1.5, penalty_window=5)

    mask = window_mask(tokens, pos[:, 0], pos[:, 1] + 2, 5, None, vocab_size)
    for row, (c, t) in enumerate(pos.tolist()):
        assert set(mask[row].nonzero().flatten().tolist()) == set(tokens[c, max(0, t + 2 - 5) : t + 2].tolist())

    with torch.no_grad():
        loss, _, metrics = heads_loss(heads, tiny_target, h0, tokens, pos, distill=1.0, sampling=params)
        plain, _, _ = heads_loss(heads, tiny_target, h0, tokens, pos, distill=1.0)
        streams = heads(h0[pos[:, 0], pos[:, 1]])
        manual, probs = 0.0, []
        for i in (1, 2):
            raw = tiny_target.lm_head(tiny_target.norm(streams[i])).float()
            teacher_raw = tiny_target.lm_head(tiny_target.norm(h0[pos[:, 0], pos[:, 1] + i])).float()
            student, teacher = [], []
            for row, (c, t) in enumerate(pos.tolist()):
                greedy = SamplingParams(contextual_penalty=1.5, penalty_window=5)  # penalised logits, as drafted
                student.append(process_in_context(raw[row : row + 1], greedy, tokens[c, : t + 2])[0])
                teacher.append(process_in_context(teacher_raw[row : row + 1], params, tokens[c, : t + i + 1])[0])
            student, teacher = torch.stack(student), torch.stack(teacher)
            manual += -(teacher * student.log_softmax(-1)).sum(-1).mean()
            probs.append(float(teacher.gather(1, student.argmax(-1, keepdim=True)).mean()))
        assert (teacher == 0).any()  # min-p removed some tokens
    assert torch.allclose(loss, manual, atol=1e-5) and not torch.allclose(loss, plain, atol=1e-3)
    assert metrics["target_prob"] == pytest.approx(probs)

    subset = torch.arange(0, vocab_size, 2)  # a reduced vocabulary: the window in its columns
    sub_mask = window_mask(tokens, pos[:, 0], pos[:, 1] + 2, 5, subset, len(subset))
    assert torch.equal(sub_mask, mask[:, subset])


def test_a_bad_sampling_option_in_a_heads_config_is_a_clear_error():
    from spyglass.training.tokenswift_train import resolve_config

    with pytest.raises(ValueError, match="sampling: contextual_penalty must be >= 1"):
        resolve_config({"sampling": {"contextual_penalty": 0.5}})
    with pytest.raises(ValueError, match="repetition_penalty is not modelled"):
        resolve_config({"sampling": {"repetition_penalty": 1.1}})
    with pytest.raises(ValueError, match="sampling:.*unexpected keyword"):
        resolve_config({"sampling": {"theta": 1.2}})
    assert resolve_config({"sampling": {"min_p": 0.1}})["sampling"] == {"min_p": 0.1}


def test_heads_on_a_reduced_vocabulary_score_only_it_and_ship_it(tiny_target, tmp_path):
    """Heads trained on a frequency-ranked vocabulary ship its ids: their logits equal the full head's on those
    tokens and are -inf elsewhere, so the drafter never proposes another token (verification stays exact)."""
    d, vocab_size = tiny_target.args.hidden_size, tiny_target.args.vocab_size
    heads = TokenSwiftHeads(d, 3)
    with torch.no_grad():
        heads.proj.normal_(0, 0.2, generator=torch.Generator().manual_seed(0))
    h = torch.randn(2, d, generator=torch.Generator().manual_seed(1))
    full = heads.logits(tiny_target, h)
    heads.vocab_ids = torch.arange(1, vocab_size, 3)
    part = heads.logits(tiny_target, h)
    assert torch.allclose(part[..., heads.vocab_ids], full[..., heads.vocab_ids], atol=1e-5)
    outside = torch.ones(vocab_size, dtype=torch.bool)
    outside[heads.vocab_ids] = False
    assert torch.isinf(part[..., outside]).all()

    heads.save(tmp_path / "h", tiny_target)
    loaded = load_heads(tmp_path / "h", tiny_target)
    assert torch.equal(loaded.vocab_ids, heads.vocab_ids) and torch.equal(loaded.proj, heads.proj.bfloat16().float())
    drafter = TokenSwiftDrafter(loaded, budget=20, sinks=4, ngram_k=0, context_lookup=False)
    engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=1, max_context=128, controller="off"))
    prompt, params = [5, 6, 7, 8] * 6, SamplingParams(max_new_tokens=12, ignore_eos=True)
    seq = engine.add_request(prompt, params)
    engine.step()
    tree = drafter.propose([seq], [DraftRequest()])[0]
    assert set(tree.tokens[1:].tolist()) <= set(heads.vocab_ids.tolist())
    while not seq.finished:
        engine.step()
    assert seq.output_ids == plain_generate(tiny_target, prompt, params)


def test_heads_model_card_reports_the_sampling_it_was_trained_for(tmp_path):
    from spyglass.training.tokenswift_train import DEFAULTS, write_card

    held = {"positions": 10, "base_top1": 0.5, **{f"head_{k}": [0.1, 0.2, 0.3] for k in ("ce", "top1")}}
    held |= {"head_target_top1": [0.11, 0.12, 0.13], "head_target_prob": [0.21, 0.22, 0.23]}
    sampled = {**held, "head_target_top1": [0.31, 0.32, 0.33], "head_target_prob": [0.41, 0.42, 0.43]}
    report = {
        "model": "m", "train_contexts": 2, "context_tokens": 8, "corpus_train_groups": 1, "steps": 3,
        "positions_per_step": 4, "train_vocab": 16, "train_seconds": 1.0, "final_train_loss": 2.0,
        "heldout_contexts": 1, "heldout_split": "eval", "heldout": held, "heldout_untrained": held,
        "heldout_sampled": sampled,
        "config": {**DEFAULTS, "distill": 0.7, "sampling": {"min_p": 0.1, "contextual_penalty": 1.2}},
    }  # fmt: skip
    (tmp_path / "heads_config.json").write_text(json.dumps({"target": {"hidden_size": 24, "vocab_size": 1000}}))
    card = write_card(report, tmp_path).read_text()
    assert "| head 2 | 0.320 | 0.420 |" in card and "contextual_penalty 1.2" in card
    assert "W_i 24x24" in card and "full 1,000-token vocabulary" in card and "SmolLM2" in card  # the default model
    assert (
        "# TokenSwift heads for qwen"
        in write_card({**report, "config": {**report["config"], "model": "qwen"}}, tmp_path).read_text()
    )
    assert "only these 16 tokens" in card
    plain = write_card({**report, "heldout_sampled": None, "train_vocab": None}, tmp_path).read_text()
    assert "0.420" not in plain and "only these" not in plain and "| head 2 (token t+3) |" in plain


def test_sampled_requests_get_a_chain_with_its_proposal(tiny_target):
    """A sampled request's draft is a chain, one token per distribution p_0..p_3, each drawn where its proposal row
    (handed to the verifier's rejection step) has mass, with `sampled_chain`; by default the token-matched tree."""
    prompt = [5, 6, 7, 8] * 6
    for chained in (True, False):
        drafter = build_tokenswift(tiny_target, "untrained", budget=20, sinks=4, sampled_chain=chained)
        engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=1, max_context=256, controller="off"))
        seq = engine.add_request(prompt, SamplingParams(max_new_tokens=8, temperature=1.0, seed=1))
        engine.step()
        tree = drafter.propose([seq], [DraftRequest()])[0]
        if not chained:
            assert tree.probs is None and not tree.is_chain
            continue
        assert tree.is_chain and len(tree) == 5 and tree.probs is not None
        torch.testing.assert_close(tree.probs[1:].sum(-1), torch.ones(4))
        assert all(float(tree.probs[i, int(tree.tokens[i])]) > 0 for i in range(1, 5))
