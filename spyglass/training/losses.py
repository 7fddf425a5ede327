"""The draft networks' training losses (the networks: `spyglass.models.drafts`).

LongSpec / GLIDE (`LOSSES`): the Ray trainer loop is drafter-agnostic: it hands a batch (a dict of tensors read from
extraction shards) to a loss module, which runs the draft and returns the loss and the metrics to log. DFlash and
the DeLS local head (`dflash_loss`, `local_head_loss`: `spyglass.training.dflash`) and TokenSwift's heads
(`heads_loss`: `spyglass.training.tokenswift_train`) are trained by their own loops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spyglass.models.drafts.copy_head import CopyMix
from spyglass.models.drafts.dels import LocalHead
from spyglass.models.drafts.dflash import DFlashDraft
from spyglass.models.drafts.tokenswift import TokenSwiftHeads
from spyglass.sampling import SamplingParams, apply_repetition_penalty, process


def soft_topk_ce(picked: torch.Tensor, scored: torch.Tensor, topk_logprobs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the draft's log-probs at the target's top-k ids (`picked` `[N, K]`) against the target's
    top-k distribution, renormalised over the ids the draft's head scores (`scored`): KL to the target's top-k up
    to a constant, per row `[N]`. Rows whose top-k the draft scores none of give 0."""
    p = torch.softmax(topk_logprobs.masked_fill(~scored, float("-inf")), dim=-1).nan_to_num(0.0)
    return -(p * picked.masked_fill(~scored, 0.0)).sum(-1)


