"""DFlash block drafter (the draft network: `spyglass.models.drafts.dflash`), optionally fused with the DeLS-Spec
local head (`spyglass.models.drafts.dels`).

One draft forward proposes a whole block: b-1 draft distributions after the root, each conditioned on the context
only (the hidden states of a few target layers, the *context stream*), none on the block's other drafted tokens.

Per sequence the drafter keeps the context stream's keys/values per draft layer for every committed position
whose target hidden states it was handed (`observe_hidden`, called by the engine after prefill chunks and
verify passes with the committed rows only). Positions whose target forward never ran here (a prefix loaded
from the Redis context cache) have no hidden states: the stream then covers only the positions seen, which
costs acceptance, never correctness. Rows are kept by position and cropped to `start` before new rows are
appended, so the cache always equals what recomputing it from scratch over the committed tokens would give.

A draft with a copy head (`DFlashConfig.copy_head`) mixes every block row with copies: a pointer from the final
hidden state of the position before the row's (the root's, for the first) over the target's committed last-layer
keys (read in place from the engine's KV cache), each position proposing the token after it. `dflash-span` (greedy
requests) uses it as `longspec-span` does (`spyglass.spans`): the chain ends at its first copied token and
goes on with the context's text after that token's source, and while the target's tokens keep agreeing with that
text (verified, or its own on a step the controller kept plain) the next chain continues it with no block forward
at all, also between the controller's probes (its free part). A copied token whose preceding text agrees with its
source's is tagged COPY_SOURCE and priced like the span behind it.

Greedy requests get the block's top-1 chain; every node carries P(accepted) as the product of the draft's
probabilities along its path (`DraftTree.scores`), and the engine's speculation controller sizes the chain by its
acceptance profile. Sampled requests get a chain sampled position by position from the (fused) draft distribution
under the request's sampling parameters, and that distribution is handed to the verifier as the proposal `q`
(rejection sampling: lossless, and it accepts more than matching target samples against argmax drafts when the
draft is close to the target).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from spyglass.drafters.base import DrafterTraits, DraftRequest, choose_draft_token, draft_generator, load_once
from spyglass.models.drafts.copy_head import add_copies_log
from spyglass.models.drafts.dels import load_local_head
from spyglass.models.drafts.dflash import DFlashDraft, load_dflash
from spyglass.models.linear import set_linear_backend
from spyglass.models.llama import Transformer
from spyglass.sequence import Sequence
from spyglass.spans import continuation, copied_score, copy_source, next_pointer, pointer_continuation, text_before
from spyglass.tree import COPY_SOURCE, DRAFT_SOURCE, SPAN_SOURCE, DraftTree
from spyglass.verify import Accepted

PACKAGED = Path(__file__).resolve().parents[1] / "drafts"
DEFAULT_DFLASH = PACKAGED / "smollm2-135m-dflash"
DEFAULT_DELS = PACKAGED / "smollm2-135m-dels"
# DFlash's copy head spreads its mass thinly (its largest single copy weight is ~0.012-0.016 along the dev prompts'
# outputs, against LongSpec's ~0.04-0.05), so a drafted token starts a span as soon as its top places hold this much
# (the span's source is then chosen among them by agreement with the text before). Swept on the 9 dev prompts (eval
# split, never benchmark prompts; 192 tokens, v9 + DeLS, two runs): mean speedup 1.28x at 0.1 (LongSpec's
# SPAN_MASS), 1.39x at 0.03, 1.45x at 0.01, 1.47x at 0.003, 1.54x at 0.0005; n-gram drafting 1.96-2.02x.
DFLASH_SPAN_MASS = 5e-4


def mix_copies(logits: torch.Tensor, keep: torch.Tensor, mass: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Log-probs `[Q, V]` of the copy-head proposal: the head's softmax (`logits` `[Q, V]`, -inf outside the draft's
    rows) weighted by exp(`keep`) plus each key position's `mass` `[Q, S]` on the token after it, `after` `[S]`."""
    return add_copies_log(torch.softmax(logits, -1) * keep.exp().unsqueeze(-1), mass, after)


