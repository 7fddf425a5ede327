"""The LongSpec serving drafter: constant memory, it reads the engine's own cache, trainer checkpoints load,
bad checkpoints are refused with a clear error. (Greedy identity and sampling fidelity are tested with every
other drafter in test_engine_identity.py and test_sampling_fidelity.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from cli.main import main
from spyglass.drafters import build_drafter
from spyglass.drafters.base import DraftRequest
from spyglass.drafters.longspec import LongSpecDrafter, load_longspec_draft
from spyglass.engine import EngineConfig, SpecEngine, plain_generate
from spyglass.sampling import SamplingParams
from tests.tiny import layer_copy_draft


def test_memory_is_constant_in_the_context(tiny_target):
    """The ring holds window - 1 tokens' K/V whatever the prompt length; it fills up, then stays (the copy head
    reads the target's cache and the sequence's tokens in place: it keeps nothing)."""
    window = 16
    drafter = LongSpecDrafter(layer_copy_draft(tiny_target, window=window, copy_head=True), gamma=3)
    engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=2, max_context=512))
    assert drafter.cache is engine.cache  # bound: cross-attention reads the live target cache in place
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    sizes, fills = [], []
    for n in (5, 300):
        seq = engine.add_request([3 + i % 100 for i in range(n)], params)
        while not seq.finished:
            engine.step()
            if seq.drafter_state is not None:
                sizes.append(drafter.state_bytes(seq))
                fills.append(seq.drafter_state.filled)
    a = tiny_target.args
    assert set(sizes) == {2 * a.n_kv_heads * (window - 1) * a.head_dim * 4 + (window - 1) * 8}
    assert max(fills) == window - 1 and min(fills) < window - 1


def save_checkpoint(draft, root):
    """The trainer's checkpoint layout (actors/trainer.py): draft_config.json + the trainable weights."""
    root.mkdir(parents=True)
    (root / "draft_config.json").write_text(json.dumps({"kind": "longspec", **draft.cfg.to_dict()}))
    save_file({k: v.contiguous() for k, v in draft.trainable_state_dict().items()}, str(root / "draft.safetensors"))


def test_checkpoint_round_trip(tiny_target, tmp_path):
    draft = layer_copy_draft(tiny_target, window=32)
    save_checkpoint(draft, tmp_path / "ckpt")
    loaded = load_longspec_draft(tmp_path / "ckpt", tiny_target)
    assert loaded.cfg == draft.cfg
    for name, p in draft.trainable_state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name
    # a served draft reads the target's embedding and head in place: no copy of the vocabulary-sized matrices
    assert loaded.embed.weight.data_ptr() == tiny_target.embed.weight.data_ptr()
    assert loaded.full_head.weight.data_ptr() == tiny_target.lm_head.weight.data_ptr()
    drafter = build_drafter("longspec", tiny_target, draft_checkpoint=str(tmp_path / "ckpt"), gamma=2)
    assert isinstance(drafter, LongSpecDrafter) and drafter.gamma == 2