def _copy_mass(attn: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy head's mass `[L, S]` over context positions, gathered by the token each proposes (`next_tokens`
    `[S]`): the distinct tokens `[U]` (sorted) and the mass on each, `[L, U]`."""
    uniq, inv = torch.unique(next_tokens, return_inverse=True)
    mass = attn.new_zeros(attn.shape[0], uniq.shape[0]).scatter_add_(1, inv.expand(attn.shape[0], -1), attn)
    return uniq, mass


def proposal_logp(out: torch.Tensor | CopyMix, ids: torch.Tensor, rows: torch.Tensor, next_tokens: torch.Tensor):
    """The draft's log-probs `[B, L, K]` at target ids `ids` `[B, L, K]` whose head rows are `rows` (-1: the head
    does not score it; only rows >= 0 are meaningful). A copy-head draft adds the mass its copy head puts on
    context positions followed by the id (`next_tokens` `[B, S]`)."""
    logits = out.logits if isinstance(out, CopyMix) else out
    head = torch.log_softmax(logits.float(), dim=-1).gather(-1, rows.clamp(min=0))
    if not isinstance(out, CopyMix):
        return head
    copied = []
    for b in range(ids.shape[0]):
        uniq, mass = _copy_mass(out.attn[b], next_tokens[b])
        at = torch.searchsorted(uniq, ids[b].flatten(1).clamp(min=0)).clamp(max=uniq.shape[0] - 1)
        copied.append(mass.gather(1, at) * (uniq[at] == ids[b].flatten(1)))
    copy_p = torch.stack(copied).view_as(head)
    return torch.logaddexp(out.keep.unsqueeze(-1) + head, copy_p.clamp_min(1e-30).log())


@torch.no_grad()
def proposal_argmax(
    out: torch.Tensor | CopyMix, vocab_ids: torch.Tensor, id_table: torch.Tensor, next_tokens: torch.Tensor
) -> torch.Tensor:
    """The target id `[B, L]` the draft proposes first (its argmax; a copy-head draft's over head and copies).
    `vocab_ids`: the target id of each head row; `id_table`: each target id's head row (-1: not scored)."""
    if not isinstance(out, CopyMix):
        return vocab_ids[out.argmax(-1)]
    p_head = torch.softmax(out.logits.float(), -1) * out.keep.exp().unsqueeze(-1)
    best_head_p, best_head = p_head.max(-1)
    picks = []
    for b in range(p_head.shape[0]):
        uniq, mass = _copy_mass(out.attn[b], next_tokens[b])
        rows = id_table[uniq]
        mass = mass + p_head[b][:, rows.clamp(min=0)] * (rows >= 0)
        best_copy_p, u = mass.max(-1)
        picks.append(torch.where(best_copy_p > best_head_p[b], uniq[u], vocab_ids[best_head[b]]))
    return torch.stack(picks)


def copy_predictions(tokens: torch.Tensor, orders: tuple[int, ...] = (3, 2)) -> torch.Tensor:
    """`[B, L]`: per position t, the token that followed the latest earlier occurrence of the longest of `orders`
    tokens ending at t (what copying from the context proposes next, as suffix drafting would), -1 if none."""
    out = torch.full_like(tokens, -1)
    for b, row in enumerate(tokens.tolist()):
        seen: dict[tuple, int] = {}  # n-gram -> the token after its latest occurrence so far
        for t in range(len(row)):
            for n in orders:
                if t + 1 >= n and (nxt := seen.get(tuple(row[t + 1 - n : t + 1]))) is not None:
                    out[b, t] = nxt
                    break
            if t + 1 < len(row):  # the n-grams ending at t are followed by row[t + 1]: known from t + 1 on
                for n in orders:
                    if t + 1 >= n:
                        seen[tuple(row[t + 1 - n : t + 1])] = row[t + 1]
    return out


class LongSpecLoss(nn.Module):
    """Next-token loss of the LongSpec draft over a context, cross-attending to the target's last-layer K/V
    with a lag (Flash Noisy Training).

    - `all_lags`: every lag in [lag_min, lag_max] in each step (the self-attention is shared), weighted by
      `lag_weights`; otherwise one lag drawn per step. A chain node at depth d sees the target d + 1 back, so
      lag l trains what depth l - 1 proposes.
    - `distill_weight` mixes the corpus CE with distillation: to the target's top-k distribution when
      `soft_distill` (needs `topk_logprobs` in the shards), else to its top-1.
    - `hidden_layers`: a `feed_hidden` draft also reads these layers' hidden states (side by side, in this order),
      with the same lag.
    - A draft with a reduced head (`draft_vocab`) is trained over its own rows; labels it cannot score are
      left out of the CE.
    - `copy_weight`: positions where copying from the context (`copy_predictions`) gives the target's choice
      weigh this much more. Served at T=0 the target copies its prompt most of the time, and the draft misses
      more than half of those tokens (BENCHMARKS.md, "What the learned drafts miss").

    Metrics: `loss`, `ce`, `top1_agreement` (the draft's argmax equals the target's, on the positions that see
    some target context), `token_accuracy`, `copy_agreement` (the same on copyable positions), `copyable` (their
    share), and per lag `agree_lag{l}` when several lags run.
    """

    def __init__(
        self,
        kv_layer: int | list[int],
        lag_min: int = 1,
        lag_max: int = 4,
        distill_weight: float = 0.0,
        soft_distill: bool = False,
        all_lags: bool = False,
        lag_weights: list[float] | None = None,
        loss_from: int = 0,
        hidden_layers: list[int] | None = None,
        copy_weight: float = 1.0,
    ) -> None:
        super().__init__()
        self.kv_layers = [kv_layer] if isinstance(kv_layer, int) else list(kv_layer)  # one per draft layer
        self.hidden_layers = list(hidden_layers or [])  # a `feed_hidden` draft reads these extracted layers
        self.lag_min, self.lag_max = lag_min, lag_max
        self.distill_weight = distill_weight
        self.soft_distill = soft_distill
        self.all_lags = all_lags
        n = lag_max - lag_min + 1
        self.lag_weights = list(lag_weights) if lag_weights else [1.0] * n
        if len(self.lag_weights) != n:
            raise ValueError(f"lag_weights needs {n} entries (lags {lag_min}..{lag_max})")
        self.loss_from = loss_from  # positions before it get no loss (and no logits): cheaper steps
        if copy_weight <= 0:
            raise ValueError(f"copy_weight must be > 0, got {copy_weight}")
        self.copy_weight = copy_weight
        self._id_map: torch.Tensor | None = None

    def required_keys(self) -> list[str]:
        keys = ["tokens", "positions", *(f"kv.{i}" for i in self.kv_layers), "topk_ids"]
        keys.extend(f"hidden.{i}" for i in self.hidden_layers)
        return [*keys, "topk_logprobs"] if self.soft_distill else keys

    def lag(self, step: int, seed: int) -> int | tuple[int, ...]:
        """Per step, identical on every rank and after a resume."""
        if self.all_lags:
            return tuple(range(self.lag_min, self.lag_max + 1))
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return int(torch.randint(self.lag_min, self.lag_max + 1, (1,), generator=g))

    def _id_table(self, draft: nn.Module) -> torch.Tensor:
        """`[vocab]`: each target id's row in the draft's head (-1: not scored), kept while the head's ids stay."""
        if self._id_map is None or not torch.equal(self._id_map_src, draft.vocab_ids):
            self._id_map, self._id_map_src = draft.full_to_draft_ids(), draft.vocab_ids.clone()
        return self._id_map

    def forward(
        self, model: nn.Module, batch: dict[str, torch.Tensor], lag: int | tuple[int, ...]
    ) -> tuple[torch.Tensor, dict]:
        tokens, positions = batch["tokens"], batch["positions"]
        kvs = [batch[f"kv.{i}"] for i in self.kv_layers]  # [B, 2, kvh, L, D] each
        lags = lag if isinstance(lag, tuple) else (lag,)
        lo = min(self.loss_from, tokens.shape[1] - 2)
        hidden = torch.cat([batch[f"hidden.{i}"] for i in self.hidden_layers], -1) if self.hidden_layers else None
        # [nlags, B, L - lo, Vd] (a CopyMix of such for a copy-head draft)
        ks, vs = [kv[:, 0] for kv in kvs], [kv[:, 1] for kv in kvs]
        outs = model(tokens, positions, ks, vs, lag=lags, logits_from=lo, target_h=hidden)
        draft = getattr(model, "module", model)
        id_table = self._id_table(draft)
        next_tokens = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)  # the token after each context position
        labels = tokens[:, lo + 1 :]
        label_rows = id_table[labels]
        topk = batch["topk_ids"][:, lo:-1] if self.soft_distill else batch["topk_ids"][:, lo:-1, :1]
        topk_rows = id_table[topk]
        ids = torch.cat([labels.unsqueeze(-1), topk], dim=-1)
        rows = torch.cat([label_rows.unsqueeze(-1), topk_rows], dim=-1)
        target_top1 = batch["topk_ids"][:, lo:-1, 0]
        copyable = copy_predictions(tokens)[:, lo:-1] == target_top1
        pos_w = (1.0 + (self.copy_weight - 1.0) * copyable.float()).flatten()
        loss = 0.0
        metrics: dict[str, torch.Tensor] = {}
        ce_sum = agree_sum = acc_sum = copy_sum = 0.0
        weights = [self.lag_weights[lg - self.lag_min] for lg in lags]
        for i, (lg, w) in enumerate(zip(lags, weights, strict=True)):
            out = outs.select((i, slice(None), slice(None, -1))) if isinstance(outs, CopyMix) else outs[i, :, :-1]
            picked = proposal_logp(out, ids, rows, next_tokens)  # [B, L', 1 + K]: the label, the target's top-k
            ce = _weighted_nll(picked[..., 0].flatten(), label_rows.flatten(), pos_w)
            one = ce
            if self.distill_weight > 0:
                at_topk = picked[..., 1:].flatten(0, 1)
                if self.soft_distill:
                    kd_rows = soft_topk_ce(
                        at_topk, topk_rows.flatten(0, 1) >= 0, batch["topk_logprobs"][:, lo:-1].float().flatten(0, 1)
                    )
                    kd = _weighted_mean(kd_rows, pos_w)
                else:
                    kd = _weighted_nll(at_topk[:, 0], topk_rows.flatten(0, 1)[:, 0], pos_w)
                one = (1 - self.distill_weight) * ce + self.distill_weight * kd
            loss = loss + w * one
            with torch.no_grad():
                valid = torch.zeros_like(labels, dtype=torch.bool)
                valid[:, max(0, lg - lo) :] = True  # queries t >= lag see target K/V; earlier ones still get a loss
                argmax = proposal_argmax(out, draft.vocab_ids, id_table, next_tokens)
                n = valid.sum().clamp(min=1)
                agree = (((argmax == target_top1) & valid).sum().float() / n).detach()
                ce_sum += float(ce)
                agree_sum += float(agree)
                acc_sum += float(((argmax == labels) & valid).sum().float() / n)
                copied = valid & copyable
                copy_sum += float(((argmax == target_top1) & copied).sum() / copied.sum().clamp(min=1))
                if len(lags) > 1:
                    metrics[f"agree_lag{lg}"] = agree
        loss = loss / sum(weights)
        k = len(lags)
        metrics.update(
            {
                "ce": torch.tensor(ce_sum / k),
                "top1_agreement": torch.tensor(agree_sum / k),
                "token_accuracy": torch.tensor(acc_sum / k),
                "copy_agreement": torch.tensor(copy_sum / k),
                "copyable": copyable.float().mean(),
            }
        )
        return loss, metrics


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp(min=1e-9)