@dataclass
class _Context:
    """The context stream of one sequence: per draft layer K/V rows at ascending positions."""

    k: list[torch.Tensor]  # per layer [kv_heads, cap, D]
    v: list[torch.Tensor]
    pos: torch.Tensor  # [cap] int64
    generator: torch.Generator | None  # the drafter's random stream for a sampled sequence
    n: int = 0
    pointer: int = -1  # spans: the context position whose token should be the root, where the last copy ended
    chain: list[int] | None = None  # spans: the last chain proposed (root first) and each node's context position
    origins: list[int] | None = None

    def crop(self, start: int) -> None:
        """Drop rows at positions >= start (a verify pass re-commits from `start`)."""
        self.n = int(torch.searchsorted(self.pos[: self.n], start))

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor) -> None:
        m = positions.shape[0]
        if self.n + m > self.pos.shape[0]:
            cap = max(2 * self.pos.shape[0], self.n + m)
            self.k = [_grow(t, cap) for t in self.k]
            self.v = [_grow(t, cap) for t in self.v]
            self.pos = torch.cat([self.pos, self.pos.new_zeros(cap - self.pos.shape[0])])
        for i, (k, v) in enumerate(kv):
            self.k[i][:, self.n : self.n + m] = k
            self.v[i][:, self.n : self.n + m] = v
        self.pos[self.n : self.n + m] = positions
        self.n += m

    def view(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, : self.n], v[:, : self.n]) for k, v in zip(self.k, self.v, strict=True)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v)) + self.pos.numel() * 8


def _grow(t: torch.Tensor, cap: int) -> torch.Tensor:
    out = t.new_empty(t.shape[0], cap, t.shape[2])
    out[:, : t.shape[1]] = t
    return out


