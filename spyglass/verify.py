"""Lossless acceptance of a draft tree given the target's logits at every node.

- Greedy: descend while the target's argmax at the current node is one of its children.
- Sampling, any tree ("token matching"): draw one target sample per visited node and descend while it
  equals a child's token. The emitted tokens are exactly target samples, so the output distribution is
  plain sampling's whatever the drafter proposed.
- Sampling, a chain whose drafter supplies its proposal distribution q: probability-ratio rejection
  sampling (Leviathan et al. 2023): accept x with min(1, p(x)/q(x)); on rejection draw from
  norm(max(p - q, 0)); after a fully accepted chain draw the bonus token from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spyglass.sampling import SamplingParams, needs_presence, process, process_in_context, sample
from spyglass.tree import DraftTree


@dataclass
class Accepted:
    path: list[int]  # tree node indices kept, starting with the root (0)
    tokens: list[int]  # new tokens: the accepted drafted tokens, then the bonus token

    @property
    def num_drafted_accepted(self) -> int:
        return len(self.path) - 1


def target_rows(logits: torch.Tensor, tree: DraftTree, history: torch.Tensor, params: SamplingParams):
    """Processed target rows for every node (penalised logits if greedy, else probabilities)."""
    if not needs_presence(params):
        return process(logits, params, None)
    return process_in_context(logits, params, history, tree.tokens, tree.ancestor_mask())


def accept(
    tree: DraftTree,
    logits: torch.Tensor,
    history: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> Accepted:
    """`logits` `[n, V]` are the target's at each node; `history` the sequence's tokens (root included)."""
    rows = target_rows(logits, tree, history, params)
    if params.greedy:
        return walk(tree, lambda node: int(rows[node].argmax()))
    if tree.probs is not None and tree.is_chain and len(tree) > 1:
        return _rejection_chain(tree, rows, generator)
    return walk(tree, lambda node: sample(rows[node], generator))


def walk(tree: DraftTree, choose) -> Accepted:
    """Descend from the root while the token `choose(node)` picks at a node is one of its children's: the
    accepted path, then the first token no child matched (the bonus)."""
    kids = tree.children()
    tok = tree.tokens.tolist()
    path, out, node = [0], [], 0
    while True:
        want = choose(node)
        nxt = next((c for c in kids[node] if tok[c] == want), None)
        out.append(want)
        if nxt is None:
            return Accepted(path, out)
        path.append(nxt)
        node = nxt


def _rejection_chain(tree: DraftTree, p_rows: torch.Tensor, generator: torch.Generator | None) -> Accepted:
    q_rows = tree.probs
    tok = tree.tokens.tolist()
    path, out = [0], []
    for i in range(1, len(tok)):
        x = tok[i]
        p, q = p_rows[i - 1], q_rows[i]
        u = torch.rand((), generator=generator).item()
        if q[x] > 0 and u * float(q[x]) < float(p[x]):
            path.append(i)
            out.append(x)
            continue
        residual = torch.clamp(p - q, min=0.0)
        total = residual.sum()
        # total == 0 only when p == q exactly, where rejection has probability 0; guard numerically.
        out.append(sample(residual / total if total > 0 else p, generator))
        return Accepted(path, out)
    out.append(sample(p_rows[len(tok) - 1], generator))
    return Accepted(path, out)