def _weighted_nll(picked: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean NLL of the label log-probs `picked` `[N]` over the rows whose label the head scores (`rows` >= 0), row i
    weighing `weights[i]` (a plain mean for equal weights)."""
    return _weighted_mean(-picked, weights * (rows >= 0))


LOSSES = {"longspec": LongSpecLoss}


# --------------------------------------------------------------------------- DFlash and the DeLS local head


def training_mask(anchors: torch.Tensor, ctx_len: int, block: int) -> torch.Tensor:
    """`[A*block, ctx_len + A*block]` bool: a block anchored at position a sees context positions < a (what the
    target's hidden states cover when the root at a is drafted from) and every token of its own block."""
    a = anchors.shape[0]
    q_anchor = anchors.repeat_interleave(block).unsqueeze(1)
    ctx_ok = torch.arange(ctx_len).unsqueeze(0) < q_anchor
    blk = torch.arange(a).repeat_interleave(block)
    blk_ok = blk.unsqueeze(1) == blk.unsqueeze(0)
    return torch.cat([ctx_ok, blk_ok], dim=1)


def dflash_loss(
    draft: DFlashDraft,
    feats: torch.Tensor,
    tokens: torch.Tensor,
    anchors: torch.Tensor,
    gamma: float = 7.0,
    vocab_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Block loss on one context: `feats [L, layers*H]` target hidden states, `tokens [L]`, `anchors [A]` with
    a + block <= L. Block position k >= 1 predicts tokens[a+k] with weight exp(-(k-1)/gamma) (DFlash's decay:
    early positions matter most, as acceptance stops at the first miss). `vocab_ids` (frequency-ranked token
    ids) restricts the softmax to those rows of the shared head, a CPU saving: targets outside are skipped (unless
    the copy head can copy them); serving always uses the full head. `labels [L]` (the target's greedy next token
    at each position) replace the text as targets: position k then learns the target's choice after the true
    prefix a+k-1 (distillation). A copy-head draft needs `keys`, the target's last-layer keys `[kvh, L, D]`: the
    loss is then the mixture's, its pointer seeing the positions before the anchor."""
    b = draft.cfg.block_size
    length = tokens.shape[0]
    ctx = draft.context_kv(feats, torch.arange(length))
    x = draft.block_input(tokens[anchors], b)
    pos = (anchors.unsqueeze(1) + torch.arange(b)).reshape(-1)
    mask = training_mask(anchors, length, b)
    out = draft.blocks_hidden(x, pos, ctx, mask).view(anchors.shape[0], b, -1)
    hid = out[:, 1:].reshape(-1, out.shape[-1])
    if labels is None:
        targets = tokens[(anchors.unsqueeze(1) + torch.arange(1, b)).reshape(-1)]
    else:
        targets = labels[(anchors.unsqueeze(1) + torch.arange(0, b - 1)).reshape(-1)]
    if vocab_ids is None:
        logits = draft.logits(hid)
    else:
        logits = F.linear(hid.to(draft.lm_head.weight.dtype), draft.lm_head.weight[vocab_ids]).float()
    if draft.cfg.copy_head:
        if keys is None:
            raise ValueError("a copy-head draft's loss needs the target's last-layer keys")
        row_anchor = anchors.repeat_interleave(b - 1)
        visible = torch.arange(length).unsqueeze(0) < row_anchor.unsqueeze(1)
        queries = out[:, :-1].reshape(-1, out.shape[-1])  # each token's copy is pointed from the position before it
        keep, mass = draft.copy_read(queries, (anchors.unsqueeze(1) + torch.arange(b - 1)).reshape(-1), keys, visible)
        head_p = torch.softmax(logits, -1) * keep.exp().unsqueeze(-1)
        p = head_p.new_zeros(head_p.shape[0], draft.cfg.vocab_size)
        p = p.index_copy(1, vocab_ids, head_p) if vocab_ids is not None else head_p
        after = torch.cat([tokens[1:], tokens[-1:]])
        p = p.scatter_add(-1, after.expand(mass.shape), mass)
        picked = p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ok = picked > 0
        ce = -picked.clamp_min(1e-30).log() * ok
        hit_rows = p.detach().argmax(-1) == targets
    else:
        if vocab_ids is not None:
            remap = torch.full((draft.cfg.vocab_size,), -100, dtype=torch.long)
            remap[vocab_ids] = torch.arange(vocab_ids.shape[0])
            targets = remap[targets]
        ok = targets != -100
        ce = F.cross_entropy(logits, targets, reduction="none", ignore_index=-100)
        hit_rows = logits.detach().argmax(-1) == targets
    ce = ce.view(anchors.shape[0], b - 1)
    w = torch.exp(-torch.arange(b - 1, dtype=torch.float32) / gamma) * ok.view(ce.shape).float()
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = hit_rows.view(anchors.shape[0], b - 1).float()
        run = hit.cumprod(dim=1).sum(dim=1).mean()  # accepted drafted tokens if verified greedily as a chain
    return loss, {"acc_first": float(hit[:, 0].mean()), "accepted_chain": float(run)}


def window_weights(n: int, gamma: float = 7.0) -> torch.Tensor:
    """exp(-k/gamma) for targets k = 0..n-1 of a window: later positions are reached less often at drafting."""
    return torch.exp(-torch.arange(n, dtype=torch.float32) / gamma)


def local_head_loss(head: LocalHead, windows: torch.Tensor) -> torch.Tensor:
    """The DeLS local head's next-token loss over `windows [B, window]` (inputs [:, :-1], targets [:, 1:], each read
    from a zero state), the k-th target of a window weighted by exp(-k/gamma)."""
    logits = head.sequence_logits(windows[:, :-1])
    n = windows.shape[1] - 1
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1), reduction="none")
    w = window_weights(n, head.cfg.gamma)
    return (ce.view(-1, n) * w).sum() / (w.sum() * windows.shape[0])


# --------------------------------------------------------------------------- TokenSwift's heads


def window_mask(
    tokens: torch.Tensor, ctx: torch.Tensor, end: torch.Tensor, window: int, vocab: torch.Tensor | None, n_cols: int
) -> torch.Tensor:
    """`[m, n_cols]` bool: the tokens among `tokens[ctx, end - window : end]` (row by row), as columns of the
    reduced vocabulary `vocab` (sorted ids; tokens outside it are dropped) or of the full one."""
    idx = end[:, None] - window + torch.arange(window)
    toks = tokens[ctx[:, None], idx.clamp(min=0)]
    valid = idx >= 0
    if vocab is not None:
        col = torch.searchsorted(vocab, toks).clamp(max=len(vocab) - 1)
        valid &= vocab[col] == toks
        toks = col
    mask = torch.zeros(len(ctx), n_cols + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(valid, toks, n_cols), True)  # invalid entries land in the spare last column
    return mask[:, :n_cols]


def heads_loss(
    heads: TokenSwiftHeads,
    target,
    h0: torch.Tensor,
    tokens: torch.Tensor,
    pos: torch.Tensor,
    vocab: torch.Tensor | None = None,
    distill: float = 0.0,
    sampling: SamplingParams | None = None,
):
    """Sum over heads i = 1..gamma of the loss of head i at position t on token t + 1 + i, through the frozen norm
    and head: (1 - distill) x CE against the corpus token + distill x CE against the target's own distribution
    there (its logits at t + i, computed from the stored hidden state: acceptance means matching the target, not
    the corpus, and the soft label carries what a sampled continuation would make of it).

    `sampling` (a sampled request's parameters) trains for serving under them: the teacher is the distribution
    the target samples from there (contextual penalty over the window before token t + 1 + i, temperature,
    min-p...), and the head's logits get the penalty the drafter applies, over the window ending at token t + 1
    (the step's root: a drafter processes every depth with the start-of-step context).

    `h0` `[n, L, d]` last-layer hidden states, `tokens` `[n, L]`, `pos` `[m, 2]` (context, t) rows with
    t + 1 + gamma < L. `vocab` (sorted token ids): a cheaper training loss over only those rows of the LM head,
    positions whose corpus token lies outside dropped (the head is most of the cost on a CPU). Returns (loss,
    per-head corpus CE list, per-head metrics: top-1 vs the corpus, top-1 vs the target's argmax, and the target's
    probability of the head's top-1 token, i.e. its acceptance rate at T=1)."""
    ctx, t = pos[:, 0], pos[:, 1]
    h = h0[ctx, t].float()
    ces, losses = [], []
    metrics = {"top1": [], "target_top1": [], "target_prob": []}
    streams = heads(h)
    weight = target.lm_head.weight if vocab is None else target.lm_head.weight[vocab]
    penalised = sampling is not None and sampling.contextual_penalty != 1.0
    if penalised:
        draft_window = window_mask(tokens, ctx, t + 2, sampling.penalty_window, vocab, weight.shape[0])
    for i in range(1, heads.gamma + 1):
        logits = (target.norm(streams[i]) @ weight.T).float()
        with torch.no_grad():
            teacher = (target.norm(h0[ctx, t + i].float()) @ weight.T).float()
            if sampling is None:
                teacher = teacher.softmax(-1)
            else:
                window = (
                    window_mask(tokens, ctx, t + i + 1, sampling.penalty_window, vocab, weight.shape[0])
                    if penalised
                    else None
                )
                teacher = process(teacher, sampling, None, window)
                if sampling.greedy:  # process gives the penalised logits: the teacher is their softmax
                    teacher = teacher.softmax(-1)
        if penalised:
            logits = apply_repetition_penalty(logits, draft_window, sampling.contextual_penalty)
        want = tokens[ctx, t + 1 + i]
        if vocab is not None:
            idx = torch.searchsorted(vocab, want).clamp(max=len(vocab) - 1)
            keep = vocab[idx] == want
            logits, want, teacher = logits[keep], idx[keep], teacher[keep]
        ce = nn.functional.cross_entropy(logits, want)
        ces.append(ce)
        soft = -(teacher * logits.log_softmax(-1)).sum(-1).mean() if distill else 0.0
        losses.append((1 - distill) * ce + distill * soft)
        pick = logits.argmax(-1)
        metrics["top1"].append(float((pick == want).float().mean()))
        metrics["target_top1"].append(float((pick == teacher.argmax(-1)).float().mean()))
        metrics["target_prob"].append(float(teacher.gather(1, pick[:, None]).mean()))
    return sum(losses), [float(c.detach()) for c in ces], metrics