def test_bad_checkpoints_are_refused(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="not a draft checkpoint"):
        load_longspec_draft(tmp_path, tiny_target)
    # no checkpoint: the draft shipped for the target's model, and none ships for the tiny one (the error names them)
    with pytest.raises(ValueError, match="no longspec draft ships for this model .*smollm2-135m-longspec"):
        build_drafter("longspec", tiny_target)
    with pytest.raises(ValueError, match="no glide draft ships for this model .*smollm2-135m-glide"):
        build_drafter("glide", tiny_target)
    root = tmp_path / "ckpt"
    save_checkpoint(layer_copy_draft(tiny_target), root)
    good = (root / "draft_config.json").read_text()

    def edit_config(**changes) -> None:
        (root / "draft_config.json").write_text(json.dumps({**json.loads(good), **changes}))

    edit_config(kind="dflash")
    with pytest.raises(ValueError, match="'dflash' draft"):
        load_longspec_draft(root, tiny_target)
    edit_config(hidden_size=tiny_target.args.hidden_size + 8)
    with pytest.raises(ValueError, match="does not fit the target"):
        load_longspec_draft(root, tiny_target)
    edit_config()
    save_file({"wqkv.weight": torch.zeros(3, 3)}, str(root / "draft.safetensors"))
    with pytest.raises(ValueError, match="wqkv"):
        load_longspec_draft(root, tiny_target)
    save_file({}, str(root / "draft.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        load_longspec_draft(root, tiny_target)
    # the embedding is the target's own tensor in a served draft: a checkpoint that carries one must not write it
    embed = tiny_target.embed.weight.clone()
    trained = {k: v.contiguous() for k, v in layer_copy_draft(tiny_target).trainable_state_dict().items()}
    save_file({**trained, "embed.weight": torch.zeros_like(embed)}, str(root / "draft.safetensors"))
    with pytest.raises(ValueError, match="frozen tensors .'embed.weight'."):
        load_longspec_draft(root, tiny_target)
    assert torch.equal(tiny_target.embed.weight, embed)


def test_cli_with_a_bad_checkpoint_is_a_clear_error(capsys, tmp_path):
    args = ["generate", "--prompt", "hi", "--method", "longspec", "--max-new-tokens", "4"]
    assert main([*args, "--draft-checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spyglass: error:") and "is not a draft checkpoint" in err


def test_reduced_head_checkpoint_round_trip(tiny_target, tmp_path):
    """A draft with a frequency-ranked head keeps its token ids through a checkpoint and proposes only them."""
    from spyglass.models.drafts.longspec import LongSpecDraft

    torch.manual_seed(0)
    draft = LongSpecDraft.from_target(tiny_target, window=16, draft_vocab=24, init_std=0.2)
    ids = torch.randperm(tiny_target.args.vocab_size)[:24].sort().values
    draft.set_vocab(ids)
    save_checkpoint(draft, tmp_path / "ckpt")
    loaded = load_longspec_draft(tmp_path / "ckpt", tiny_target)
    assert torch.equal(loaded.vocab_ids, ids)
    assert torch.equal(loaded.lm_head.weight, tiny_target.lm_head.weight[ids])
    drafter = LongSpecDrafter(loaded, gamma=3)
    engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=1, max_context=256, controller="off"))
    seq = engine.add_request(list(range(3, 40)), SamplingParams(max_new_tokens=6, ignore_eos=True))
    engine.step()
    tree = drafter.propose([seq], [DraftRequest()])[0]
    assert set(tree.tokens[1:].tolist()) <= set(ids.tolist())


def test_a_chain_in_a_composite_drafts_its_argmax_when_sampling(tiny_target):
    """A composite's merged tree is verified by token matching, which accepts the likeliest token most often: its
    LongSpec chain then proposes the draft's argmax under sampling (the greedy chain, every time) and carries no
    proposal distributions. Alone, a sampled chain draws its tokens and carries their distributions."""
    from spyglass.drafters.composite import CompositeDrafter

    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=0)

    def after_prefill(drafter):
        engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=1, max_context=256, controller="off"))
        seq = engine.add_request([3 + i % 50 for i in range(40)], sampled)
        engine.step()
        return seq

    part = LongSpecDrafter(layer_copy_draft(tiny_target, window=16), gamma=3, token_matched=True)
    composite = CompositeDrafter([part])
    seq = after_prefill(composite)
    drawn = [composite.propose([seq], [DraftRequest()])[0] for _ in range(4)]
    assert len(drawn[0]) == 4 and all(t.probs is None for t in drawn)
    assert all(t.tokens.tolist() == drawn[0].tokens.tolist() for t in drawn)
    seq.params = SamplingParams(max_new_tokens=8)  # greedy: the draft's argmax chain
    assert composite.propose([seq], [DraftRequest()])[0].tokens.tolist() == drawn[0].tokens.tolist()
    # nothing drawn at random while drafting: the output is plain sampling's, token for token, with the same seed
    engine = SpecEngine(tiny_target, composite, EngineConfig(max_batch=1, max_context=256, controller="off"))
    prompt = [3 + i % 50 for i in range(40)]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5)
    assert engine.run([prompt], params)[0].output_ids == plain_generate(tiny_target, prompt, params)

    alone = LongSpecDrafter(layer_copy_draft(tiny_target, window=16), gamma=3)
    seq = after_prefill(alone)
    drawn = [alone.propose([seq], [DraftRequest()])[0] for _ in range(8)]
    assert all(t.probs is not None for t in drawn)
    assert len({tuple(t.tokens.tolist()) for t in drawn}) > 1


