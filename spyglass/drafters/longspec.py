"""LongSpec and GLIDE drafter: a trained draft (`spyglass.models.drafts.longspec.LongSpecDraft`: LongSpec's one
layer, or GLIDE's N, layer m reading target layer L - N + m) grows a tree.

Per sequence it keeps only the self-attention K/V of the last `window - 1` committed tokens, per layer, in a ring
(keys carry their RoPE positions, so order inside the ring does not matter): memory is constant in the context.
The cross-attention reads the target's committed K/V in place from the engine's KVCache (`bind`), so the long
context costs the draft no memory at all. A GLIDE draft's higher layers' ring entries come from running the
layers below over each newly committed token (`sync_kv`, lag 1). A node at depth d sees the ring's newest
`window - 1 - d` tokens, its ancestors and itself: exactly the `window` keys the training forward's sliding window
shows it.
A `feed_hidden` draft also reads the target's last hidden state of the newest committed token (EAGLE's feature,
handed over by the engine through `observe_hidden`): one vector per sequence, as stale as the K/V it reads. A
`feed_own_hidden` draft's node also reads its parent's final draft hidden state (EAGLE's feature recursion). A
`copy_head` draft's proposal mixes its LM head with copies: its pointer over the target's last-layer keys makes each
committed position propose the token after it (read from the sequence's own tokens, a view). With `span`, a node
whose token the pointer copied (at least `span_mass` of the mass on places proposing it) gets the tokens that
followed the likeliest place (the one whose preceding text agrees longest) as a chain of children, `span` long at
most, for no further draft step: where the output copies its context, one draft step finds the source and the
context supplies the rest (what n-gram lookup guesses from the last few tokens, the pointer reads from the target's
keys). A copied token whose preceding text agrees with its source's is priced as a span's token (COPY_SOURCE). The
pointer follows the copy through whatever is committed along it (`spans.next_pointer`: accepted copied tokens or
the target's own): while the root is the context's token there, the next chain is that place's continuation with no
draft step at all, also between the controller's probes (its free part); otherwise the draft drafts.

Drafting is incremental and batched: one `draft_step` per depth for every sequence of the step, each node's
own K/V kept for its descendants (nothing is re-run). Tree shapes:
- `chain`: the draft's choice at every depth (its argmax, or a sample when sampling);
- `beam`: LongSpec's dynamic beam: at each depth the `width` best children by cumulative draft probability;
- `cape`: the greedy chain plus, at each chain node, extra candidates whose number grows as the draft's
  confidence falls (CAPE's bins over floor(10 * p_top1)), verified in the same pass.
A node that gets a span is not drafted further (its span continues it).
Every node carries its cumulative draft probability as its score; the engine's controller decides how much of
the tree pays on this machine. Sampling: a chain is drawn from the draft's processed distribution and carries
it for rejection sampling; beam and CAPE trees (the draft's top candidates), trees with spans, and a chain merged
into a composite's tree (built `token_matched`: its argmax), are verified by token matching. Both keep the target's
distribution exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from spyglass.drafters.base import DrafterTraits, DraftRequest, choose_draft_token, draft_generator, requested_depth
from spyglass.kv_cache import KVCache
from spyglass.models.drafts.longspec import LongSpecDraft
from spyglass.models.linear import set_linear_backend
from spyglass.models.llama import Transformer
from spyglass.sequence import Sequence
from spyglass.spans import (
    SPAN_MASS,
    continuation,
    copied_score,
    copy_source,
    next_pointer,
    pointer_continuation,
    text_before,
)
from spyglass.tree import COPY_SOURCE, DRAFT_SOURCE, SPAN_SOURCE, DraftTree
from spyglass.verify import Accepted
from spyglass.weights import load_weights, weights_path

DRAFTS = Path(__file__).resolve().parents[1] / "drafts"  # the drafts that ship, one directory per model and method
SHIPPED = DRAFTS / "smollm2-135m-longspec"
SHIPPED_GLIDE = DRAFTS / "smollm2-135m-glide"
CAPE_BINS = (8, 8, 8, 6, 6, 6, 4, 4, 2, 2, 2)  # extra candidates by floor(10 * p_top1) (GPU default)
CAPE_BINS_CPU = (3, 3, 3, 2, 2, 2, 1, 1, 1, 0, 0)  # on CPU every node costs verify time: fewer
MODES = ("chain", "beam", "cape")


@dataclass
class _Window:
    k: torch.Tensor  # [draft layers, kv_heads, window - 1, head_dim], a ring
    v: torch.Tensor
    pos: torch.Tensor  # [window - 1] position of each ring entry (-1 = empty)
    synced: int  # committed tokens already pushed
    generator: torch.Generator | None
    hidden: torch.Tensor | None = None  # feed_hidden: the target's last hidden state of the newest committed token
    chain: list[int] | None = None  # spans: the last chain's tokens, root first
    origins: list[int] | None = None  # spans: per node of the last chain, its context position (-1: drafted)
    pointer: int = -1  # spans: the context position whose token should be the root, where the last copy ended

    @property
    def filled(self) -> int:
        return int((self.pos >= 0).sum())


def _target_shape(target: Transformer) -> dict:
    a = target.args
    return {"hidden_size": a.hidden_size, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads, "head_dim": a.head_dim}


def _misfit(cfg: dict, target: Transformer) -> dict | str | None:
    """What of a draft config does not fit `target` ((draft, target) per field, or "vocab size"); None: it fits."""
    wrong = {k: (cfg.get(k), v) for k, v in _target_shape(target).items() if cfg.get(k) != v}
    return wrong or ("vocab size" if cfg.get("vocab_size") != target.args.vocab_size else None)


def shipped_draft(target: Transformer, family: str = "longspec") -> Path:
    """The draft of `family` ("longspec" or "glide") that ships for `target`'s model (spyglass/drafts/*-<family>);
    ValueError names the shipped ones when none fits."""
    shipped = [p for p in sorted(DRAFTS.glob(f"*-{family}")) if (p / "draft_config.json").is_file()]
    for path in shipped:
        if _misfit(json.loads((path / "draft_config.json").read_text()), target) is None:
            return path
    names = ", ".join(p.name for p in shipped) or "none in this tree"
    raise ValueError(f"no {family} draft ships for this model (shipped: {names}): pass --draft-checkpoint DIR")


def load_longspec_draft(checkpoint: str | Path | None, target: Transformer) -> LongSpecDraft:
    """A trainer checkpoint directory (`draft_config.json` + `draft.safetensors`) on top of `target`'s frozen
    embedding and head; None = the LongSpec draft shipped for `target`'s model. Raises ValueError naming what does
    not fit."""
    root = Path(checkpoint) if checkpoint is not None else shipped_draft(target)
    cfg_file, weights = root / "draft_config.json", weights_path(root / "draft.safetensors")
    if not cfg_file.is_file() or not weights.is_file():
        raise ValueError(f"{root} is not a draft checkpoint (needs draft_config.json and draft.safetensors[.xz])")
    cfg = json.loads(cfg_file.read_text())
    kind = cfg.pop("kind", "longspec")
    if kind != "longspec":
        raise ValueError(f"{root} holds a {kind!r} draft, not a LongSpec one")
    shape = _target_shape(target)
    wrong = _misfit(cfg, target)
    if wrong:
        raise ValueError(f"draft checkpoint {root} does not fit the target (draft, target): {wrong}")
    cfg.pop("init_layer", None)  # an initialisation choice, not a shape: the weights below replace it
    # the embedding and full LM head are the target's own tensors (no copy): a checkpoint must not write them
    draft = LongSpecDraft.from_target(target, share_io=True, **{k: v for k, v in cfg.items() if k not in shape})
    state = load_weights(weights, target.dtype)
    shared = {p.data_ptr() for p in target.parameters()}
    frozen = sorted(k for k, t in draft.state_dict(keep_vars=True).items() if k in state and t.data_ptr() in shared)
    if frozen:
        raise ValueError(f"draft checkpoint {root} holds the target's frozen tensors {frozen}, not only the draft's")
    try:
        missing, unexpected = draft.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of the wrong shape
        raise ValueError(f"draft checkpoint {root}: {e}") from e
    trained = {n for n, p in draft.named_parameters() if p.requires_grad}
    if draft.cfg.draft_vocab:
        trained.add("vocab_ids")
    if unexpected or trained & set(missing):
        raise ValueError(f"draft checkpoint {root}: missing {sorted(trained & set(missing))}, unexpected {unexpected}")
    if draft.cfg.draft_vocab:
        draft.set_vocab(draft.vocab_ids.clone())
    return draft.to(device=target.device, dtype=target.dtype).eval()


class LongSpecDrafter:
    name = "longspec"
    traits: DrafterTraits  # set in __init__: they follow the tree mode and the spans

    def __init__(
        self,
        draft: LongSpecDraft,
        gamma: int = 5,
        mode: str = "chain",
        width: int = 3,
        cape_bins: tuple[int, ...] | None = None,
        span: int = 0,
        span_mass: float = SPAN_MASS,
        token_matched: bool = False,
    ) -> None:
        """`token_matched`: a sampled chain is verified by token matching (a composite merges it, dropping its
        proposal distributions): draft the argmax, which token matching accepts most often, not a sample."""
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        if mode not in MODES:
            raise ValueError(f"unknown LongSpec tree mode {mode!r}; choose from {', '.join(MODES)}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        if span < 0 or not 0 < span_mass <= 1:
            raise ValueError(f"span must be >= 0 and span_mass in (0, 1], got {span}, {span_mass}")
        if span and not draft.cfg.copy_head:
            raise ValueError("spans follow the copy head's pointer: this draft has no copy head")
        if span and mode != "chain":
            raise ValueError(f"spans continue a chain, not a {mode} tree")
        if cape_bins is None:  # the paper's bins on a GPU; on CPU each extra node costs verify time
            cape_bins = CAPE_BINS if draft.layers[0].wqkv.weight.is_cuda else CAPE_BINS_CPU
        self.draft, self.gamma, self.mode, self.width, self.cape_bins = draft, gamma, mode, width, cape_bins
        self.span, self.span_mass = span, span_mass
        self.traits = DrafterTraits(
            free="part" if span else "none",  # a copy that goes on costs no draft step: proposed between probes too
            # beam and CAPE trees, and a chain with spans, carry no proposal distributions: their argmaxes
            token_matched=token_matched or bool(span) or mode != "chain",
            drafts_chain=mode == "chain",  # one token per depth (the controller sizes it by its acceptance profile)
            # one draft step per depth, only as deep as the controller asks (`DraftRequest.depth`); with spans, priced
            # per step: draft steps stop where a span starts, so depth is no measure
            cost_by_depth=not span,
            # the target layers whose outputs the engine hands to observe_hidden
            hidden_layers=tuple(draft.cfg.hidden_layers or [-1]) if draft.cfg.feed_hidden else (),
            newest_hidden_only=True,  # observe_hidden keeps the newest committed token's row only
        )
        self.ring = draft.cfg.window - 1  # + the token being drafted from = the training window
        self.cache: KVCache | None = None
        family = "longspec" if draft.cfg.n_layers == 1 else "glide"
        self.name = family if mode == "chain" else f"{family}-{mode}"
        self.name += "-span" if span else ""
        self._pending: dict[int, torch.Tensor] = {}  # prefill's hidden state, until start()

    def bind(self, target: Transformer, cache: KVCache) -> None:
        self.cache = cache
        set_linear_backend(self.draft, target.draft_linear_backend)  # the kernels measured faster here
        self.layers_read = self.draft.target_layers(target.args.n_layers)  # the last one is the target's last
        self.feature_layers = self.draft.feature_layers(target.args.n_layers)

    def start(self, seq: Sequence) -> None:
        c = self.draft.cfg
        device = self.draft.layers[0].wqkv.weight.device
        empty = torch.zeros(c.n_layers, c.n_kv_heads, self.ring, c.head_dim, dtype=self.draft.dtype, device=device)
        pos = torch.full((self.ring,), -1, dtype=torch.long)
        hidden = self._pending.pop(seq.seq_id, None)
        sampled = not self.traits.token_matched  # the only trees drawn at random: a chain's
        gen = draft_generator(seq) if sampled else None  # (taking no draw otherwise keeps plain sampling's stream)
        seq.drafter_state = _Window(empty, torch.zeros_like(empty), pos, 0, gen, hidden)

    def observe_hidden(self, seq: Sequence, start: int, hidden: dict, kept: list[int]) -> None:
        """Keep only the newest committed token's row (its feature layers side by side): one vector per sequence,
        whatever the context."""
        h = torch.cat([hidden[i][kept[-1]] for i in self.feature_layers])
        w: _Window | None = seq.drafter_state
        if w is None:
            self._pending[seq.seq_id] = h
        else:
            w.hidden = h

    def _sync(self, seq: Sequence, w: _Window, committed: int, targets: list) -> None:
        """Push the committed tokens the ring has not seen (`sync_kv` computes only the last `ring` of them)."""
        if w.synced < committed:
            tokens = seq.tokens[w.synced : committed]
            before = int(seq.tokens[w.synced - 1]) if w.synced else -1
            k, v = self.draft.sync_kv(tokens, w.synced, (w.k, w.v, w.pos), targets, self.ring, before=before)
            lo = committed - k.shape[2]
            slots = torch.arange(lo, committed) % self.ring
            w.k[:, :, slots], w.v[:, :, slots] = k, v
            w.pos[slots] = torch.arange(lo, committed)
        w.synced = committed

    def propose(self, batch: list[Sequence], wants: list[DraftRequest]) -> list[DraftTree]:
        if self.cache is None:
            raise RuntimeError("LongSpecDrafter is not bound to an engine's KV cache")
        if not batch:
            return []
        states: list[_Window] = [s.drafter_state for s in batch]
        committed = [self.cache.lengths[s.slot] for s in batch]  # every token but the root
        targets = [[self.cache.prefix(s.slot, layer) for layer in self.layers_read] for s in batch]
        for seq, w, c, t in zip(batch, states, committed, targets, strict=True):
            self._sync(seq, w, c, t)
        depth_cap = [requested_depth(s, w, self.gamma, self.cache.capacity) for s, w in zip(batch, wants, strict=True)]
        trees = [_Growing(int(s.root)) for s in batch]
        if self.span:  # where the last copy goes on, its continuation instead of a draft step
            for i, (s, w, c) in enumerate(zip(batch, states, committed, strict=True)):
                if wants[i].free_only:  # between the controller's probes: only a copy that goes on, for free
                    depth_cap[i] = 0
                span = pointer_continuation(s, w.pointer, c, min(self.span, self.cache.capacity - s.num_tokens))
                if span is not None:
                    trees[i].origins[0] = w.pointer
                    if self._extend(trees[i], 0, w.pointer, span):
                        depth_cap[i] = 0
        before_root = [int(s.tokens[c - 1]) if c else -1 for s, c in zip(batch, committed, strict=True)]
        # a copy head's: the token after each committed one (views of the sequences' buffers, no copy)
        after = [
            s.tokens[1 : c + 1] if self.draft.cfg.copy_head else None for s, c in zip(batch, committed, strict=True)
        ]
        frontier = [[0] if depth_cap[i] > 0 else [] for i in range(len(batch))]
        for depth in range(max(depth_cap, default=0)):
            rows = [(i, node) for i in range(len(batch)) for node in frontier[i]]
            if not rows:
                break
            logits, mass = self._step(rows, trees, states, committed, targets, depth, before_root, after)
            for i in range(len(batch)):
                frontier[i] = []
            for r, (i, node) in enumerate(rows):
                kids = self._children(batch[i], trees[i], node, logits[r], states[i].generator)
                if self.span:  # a node continued by its span is not drafted further
                    # spans cost no draft step: as long as `span` whatever depth the controller asked for
                    room = min(self.span, self.cache.capacity - batch[i].num_tokens - depth - 1)
                    kids = [k for k in kids if not self._add_span(batch[i], trees[i], k, mass[r], after[i], room)]
                if depth + 1 < depth_cap[i]:
                    frontier[i].extend(kids)
            if self.mode == "beam":  # keep the `width` best new nodes per sequence
                for i, g in enumerate(trees):
                    frontier[i] = sorted(frontier[i], key=lambda n, g=g: -g.scores[n])[: self.width]
        if self.span:  # a chain that copied is remembered for `commit`'s pointer
            for w, g in zip(states, trees, strict=True):
                w.chain, w.origins = (g.tokens, g.origins) if max(g.origins) >= 0 else (None, None)
        return [g.tree(s) for g, s in zip(trees, batch, strict=True)]

    def _step(
        self, rows, trees, states, committed, targets, depth: int, before_root: list[int], after: list
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The draft's logits (target vocabulary) at the frontier nodes of every sequence, in one draft_step, and
        (copy head) each node's copy mass over its sequence's committed positions."""
        tokens, prev, positions, self_groups, cross_groups = [], [], [], [], {}
        by_parent: dict[tuple[int, int], list[int]] = {}
        for r, (i, node) in enumerate(rows):
            g = trees[i]
            tokens.append(g.tokens[node])
            prev.append(g.tokens[g.parents[node]] if node else before_root[i])  # the token before this node
            positions.append(committed[i] + depth)
            by_parent.setdefault((i, g.parents[node]), []).append(r)
            cross_groups.setdefault(i, []).append(r)
        for (i, parent), rs in by_parent.items():
            w, g = states[i], trees[i]
            keep = (w.pos >= 0) & (w.pos > committed[i] + depth - self.draft.cfg.window)  # training's window
            path = g.path(parent)  # the ancestors of these siblings, root first
            pk = torch.cat([w.k[:, :, keep], *(g.k[n] for n in path)], dim=2) if path else w.k[:, :, keep]
            pv = torch.cat([w.v[:, :, keep], *(g.v[n] for n in path)], dim=2) if path else w.v[:, :, keep]
            self_groups.append((rs, pk, pv))
        crosses = [
            (rs, [k for k, _ in targets[i]], [v for _, v in targets[i]], after[i]) for i, rs in cross_groups.items()
        ]
        hidden = torch.stack([states[i].hidden for i, _ in rows]) if self.traits.hidden_layers else None
        own = None
        if self.draft.cfg.feed_own_hidden:  # each node reads its parent's output (the root: zeros)
            zero = torch.zeros(self.draft.cfg.hidden_size, dtype=self.draft.dtype, device=self.draft.inv_freq.device)
            own = torch.stack([trees[i].out.get(trees[i].parents[node], zero) for i, node in rows])
        logits, k, v, out, mass = self.draft.draft_step(
            torch.tensor(tokens),
            torch.tensor(positions),
            self_groups,
            crosses,
            backend="auto",
            hidden=hidden,
            own=own,
            prev=torch.tensor(prev),
        )
        for r, (i, node) in enumerate(rows):
            trees[i].k[node], trees[i].v[node], trees[i].out[node] = k[:, :, r : r + 1], v[:, :, r : r + 1], out[r]
        return logits, mass

    def _add_span(
        self, seq: Sequence, g: _Growing, node: int, mass: torch.Tensor, after: torch.Tensor, room: int
    ) -> bool:
        """Hang the context's continuation (at most `room` tokens) below `node` if its token came from copying
        (`spans.copy_source`); True if a span was added. A copied token whose text before agrees with its source's
        for m - 1 tokens is priced as a span's (suffix lookup's estimate) and still counts for the drafted
        profile (COPY_SOURCE)."""
        c = len(after)
        found = copy_source(seq, text_before(seq, g.tokens_to(node), c), g.tokens[node], mass, after, self.span_mass)
        if found is None:
            return False
        at, match = found
        g.origins[node] = at
        vouched = copied_score(g.scores[g.parents[node]], match)
        if vouched is not None:
            g.scores[node], g.sources[node] = vouched, COPY_SOURCE
        return self._extend(g, node, at, continuation(seq, at, c, room, g.scores[node], match))

    def _extend(self, g: _Growing, node: int, at: int, span: list[tuple[int, float]]) -> bool:
        """Below `node`, whose token is the context's at position `at`, `span`: what followed it there, scored
        (`spans.continuation`). True if anything was added."""
        for k, (t, score) in enumerate(span, start=1):
            node = g.add(node, t, score, source=SPAN_SOURCE, origin=at + k)
        return bool(span)

    def _children(self, seq: Sequence, g: _Growing, node: int, logits: torch.Tensor, gen) -> list[int]:
        """Add the node's children to the tree; returns those to expand further."""
        if self.mode == "chain":
            drafted = g.tokens_to(node)
            matched = self.traits.token_matched
            tok, dist = choose_draft_token(seq, drafted, logits.unsqueeze(0), gen, top=matched)
            p = float(dist[tok]) if not seq.params.greedy else float(torch.softmax(logits, -1)[tok])
            sampled = not (seq.params.greedy or matched)
            child = g.add(node, tok, g.scores[node] * p, dist if sampled else None)
            return [child]
        probs = torch.softmax(logits, -1)
        if self.mode == "beam":
            top = probs.topk(self.width)
            return [
                g.add(node, int(t), g.scores[node] * float(p)) for p, t in zip(top.values, top.indices, strict=True)
            ]
        # cape: the top-1 continues the chain; `bins` extra candidates as leaves by the top-1's confidence
        top1 = float(probs.max())
        extra = self.cape_bins[min(len(self.cape_bins) - 1, int(10 * top1))]
        top = probs.topk(1 + extra)
        kids = [g.add(node, int(t), g.scores[node] * float(p)) for p, t in zip(top.values, top.indices, strict=True)]
        return kids[:1]

    def commit(self, seq: Sequence, accepted: Accepted) -> None:
        """Nothing to undo: the ring only ever holds committed tokens; the next propose catches up. With spans, the
        pointer follows the committed tokens along the copy (`spans.next_pointer`; compared by tokens: in a
        composite the verified tree is a merged one)."""
        w: _Window | None = seq.drafter_state
        if w is None or not self.span:
            return
        w.pointer = next_pointer(seq, w.pointer, w.chain, w.origins, accepted.tokens)
        w.chain = None

    def release(self, seq: Sequence) -> None:
        seq.drafter_state = None
        self._pending.pop(seq.seq_id, None)

    def state_bytes(self, seq: Sequence) -> int:
        w: _Window | None = seq.drafter_state
        return 0 if w is None else 2 * w.k.numel() * w.k.element_size() + w.pos.numel() * w.pos.element_size()


