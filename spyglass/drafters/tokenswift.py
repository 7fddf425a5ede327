"""TokenSwift drafter: the target drafts for itself over a partial KV cache, with residual multi-token heads and
n-gram reuse (Wu et al., ICML 2025), for ultra-long generation.

Per step and sequence:
1. the partial cache (`spyglass.partial_kv.PartialKV`, budget |B| with |S| sinks, dynamic importance updates) takes in
   the tokens committed since the last step;
2. one target forward of the root over the partial cache gives the last hidden state h_0; the gamma = 3 heads
   (`models.drafts.tokenswift`) turn it into 4 next-token distributions p_0..p_3 through the target's final
   norm and LM head, processed with the request's sampling parameters (penalties included);
3. the static tree [1,3,3,3] (top-1 of p_0, top-3 of p_1..p_3, a Cartesian product) plus the top-k most
   frequent n-grams that start with argmax p_0, taken from an incrementally maintained n-gram table (the top two
   chained on past n tokens, each token's most frequent n-gram after the last, to `ngram_depth`: a passage that
   repeats is drafted as far as it repeated; the paper stops at n), and a context lookup (ours, `context_lookup`:
   what followed the text's longest repeated suffix, from suffix drafting's automaton, scored by how often such a
   match length was right in this text), are merged into one trie; every node is scored with an estimate of
   P(accepted) (product of the draft probabilities along the path, or the n-gram's relative frequency when
   larger), and the engine's speculation controller prunes the tree by the measured verify cost.
Between the controller's probes (`DraftRequest.free_only`: the partial-cache pass costs about a decode step on a CPU,
where the weights, not the KV cache, dominate a step) only the lookups propose, at no cost: the context lookup and
the table's most frequent n-grams that start at the root itself. Where the context lookup's best next token is
likely (score >= `confident`), a step skips the pass too: the heads' few candidates rarely pay for it there. The
table is keyed by one token, so in recited text its most frequent n-gram is often not the one that follows here;
the context lookup matches as many tokens as repeat (chaining the table alone made 1.56x on Qwen's 12K run
where n-gram drafting made 3.32x).
With `sampled_chain`, sampled requests get a chain instead: one token per depth drawn from p_0..p_3 under the
request's sampling parameters (the penalty seeing the tokens drawn before), handed to the verifier with those
distributions as its proposal q (rejection sampling). p_0 is the target's own distribution over the partial cache,
so the first drafted token is accepted about as often as the two distributions overlap (0.73 of the probes in a
384-token run at the benchmark's T=1, min-p 0.1, penalty 1.2) where a top-k token matched against one target sample
is accepted only as often as the target samples it (0.18). It is off by default: on this CPU the partial-cache pass
costs about a decode step, so neither pays (1,024 tokens, `bench/results/tokenswift_s29_chain.json`: 1.00x with it,
0.95x without; BENCHMARKS.md, "TokenSwift").
Verification is the engine's and strict: trees by token matching (one target sample per visited node), sampled
chains by rejection sampling, so the output is plain decoding's, greedy or sampled, with or without the contextual
penalty.

Variants (ablations): `policy="static"` (no dynamic KV updates), `policy="window"` (StreamingLLM-style partial
cache), `ngram_k=0` (no n-gram reuse), `draft_pass=False` (no partial-cache pass: the heads read the exact
full-cache hidden state of the last committed token, Medusa-style, from the engine's `observe_hidden`).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from spyglass.drafters.base import DrafterTraits, DraftRequest, choose_draft_token, draft_generator
from spyglass.drafters.composite import best_first
from spyglass.drafters.suffix import SuffixDrafter
from spyglass.kv_cache import KVCache
from spyglass.models.drafts.tokenswift import CONFIG_FILE, TokenSwiftHeads, load_heads, signature_mismatch
from spyglass.models.llama import Segment, Transformer
from spyglass.partial_kv import PartialKV, PartialState
from spyglass.sampling import process_in_context
from spyglass.sequence import Sequence
from spyglass.tree import DraftTree, TrieBuilder
from spyglass.verify import Accepted

DEFAULT_HEADS = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-tokenswift"


def shipped_heads_for(target: Transformer) -> Path:
    """Of the heads shipped per model (`spyglass/drafts/*-tokenswift`), the ones whose recorded target signature
    matches `target`; ValueError names the shipped ones."""
    shipped = [p for p in sorted(DEFAULT_HEADS.parent.glob("*-tokenswift")) if (p / CONFIG_FILE).is_file()]
    for path in shipped:
        if not signature_mismatch(json.loads((path / CONFIG_FILE).read_text()).get("target", {}), target):
            return path
    names = ", ".join(p.name for p in shipped) or "none in this tree"
    raise ValueError(f"no TokenSwift heads shipped for this model (shipped: {names}): pass --draft-checkpoint DIR")


class NgramTable:
    """Counts of n-grams keyed by their first token, updated as tokens are committed (never rescanned)."""

    def __init__(self, n: int = 4) -> None:
        if n < 2:
            raise ValueError(f"n-gram length must be >= 2, got {n}")
        self.n = n
        self.table: dict[int, dict[tuple[int, ...], list[int]]] = {}
        self.synced = 0  # n-grams ending before this index are counted
        self.entries = 0

    def update(self, tokens: torch.Tensor, upto: int) -> None:
        """Count the n-grams ending at indices (synced, upto] of `tokens`."""
        lo = max(self.synced, self.n)
        if upto < lo:
            return
        toks = tokens[lo - self.n : upto].tolist()
        for e in range(lo, upto + 1):
            gram = toks[e - lo : e - lo + self.n]
            conts = self.table.setdefault(gram[0], {})
            entry = conts.get(tuple(gram[1:]))
            if entry is None:
                conts[tuple(gram[1:])] = [1, e]
                self.entries += 1
            else:
                entry[0] += 1
                entry[1] = e
        self.synced = upto + 1

    def top(self, first: int, k: int) -> list[tuple[tuple[int, ...], float]]:
        """The k most frequent continuations of `first` (ties: most recent first) with their relative frequency."""
        conts = self.table.get(first)
        if not conts or k <= 0:
            return []
        total = sum(c for c, _ in conts.values())
        best = heapq.nlargest(k, conts.items(), key=lambda kv: (kv[1][0], kv[1][1]))
        return [(cont, c / (total + 1)) for cont, (c, _) in best]

    def extend(self, last: int, depth: int) -> list[tuple[tuple[int, ...], float]]:
        """Up to `depth` more tokens after `last`, chaining each token's most frequent n-gram: the (continuation,
        relative frequency) pieces, so a repeating passage is drafted as far as it has repeated."""
        pieces, length = [], 0
        while length < depth and (top := self.top(last, 1)):
            cont, freq = top[0]
            cont = cont[: depth - length]
            pieces.append((cont, freq))
            length += len(cont)
            last = cont[-1]
        return pieces


@dataclass
class _State:
    partial: PartialState | None
    ngrams: NgramTable
    h_last: torch.Tensor | None = None  # exact hidden state of the last committed token (draft_pass=False)
    generator: torch.Generator | None = None  # a sampled chain's own random stream (plain sampling's is kept)
    lookup: object | None = None  # the context lookup's own state (`context_lookup`)


# node sources besides the heads' tree (1): n-grams after p_0, n-grams at the root, the context lookup
NGRAM_SOURCE, FREE_SOURCE, CONTEXT_SOURCE = 2, 4, 8
EXTENDED = 2  # n-gram candidates chained on past their n tokens (as many as n-gram drafting's candidates)


class TokenSwiftDrafter:
    name = "tokenswift"
    traits: DrafterTraits  # set in __init__: they follow the lookups and the sampled chain

    def __init__(
        self,
        heads: TokenSwiftHeads,
        budget: int | None = None,
        sinks: int = 16,
        policy: str = "importance",
        widths: tuple[int, ...] | None = None,
        ngram_k: int = 20,
        ngram_n: int = 4,
        ngram_depth: int = 12,
        ngram_lag: int = 0,
        rebuild_every: int | None = None,
        draft_pass: bool = True,
        sampled_chain: bool = False,
        context_lookup: bool = True,
        confident: float = 0.25,
    ) -> None:
        """`sampled_chain`: sampled requests get a chain drawn from p_0..p_3 and verified by rejection sampling
        instead of the tree verified by token matching. `ngram_depth`: the top `EXTENDED` n-gram candidates are
        chained on (each token's most frequent n-gram) up to this depth (0: the paper's n-grams alone, n - 1
        tokens after the root or p_0's argmax). `context_lookup`: the n-gram reuse also matches the text's
        longest repeated suffix (suffix drafting's automaton) and proposes what followed it; where that lookup's
        best first token scores at least `confident`, the step skips the partial-cache pass (as the composite
        skips its learned part)."""
        if widths is None:  # the paper's [1,3,3,3]; without the pass, depth 1 comes from head 1 (no p_0 to take)
            widths = (1, 3, 3, 3) if draft_pass else (3, 3, 3)
        if len(widths) > heads.gamma + (1 if draft_pass else 0) or not widths or min(widths) < 1:
            raise ValueError(f"tree widths {widths} need one distribution per depth (heads give {heads.gamma + 1})")
        self.heads = heads
        self.budget, self.sinks, self.policy, self.rebuild_every = budget, sinks, policy, rebuild_every
        self.widths, self.ngram_k, self.ngram_n, self.ngram_lag = tuple(widths), ngram_k, ngram_n, ngram_lag
        self.ngram_depth = ngram_depth
        self.draft_pass = draft_pass
        self.sampled_chain = sampled_chain
        self.lookup = SuffixDrafter() if context_lookup else None
        self.confident = confident
        self.traits = DrafterTraits(
            free="part" if ngram_k > 0 or context_lookup else "none",  # the lookups draft between probes, for free
            token_matched=not sampled_chain,  # a tree of top candidates and lookups, verified by token matching
            hidden_layers=(-1,),  # the engine hands over the target's last hidden states (observe_hidden)
        )
        self.pkv: PartialKV | None = None
        self.drafted = 0  # sequence-steps that ran the heads (and the partial-cache pass): what the lookups spared
        self.target: Transformer | None = None
        self._pending: dict[str, torch.Tensor] = {}

    def bind(self, target: Transformer, cache: KVCache) -> None:
        if self.heads.norm_weight.shape[1] != target.args.hidden_size:
            raise ValueError("TokenSwift heads were built for another hidden size than the target's")
        self.target = target
        self.heads.to(device=target.device, dtype=target.dtype)  # beside the hidden states and head they read
        if self.draft_pass:
            budget = self.budget if self.budget is not None else min(2048, cache.capacity // 4)
            self.pkv = PartialKV(budget, min(self.sinks, budget - 1), self.policy, 1, self.rebuild_every)
            self.pkv.bind(target, cache)
        self.cache = cache

    def observe_hidden(self, seq: Sequence, start: int, hidden: dict, kept: list[int]) -> None:
        h = hidden[self.target.args.n_layers - 1][kept[-1]].clone()
        st: _State | None = seq.drafter_state
        if st is None:
            self._pending[seq.seq_id] = h  # prefill: start() comes next
        else:
            st.h_last = h

    def start(self, seq: Sequence) -> None:
        table = NgramTable(self.ngram_n)
        partial = self.pkv.start(seq.slot) if self.pkv is not None else None
        gen = draft_generator(seq) if self.sampled_chain else None  # (token matching keeps plain sampling's draws)
        seq.drafter_state = _State(partial, table, self._pending.pop(seq.seq_id, None), gen)
        if self.ngram_k > 0:
            table.update(seq.tokens, seq.num_tokens - self.ngram_lag)
        self._in_lookup(seq, "start")

    def _in_lookup(self, seq: Sequence, method: str, *args):
        """The context lookup's `method(seq, *args)` with its own state swapped in (None without the lookup)."""
        if self.lookup is None:
            return None
        st: _State = seq.drafter_state
        seq.drafter_state = st.lookup
        try:
            return getattr(self.lookup, method)(seq, *args)
        finally:
            st.lookup, seq.drafter_state = seq.drafter_state, st

    @torch.inference_mode()
    def _distributions(self, batch: list[Sequence]) -> torch.Tensor:
        """`[depths, batch, V]` raw logits for the tree's depths 1..len(widths)."""
        t = self.target
        last = t.args.n_layers - 1
        self.drafted += len(batch)
        if not self.draft_pass:
            h = torch.stack([s.drafter_state.h_last for s in batch])
            return self.heads.logits(t, h, slice(1, 1 + len(self.widths)))
        segments = []
        for seq in batch:
            st: PartialState = seq.drafter_state.partial
            self.pkv.sync(st, seq.slot, seq.root)
            pos = torch.tensor([seq.committed])
            segments.append(Segment(st.slot, st.filled, torch.tensor([seq.root]), pos, None, "none"))
        saved = getattr(t, "capture_layers", ())
        t.capture_layers = (last,)
        try:
            t(segments, self.pkv.cache)
            h = torch.cat([c[last] for c in t.captured])
        finally:
            t.capture_layers = saved
        return self.heads.logits(t, h, slice(len(self.widths)))

    def propose(self, batch: list[Sequence], wants: list[DraftRequest]) -> list[DraftTree]:
        if self.target is None:
            raise RuntimeError("TokenSwiftDrafter is not bound to an engine")
        lookups = {id(s): self._in_lookup(s, "propose_one") for s in batch}
        trees = {
            id(s): self._free_tree(s, lookups[id(s)])
            for s, w in zip(batch, wants, strict=True)
            if w.free_only or self._sure(lookups[id(s)])
        }
        drafted = [s for s in batch if id(s) not in trees]
        if drafted:
            logits = self._distributions(drafted)
            for j, seq in enumerate(drafted):
                if self.sampled_chain and not seq.params.greedy:
                    trees[id(seq)] = self._chain(seq, logits[:, j])
                    continue
                rows = process_in_context(logits[:, j], seq.params, seq.tokens)  # start-of-step context, as the paper
                probs = torch.softmax(rows, -1) if seq.params.greedy else rows
                trees[id(seq)] = self._tree(seq, probs, lookups[id(seq)])
        return [trees[id(s)] for s in batch]

    def _sure(self, lookup: DraftTree | None) -> bool:
        """The context lookup's best next token is likely enough that the heads' few candidates would not pay."""
        return lookup is not None and best_first(lookup)[1] >= self.confident

    def _chain(self, seq: Sequence, logits: torch.Tensor) -> DraftTree:
        """One token per depth drawn from the processed `logits` `[depths, V]`, which are its proposal q."""
        chain, rows = [], []
        for d in range(logits.shape[0]):
            tok, row = choose_draft_token(seq, chain, logits[d : d + 1], seq.drafter_state.generator)
            chain.append(tok)
            rows.append(row)
        return DraftTree.sampled_chain(seq.root, chain, rows)

    def _free_tree(self, seq: Sequence, lookup: DraftTree | None) -> DraftTree:
        """The context lookup's tree and the table's most frequent continuations of the root, each of those nodes
        scored by the best relative frequency of an n-gram through it."""
        trie = TrieBuilder(seq.root)
        if lookup is not None:
            trie.graft(lookup, CONTEXT_SOURCE)
        table = seq.drafter_state.ngrams
        for i, (cont, freq) in enumerate(table.top(seq.root, self.ngram_k)):
            node = 0
            for tok in cont:
                node = trie.add(node, tok, freq, FREE_SOURCE)
            if i < EXTENDED:
                self._extend(trie, table, node, len(cont), FREE_SOURCE)
        return trie.tree()

    def _extend(self, trie: TrieBuilder, table: NgramTable, node: int, depth: int, source: int) -> None:
        """Chain the n-gram ending at `node` (at `depth`) on to `ngram_depth`, each piece's nodes scored by the
        path's score times the piece's relative frequency."""
        for cont, freq in table.extend(trie.tokens[node], self.ngram_depth - depth):
            score = trie.scores[node] * freq
            for tok in cont:
                node = trie.add(node, tok, score, source)

    def _tree(self, seq: Sequence, probs: torch.Tensor, lookup: DraftTree | None) -> DraftTree:
        """Nodes are tagged by source bits (1: the heads' tree, 2: an n-gram, 8: the context lookup) so that the
        controller calibrates each kind of score on its own acceptance."""
        trie = TrieBuilder(seq.root)
        scores = trie.scores
        level = [0]
        tops = [torch.topk(probs[d], w) for d, w in enumerate(self.widths)]
        for top in tops:
            nxt = []
            for par in level:
                for p, tok in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                    if p > 0.0:
                        nxt.append(trie.add(par, tok, scores[par] * p, 1))
            level = nxt
        st: _State = seq.drafter_state
        if self.ngram_k > 0 and len(scores) > 1:
            first = trie.tokens[1]  # argmax of p_0: the first node added
            depth = len(self.widths)
            for i, (cont, freq) in enumerate(st.ngrams.top(first, self.ngram_k)):
                node = 1
                for d, tok in enumerate(cont, start=1):
                    q = float(probs[d, tok]) if d < depth else 0.0
                    node = trie.add(node, tok, scores[node] * max(q, freq), NGRAM_SOURCE)
                if i < EXTENDED:
                    self._extend(trie, st.ngrams, node, 1 + len(cont), NGRAM_SOURCE)
        if lookup is not None:
            trie.graft(lookup, CONTEXT_SOURCE)
        return trie.tree()

    def commit(self, seq: Sequence, accepted: Accepted) -> None:
        st: _State = seq.drafter_state
        if self.ngram_k > 0:
            st.ngrams.update(seq.tokens, seq.num_tokens - self.ngram_lag)
        self._in_lookup(seq, "commit", accepted)

    def release(self, seq: Sequence) -> None:
        self._pending.pop(seq.seq_id, None)
        st: _State | None = seq.drafter_state
        if st is not None:
            self._in_lookup(seq, "release")
            if self.pkv is not None:
                self.pkv.release(st.partial)
        seq.drafter_state = None

    def partial_bytes(self, seq: Sequence) -> int:
        """The partial KV cache's memory for this sequence: fixed by the budget."""
        return self.pkv.slot_bytes() if self.pkv is not None and seq.drafter_state is not None else 0

    def state_bytes(self, seq: Sequence) -> int:
        st: _State | None = seq.drafter_state
        if st is None:
            return 0
        lookup = self._in_lookup(seq, "state_bytes") or 0
        return self.partial_bytes(seq) + 96 * st.ngrams.entries + lookup  # n-gram entries: a tuple and a counter


def build_tokenswift(target: Transformer, checkpoint: str | Path | None = None, **options) -> TokenSwiftDrafter:
    """The drafter with heads from `checkpoint` (default: the heads shipped for the target's model; "untrained" =
    zero heads, which repeat the base distribution)."""
    if checkpoint == "untrained":
        heads = TokenSwiftHeads(target.args.hidden_size, 3, target.args.rms_eps)
    else:
        heads = load_heads(Path(checkpoint) if checkpoint is not None else shipped_heads_for(target), target)
    return TokenSwiftDrafter(heads, **{k: v for k, v in options.items() if v is not None})