def test_a_span_follows_the_pointer_into_the_context(tiny_target):
    """Where the copy head's mass for the drafted token sits on one committed position, the context's continuation
    from there hangs below the node (as many tokens as there is room for), each scored as suffix lookup scores a
    match of that length; mass below `span_mass`, or on positions proposing another token, adds nothing."""
    from spyglass.drafters.longspec import _Growing
    from spyglass.sequence import Sequence
    from spyglass.tree import COPY_SOURCE, SPAN_SOURCE

    drafter = LongSpecDrafter(layer_copy_draft(tiny_target, copy_head=True), gamma=3, span=4, span_mass=0.3)
    phrase = [11, 12, 13, 14, 15, 16, 17]
    seq = Sequence([5, 6, 9, 12, *phrase, 7, 8, 9], SamplingParams(max_new_tokens=4))
    seq.append(12)  # the root: "9 12" came before at positions 2-3, then "11 12 13 ...": where 12 was followed by 11
    c = seq.num_tokens - 1
    after = seq.tokens[1 : c + 1]
    mass = torch.zeros(c)
    mass[5] = 0.5  # position 5 (token 12, inside the phrase) proposes its successor, 13
    g = _Growing(int(seq.root))
    node = g.add(0, 13, 0.6)
    assert drafter._add_span(seq, g, node, mass, after, room=4)
    assert g.tokens[2:] == [14, 15, 16, 17] and g.parents[2:] == [1, 2, 3, 4]
    assert g.sources == [0, COPY_SOURCE, SPAN_SOURCE, SPAN_SOURCE, SPAN_SOURCE, SPAN_SOURCE]
    # "12 13" agree with the source's text (the node itself makes the first match): 2 tokens, so the copied 13 is
    # priced as a span's token after a 1-token match, 1/2 (not the draft's 0.6), then 14 scores 1/2 * 2/3, 3/4...
    assert g.scores[1] == pytest.approx(0.5)
    expected = [0.5 * 2 / 3]
    for m in (3, 4, 5):
        expected.append(expected[-1] * m / (m + 1))
    assert g.scores[2:] == pytest.approx(expected)
    tree = g.tree(seq)
    assert tree.sources == g.sources and tree.max_depth == 5
    # not enough mass on the position, or mass on a position that proposes a different token: no span
    g = _Growing(int(seq.root))
    node = g.add(0, 13, 0.6)
    assert not drafter._add_span(seq, g, node, mass * 0.5, after, room=4)
    assert not drafter._add_span(seq, g, g.add(0, 99, 0.5), mass, after, room=4)
    # the span stops at the room left, and at the root (nothing after it is known)
    g = _Growing(int(seq.root))
    assert drafter._add_span(seq, g, g.add(0, 13, 0.6), mass, after, room=2) and g.tokens[2:] == [14, 15]
    mass = torch.zeros(c)
    mass[c - 3] = 1.0  # position c - 3 (token 7) proposes 8, then 9 and the root 12 follow
    g = _Growing(int(seq.root))
    assert drafter._add_span(seq, g, g.add(0, 8, 0.6), mass, after, room=4) and g.tokens[2:] == [9, 12]