class _Growing:
    """A draft tree under construction, with each node's draft K/V (`[N, kvh, 1, D]`) for its descendants and
    its final hidden state (`[H]`) for its children."""

    def __init__(self, root: int) -> None:
        self.tokens, self.parents, self.scores = [root], [-1], [1.0]
        self.dists: list[torch.Tensor | None] = [None]
        self.sources = [0]
        self.origins = [-1]  # each node's context position, for a copied token (-1: drafted)
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.out: dict[int, torch.Tensor] = {}

    def add(
        self,
        parent: int,
        tok: int,
        score: float,
        dist: torch.Tensor | None = None,
        source: int = DRAFT_SOURCE,
        origin: int = -1,
    ) -> int:
        self.tokens.append(tok)
        self.sources.append(source)
        self.origins.append(origin)
        self.parents.append(parent)
        self.scores.append(score)
        self.dists.append(dist)
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """`node` and its ancestors, root first (empty for the root's parent)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def tokens_to(self, node: int) -> list[int]:
        """Drafted tokens from the root (excluded) down to `node`."""
        return [self.tokens[n] for n in self.path(node)[1:]]

    def tree(self, seq: Sequence) -> DraftTree:
        probs = None
        if not seq.params.greedy and len(self.tokens) > 1 and all(d is not None for d in self.dists[1:]):
            chain = all(p == i - 1 for i, p in enumerate(self.parents))
            if chain:
                probs = torch.stack([torch.zeros_like(self.dists[1]), *self.dists[1:]])
        copied = any(src & SPAN_SOURCE for src in self.sources)
        sources = self.sources if copied else None  # the draft's nodes alone need no tags
        return DraftTree(torch.tensor(self.tokens), self.parents, probs, list(self.scores), sources)