class DFlashDrafter:
    """DFlash block drafting (`local_head` None) or DFlash + DeLS-Spec fusion (a `LocalHead`)."""

    traits: DrafterTraits  # set in __init__: they follow the draft's layers, the tree shape and the spans

    def __init__(
        self,
        draft: DFlashDraft,
        local_head=None,
        alpha: float = 0.3,
        beta: float = 0.3,
        block_size: int | None = None,
        span: int = 0,
        span_mass: float = DFLASH_SPAN_MASS,
        token_matched: bool = False,
    ) -> None:
        """A chain, sized by its acceptance profile: replayed over v6's drafts on the dev prompts
        (bench/probes/replay.py policies), a tree of runner-up tokens at low-confidence positions sized step by step
        from its scores made the same mean, but that per-step sizing stalls where the first drafts miss (median
        1.18x vs 1.26x, worst prompt 1.03x vs 1.09x).
        `span` > 0 (a copy-head draft, greedy requests): the chain ends at its first copied token and goes on with
        up to `span` tokens of the context that followed that token's source.
        `token_matched` (a composite's part, whose merged tree is verified by token matching): sampled requests get
        the chain of the processed rows' argmaxes (what token matching accepts most often), drawn from no random
        stream."""
        self.draft = draft.eval()
        self.local = local_head.eval() if local_head is not None else None
        self.alpha, self.beta = alpha, beta
        self.block = block_size or draft.cfg.block_size
        if self.block < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block}")
        if span < 0 or not 0 < span_mass <= 1:
            raise ValueError(f"span must be >= 0 and span_mass in (0, 1], got {span}, {span_mass}")
        if span and not draft.cfg.copy_head:
            raise ValueError("spans follow the copy head's pointer: this DFlash draft has no copy head")
        self.span, self.span_mass = span, span_mass
        self.traits = DrafterTraits(
            free="part" if span else "none",  # a copy that goes on costs no draft step: proposed between probes too
            token_matched=token_matched,
            drafts_chain=True,  # one token per block position: sized by its acceptance profile
            hidden_layers=tuple(draft.cfg.target_layers),
        )
        self.name = ("dflash-dels" if local_head is not None else "dflash") + ("-span" if span else "")
        self.capacity: int | None = None
        self.cache = None
        self.keys_layer = -1

    def bind(self, target: Transformer, cache) -> None:
        self.capacity, self.cache = cache.capacity, cache
        self.keys_layer = target.args.n_layers - 1  # a copy head points over the target's last-layer keys
        set_linear_backend(self.draft, target.draft_linear_backend)  # the kernels measured faster here
        if self.local is not None:
            self.local.prepare(self.draft.vocab_ids)

    def _state(self, seq: Sequence) -> _Context:
        if seq.drafter_state is None:
            c = self.draft.cfg
            cap = 256
            dtype, device = self.draft.dtype, self.draft.fc.weight.device
            k = [torch.empty(c.n_kv_heads, cap, c.head_dim, dtype=dtype, device=device) for _ in range(c.n_layers)]
            v = [torch.empty_like(t) for t in k]
            gen = None if self.traits.token_matched else draft_generator(seq)  # no draw: plain sampling's kept
            seq.drafter_state = _Context(k, v, torch.zeros(cap, dtype=torch.long), gen)
        return seq.drafter_state

    @torch.inference_mode()
    def observe_hidden(self, seq: Sequence, start: int, hidden: dict[int, torch.Tensor], kept: list[int]) -> None:
        st = self._state(seq)
        st.crop(start)
        idx = torch.tensor(kept, dtype=torch.long)
        feats = torch.cat([hidden[i][idx] for i in self.traits.hidden_layers], dim=-1)
        positions = torch.arange(start, start + len(kept))
        st.append(self.draft.context_kv(feats, positions), positions)

    def start(self, seq: Sequence) -> None:
        self._state(seq)

    @torch.inference_mode()
    def propose(self, batch: list[Sequence], wants: list[DraftRequest]) -> list[DraftTree]:
        cap = self.capacity or 1 << 30
        trees: list[DraftTree | None] = [None] * len(batch)
        drafted, hiddens = [], []  # (index, block size) of the sequences the block runs for
        for i, (seq, want) in enumerate(zip(batch, wants, strict=True)):
            b = max(1, min(self.block, cap - seq.num_tokens + 1))
            if b < 2:
                trees[i] = DraftTree.root_only(seq.root)
                continue
            if self.span and seq.params.greedy and (tree := self._follow_pointer(seq, cap)) is not None:
                trees[i] = tree  # the last accepted copy goes on: its continuation, no draft step
                continue
            if want.free_only:  # between the controller's probes: only a copy that goes on, for free
                trees[i] = DraftTree.root_only(seq.root)
                continue
            p = seq.committed
            x = self.draft.block_input(torch.tensor([seq.root]), b)
            hiddens.append(self.draft.blocks_hidden(x, torch.arange(p, p + b), self._state(seq).view()))
            drafted.append((i, b))
        if not drafted:
            return trees
        long_logits = self.draft.logits(torch.cat([h[1:] for h in hiddens]))
        offset = 0
        for (i, b), hidden in zip(drafted, hiddens, strict=True):
            seq, rows, mass = batch[i], long_logits[offset : offset + b - 1], None
            if self.draft.cfg.copy_head:
                rows, mass = self._with_copies(seq, hidden[:-1], rows)
            if not seq.params.greedy:
                trees[i] = self._sampled_chain(seq, rows)
            elif self.span:
                trees[i] = self._span_tree(seq, rows, mass, cap)
            else:
                trees[i] = self._tree(seq.root, rows)
            offset += b - 1
        return trees

    def _with_copies(self, seq: Sequence, hidden: torch.Tensor, logits: torch.Tensor):
        """A copy-head draft's rows: log-probs of the mixture of its LM head and its pointer (queried from the block
        positions before the drafted ones, `hidden`) over the target's committed last-layer keys (position j
        proposing the token after it), and the pointer's mass `[b-1, c]`."""
        keys = self.cache.prefix(seq.slot, self.keys_layer)[0]
        c = keys.shape[1]
        if c == 0:  # nothing to copy from
            return logits, logits.new_zeros(logits.shape[0], 0)
        keep, mass = self.draft.copy_read(hidden, torch.arange(c, c + hidden.shape[0]), keys)
        return mix_copies(logits, keep, mass, seq.tokens[1 : c + 1]), mass

    def _span_tree(self, seq: Sequence, rows: torch.Tensor, mass: torch.Tensor, cap: int) -> DraftTree:
        """The block's chain up to its first copied token (`spans.copy_source` on that position's pointer), then the
        context's continuation from that token's source; the whole chain if no position copies."""
        c, after = seq.committed, seq.tokens[1 : seq.committed + 1]
        chain, scores, h, found = [], [1.0], None, None
        for k in range(rows.shape[0]):
            logits, h = self._position_logits(rows, chain, h)
            p = torch.softmax(logits, -1)
            chain.append(int(p.argmax()))
            scores.append(scores[-1] * float(p[chain[-1]]))
            found = copy_source(seq, text_before(seq, chain, c), chain[-1], mass[k], after, self.span_mass)
            if found is not None:
                break
        if found is None:
            self._state(seq).chain = None
            return DraftTree.chain(seq.root, chain, scores=scores)
        at, match = found
        vouched = copied_score(scores[-2], match)  # priced as a span's, still evidence of the drafted profile
        if vouched is not None:
            scores[-1] = vouched
        span = continuation(seq, at, c, min(self.span, cap - seq.num_tokens - len(chain)), scores[-1], match)
        return self._spanned(seq, chain, scores, at, span, copied=vouched is not None)

    def _follow_pointer(self, seq: Sequence, cap: int) -> DraftTree | None:
        """Where the root is the context's token at the pointer (the last accepted copy goes on), the chain of what
        followed it there; None otherwise."""
        at = self._state(seq).pointer
        span = pointer_continuation(seq, at, seq.committed, min(self.span, cap - seq.num_tokens))
        return self._spanned(seq, [], [1.0], at, span) if span else None

    def _spanned(
        self, seq: Sequence, chain: list[int], scores: list[float], at: int, span: list, copied: bool = False
    ) -> DraftTree:
        """The chain root, `chain` (drafted; `scores` from the root's on), then `span`, the context's text after
        position `at`, which holds the chain's last token (the root's, for an empty chain; `copied`: that token
        is sized as a span's); remembered for `commit`'s pointer."""
        st = self._state(seq)
        st.chain = [seq.root, *chain, *(t for t, _ in span)]
        st.origins = [-1] * len(chain) + list(range(at, at + len(span) + 1))
        drafted = [DRAFT_SOURCE] * (len(chain) - copied) + [COPY_SOURCE] * copied
        sources = [0] + drafted + [SPAN_SOURCE] * len(span)
        n = len(st.chain)
        return DraftTree(torch.tensor(st.chain), list(range(-1, n - 1)), None, scores + [sc for _, sc in span], sources)

    def _position_logits(self, long_logits: torch.Tensor, chain: list[int], h):
        """Block position len(chain)'s logits: DFlash's alone first, then fused with the local head stepped on
        the chain so far. Returns the logits and the local head's new state."""
        logits = long_logits[len(chain)]
        if self.local is None or not chain:
            return logits, h
        h = self.local.step(chain[-1], h)
        ids = self.draft.vocab_ids
        if ids is None:
            return fuse(logits, self.local.logits(h), self.local.log_unigram, self.alpha, self.beta), h
        fused = logits.clone()  # -inf outside the draft's vocabulary stays -inf
        fused[ids] = fuse(logits[ids], self.local.logits(h, ids), self.local.log_unigram[ids], self.alpha, self.beta)
        return fused, h

    def _sampled_chain(self, seq: Sequence, long_logits: torch.Tensor) -> DraftTree:
        """A chain sampled from the processed (fused) draft rows, which are the verifier's proposal q (their
        argmaxes when `traits.token_matched`)."""
        chain, rows, h = [], [], None
        gen = self._state(seq).generator
        for _ in range(long_logits.shape[0]):
            logits, h = self._position_logits(long_logits, chain, h)
            tok, row = choose_draft_token(seq, chain, logits[None], gen, top=self.traits.token_matched)
            chain.append(tok)
            rows.append(row)
        # no per-node scores: the controller sizes a rejection-sampled chain from its shape and history only
        # (its own sampled tokens' probabilities would bias which of them get verified)
        return DraftTree.sampled_chain(seq.root, chain, rows)

    def _tree(self, root: int, long_logits: torch.Tensor) -> DraftTree:
        """Chain of argmaxes (fused with the local head after the first position), each node scored by the product
        of the probabilities along its path."""
        chain, scores, h = [], [1.0], None
        for _ in range(long_logits.shape[0]):
            logits, h = self._position_logits(long_logits, chain, h)
            p = torch.softmax(logits, dim=-1)
            chain.append(int(p.argmax()))
            scores.append(scores[-1] * float(p[chain[-1]]))
        return DraftTree.chain(root, chain, scores=scores)

    def commit(self, seq: Sequence, accepted: Accepted) -> None:
        """`observe_hidden` already appended the accepted rows (and cropped before them). With spans, the pointer
        follows the committed tokens along the copy (`spans.next_pointer`; compared by tokens: in a composite the
        verified tree is a merged one)."""
        st: _Context | None = seq.drafter_state
        if st is None or not self.span:
            return
        st.pointer = next_pointer(seq, st.pointer, st.chain, st.origins, accepted.tokens)
        st.chain = None

    def release(self, seq: Sequence) -> None:
        seq.drafter_state = None

    def state_bytes(self, seq: Sequence) -> int:
        st: _Context | None = seq.drafter_state
        return 0 if st is None else st.nbytes()


def fuse(long_logits, short_logits, log_prior, alpha: float = 0.3, beta: float = 0.3) -> torch.Tensor:
    """DeLS-Spec's product of experts in logit space: l = l_L + alpha * l_S - beta * log p_unigram."""
    return long_logits + alpha * short_logits.to(long_logits.dtype) - beta * log_prior.to(long_logits.dtype)


def build_dflash_drafter(
    target: Transformer, checkpoint=None, dels_checkpoint=None, dels: bool = False, loaded: dict | None = None, **kw
):
    """The packaged SmolLM2 drafts when no checkpoint is given (ValueError if they do not fit the target).
    `loaded`: a replica's memo (`load_once`): its dflash variants share one draft and one local head."""
    draft = load_once(loaded, "dflash", checkpoint or DEFAULT_DFLASH, lambda path: load_dflash(path, target))
    head = None
    if dels:
        head = load_once(loaded, "dels", dels_checkpoint or DEFAULT_DELS, lambda path: load_local_head(path, target))
    return DFlashDrafter(draft, head, **{k: v for k, v in kw.items() if v is not None})


__all__ = ["DFlashDrafter", "build_dflash_drafter", "fuse", "mix_copies"]