def test_a_span_copies_from_the_place_whose_text_agrees_longest(tiny_target):
    """A phrase the context repeats splits the pointer's mass between its places: together they reach `span_mass`,
    and the span comes from the place whose preceding text agrees longest with the text before the node, not from
    the one with the most mass."""
    from spyglass.drafters.longspec import _Growing
    from spyglass.sequence import Sequence

    drafter = LongSpecDrafter(layer_copy_draft(tiny_target, copy_head=True), gamma=3, span=3, span_mass=0.3)
    seq = Sequence([5, 6, 12, 13, 40, 41, 9, 8, 12, 13, 50, 51, 52, 7, 9, 8], SamplingParams(max_new_tokens=4))
    seq.append(12)  # the root: "9 8 12" as at positions 6-8, which went on "13 50 51 52"; "6 12" went on "13 40"
    c = seq.num_tokens - 1
    mass = torch.zeros(c)
    mass[2], mass[8] = 0.2, 0.15  # both propose 13 (positions 3 and 9); neither alone reaches 0.3
    g = _Growing(int(seq.root))
    node = g.add(0, 13, 0.6)
    assert drafter._add_span(seq, g, node, mass, seq.tokens[1 : c + 1], room=3)
    assert g.tokens[2:] == [50, 51, 52] and g.origins[node] == 9
    # "13 12 8 9" agree, then 41 vs 7: 4 tokens, so 13 is priced 3/4 and the first copied token 3/4 * 4/5
    assert g.scores[1:3] == pytest.approx([3 / 4, 3 / 4 * 4 / 5])


def test_span_options_are_checked(tiny_target):
    with pytest.raises(ValueError, match="no copy head"):
        LongSpecDrafter(layer_copy_draft(tiny_target), span=4)
    with pytest.raises(ValueError, match="span must be"):
        LongSpecDrafter(layer_copy_draft(tiny_target, copy_head=True), span=4, span_mass=0.0)
    with pytest.raises(ValueError, match="not a cape tree"):
        LongSpecDrafter(layer_copy_draft(tiny_target, copy_head=True), span=4, mode="cape")
    drafter = LongSpecDrafter(layer_copy_draft(tiny_target, copy_head=True), span=4)
    assert drafter.name == "longspec-span" and drafter.traits.drafts_chain and drafter.traits.token_matched
    assert not drafter.traits.cost_by_depth  # a span costs no draft step: the controller prices whole steps


def test_the_pointer_follows_what_is_committed_along_a_copy(tiny_target):
    """After a step whose committed tokens (accepted copied ones, then the target's own) go along the copy, the
    pointer sits at the new root's place in the context; while the root is the context's token there, the next
    chain is the context's continuation, proposed with no draft step (also between probes, `free_only`,
    where nothing else is proposed). Committed tokens that leave the copy, or a root that departs from the
    context, leave it to the draft."""
    from spyglass.tree import SPAN_SOURCE
    from spyglass.verify import Accepted

    drafter = LongSpecDrafter(layer_copy_draft(tiny_target, copy_head=True), gamma=3, span=4)
    engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=1, max_context=256, controller="off"))
    phrase = [21, 22, 23, 24, 25, 26, 27]
    seq = engine.add_request([5, 6, *phrase, 9, 8, 21, 22, 23], SamplingParams(max_new_tokens=16, ignore_eos=True))
    engine.step()  # prefill: the root is the target's first token
    w = seq.drafter_state
    steps = []
    step = drafter.draft.draft_step
    drafter.draft.draft_step = lambda *a, **k: steps.append(1) or step(*a, **k)

    def after_copy(path: list[int], tokens: list[int]) -> int:
        """The pointer once `tokens` are committed after a chain that copied positions 2-4 ("21 22 23")."""
        w.chain, w.origins = [7, 21, 22, 23], [-1, 2, 3, 4]
        drafter.commit(seq, Accepted(path, tokens))
        assert w.chain is None
        return w.pointer

    # all three accepted and the target says 24: position 5, whatever the verified tree's node numbers (a composite
    # verifies a merged tree)
    assert after_copy([0, 4, 9, 11], [21, 22, 23, 24]) == 5
    assert after_copy([0, 1], [21, 22]) == 3  # one accepted, and the target's own 22 goes on with the copy
    assert after_copy([0, 1], [21, 30]) == -1  # the target's 30 leaves it
    assert after_copy([0, 1, 2], [21, 99, 30]) == -1
    assert after_copy([0, 1, 2, 3], [21, 22, 23, 24]) == 5
    seq.tokens[seq.num_tokens - 1] = 24  # as if the target's next token were the context's "24"
    (tree,) = drafter.propose([seq], [DraftRequest()])
    assert tree.tokens[1:].tolist() == [25, 26, 27, 9] and not steps
    assert tree.sources[1:] == [SPAN_SOURCE] * 4 and tree.scores[1] > tree.scores[4] > 0
    assert w.origins == [5, 6, 7, 8, 9]
    between_probes = [DraftRequest(free_only=True)]  # the same continuation, still no draft step
    assert drafter.propose([seq], between_probes)[0].tokens.tolist() == tree.tokens.tolist() and not steps
    # the root departs from the context: nothing between probes, and the draft drafts otherwise
    seq.tokens[seq.num_tokens - 1] = 99
    assert len(drafter.propose([seq], between_probes)[0]) == 1 and not steps
    drafter.propose([seq], [DraftRequest()])
    assert steps
    # a drafted token accepted and the target's own leaving the copy: no pointer
    w.chain, w.origins = [7, 30, 40], [-1, -1, 7]
    drafter.commit(seq, Accepted([0, 1], [30, 31]))
    assert w.pointer == -1
    # nothing verified, but the target's own token is the copied one: the copy goes on from its source
    w.chain, w.origins = [7, 30], [-1, 3]
    drafter.commit(seq, Accepted([0], [30]))
    assert w.pointer == 3


def test_composite_span_proposes_its_span_parts_free_continuation_between_probes(tiny_target):
    """Between the controller's probes (`free_only`) `composite-span`'s span part still proposes where the last copy
    goes on, with no draft step, beside its lookup's tree: the copy is followed on plain steps too, as by
    `longspec-span` alone. Outside a copy the span part proposes nothing then."""
    from spyglass.drafters.composite import CompositeDrafter
    from spyglass.drafters.suffix import SuffixDrafter

    spans = LongSpecDrafter(layer_copy_draft(tiny_target, copy_head=True), gamma=3, span=4, token_matched=True)
    composite = CompositeDrafter([SuffixDrafter(), spans], name="composite-span", confident=None)
    assert composite.traits.free == "part"
    engine = SpecEngine(tiny_target, composite, EngineConfig(max_batch=1, max_context=256, controller="off"))
    phrase = [21, 22, 23, 24, 25, 26, 27]
    seq = engine.add_request([5, 6, *phrase, 9, 8, 21, 22, 23], SamplingParams(max_new_tokens=16, ignore_eos=True))
    engine.step()  # prefill: the root is the target's first token
    w = seq.drafter_state[1]  # the span part's state
    steps = []
    step = spans.draft.draft_step
    spans.draft.draft_step = lambda *a, **k: steps.append(1) or step(*a, **k)
    w.pointer = 5  # the last copy went on to position 5 ("24"), and the target's next token is that one
    seq.tokens[seq.num_tokens - 1] = 24

    def span_path(tree) -> list[int]:
        """The span part's tokens down the tree's first path of its nodes (source bit 2: the second part)."""
        out, node, kids = [], 0, tree.children()
        while (node := next((c for c in kids[node] if tree.sources[c] & 2), None)) is not None:
            out.append(int(tree.tokens[node]))
        return out

    (tree,) = composite.propose([seq], [DraftRequest(free_only=True)])
    assert span_path(tree) == [25, 26, 27, 9] and not steps
    seq.tokens[seq.num_tokens - 1] = 99  # the root departs from the context: no copy goes on
    (tree,) = composite.propose([seq], [DraftRequest(free_only=True)])
    assert span_path(tree) == [] and not steps
