"""DeLS-Spec local head: the short-context expert fused into DFlash's block drafts (`spyglass.drafters.dflash`).

DFlash predicts every block position from the context alone; the local head sees only the tokens drafted so
far inside the block (a GRU from a zero state over the target's frozen embeddings), so fusing the two adds the
intra-block dependency DFlash lacks. The output is tied to the target: GRU state -> rank projection (SiLU) ->
`w_up` to the hidden size -> the target's frozen LM head, so only the small GRU and two projections are
trained and shipped. A unigram log-prior from corpus counts is subtracted once in the fusion, since both
experts already contain token frequency (`spyglass.drafters.dflash.fuse`).

Training (`spyglass.training.dflash`) needs only the target's embedding and head matrices (`read_frozen_io` reads
those two tensors from the safetensors files, never the transformer layers): next-token prediction in short windows
from a zero state (`spyglass.training.losses.local_head_loss`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from spyglass.weights import load_weights, save_weights, weights_path


@dataclass
class LocalHeadConfig:
    embed_dim: int
    vocab_size: int
    gru_hidden: int = 256
    rank: int = 128
    window: int = 16  # tokens per training window: window-1 inputs predict window-1 targets
    gamma: float = 7.0

    def to_dict(self) -> dict:
        return asdict(self)


def unigram_log_prior(counts: torch.Tensor, smoothing: float = 1.0) -> torch.Tensor:
    """log p(v) = log((count_v + smoothing) / (total + smoothing * V)): every token gets some mass."""
    c = counts.double() + smoothing
    return (c / c.sum()).log().float()


def token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens.reshape(-1), minlength=vocab_size)[:vocab_size]


class LocalHead(nn.Module):
    def __init__(self, cfg: LocalHeadConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.gru = nn.GRU(cfg.embed_dim, cfg.gru_hidden, num_layers=1, bias=False, batch_first=True)
        self.w_rank = nn.Linear(cfg.gru_hidden, cfg.rank, bias=False)
        self.w_up = nn.Linear(cfg.rank, cfg.embed_dim, bias=False)
        nn.init.zeros_(self.w_up.weight)  # starts as a uniform expert: fusion is a no-op before training
        self.register_buffer(
            "log_unigram", torch.full((cfg.vocab_size,), -float(torch.log(torch.tensor(cfg.vocab_size))))
        )
        # Frozen target matrices: referenced in a tuple so they are neither trained nor checkpointed.
        self._frozen = (embed_weight.detach(), head_weight.detach())
        self._fused: torch.Tensor | None = None
        self._fused_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, self._fused[ids])

    def _vocab(self) -> torch.Tensor:
        """`[V, rank]` = head @ w_up: logits from the rank-sized state in one small matmul."""
        return self._frozen[1].float() @ self.w_up.weight.float()

    def sequence_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits `[B, T, V]` for windows `tokens [B, T]` read from a zero state."""
        x = F.embedding(tokens, self._frozen[0]).float()
        out, _ = self.gru(x)
        r = F.silu(self.w_rank(out))
        return r @ self._vocab().T

    # -- inference: one token at a time --------------------------------------------------------
    def train(self, mode: bool = True):
        self._fused = self._fused_rows = None  # the fused matrix is rebuilt from the current weights
        return super().train(mode)

    @torch.inference_mode()
    def step(self, token: int, h: torch.Tensor | None) -> torch.Tensor:
        """Advance the GRU by one drafted token (h None = zero state)."""
        x = self._frozen[0][token].float().view(1, 1, -1)
        _, h = self.gru(x, h)
        return h

    @torch.inference_mode()
    def prepare(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The `[V, rank]` matrix `logits` multiplies (its `ids` rows when given), built once per weights: ~45 ms
        for SmolLM2, which a drafter pays when it binds to an engine rather than inside a request's step."""
        if self._fused is None:
            self._fused = self._vocab()
        if ids is None:
            return self._fused
        if self._fused_rows is None or self._fused_rows[0] is not ids:
            self._fused_rows = (ids, self._fused[ids].contiguous())
        return self._fused_rows[1]

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[V]`, or `[len(ids)]` for the tokens `ids` only (a reduced-vocabulary draft's: the rest of
        the fused logits is -inf whatever this head says, and the full product reads a 49K-row matrix)."""
        return self.prepare(ids) @ F.silu(self.w_rank(h.view(-1)))


def read_frozen_io(model_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and LM head matrices only, read tensor by tensor from its safetensors files
    (the transformer layers are never loaded). A tied model returns the embedding twice."""
    root = Path(model_dir)
    cfg = json.loads((root / "config.json").read_text())
    want = {"model.embed_tokens.weight": None, "lm_head.weight": None}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name in want:
                    want[name] = sf.get_tensor(name)
    embed = want["model.embed_tokens.weight"]
    if embed is None:
        raise ValueError(f"{root}: no model.embed_tokens.weight")
    head = want["lm_head.weight"]
    if head is None or cfg.get("tie_word_embeddings"):
        head = embed
    return embed.float(), head.float()


def save_local_head(head: LocalHead, out: str | Path, card: dict | None = None) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"kind": "dels-local-head", **head.cfg.to_dict(), **({"card": card} if card else {})}
    (out / "head_config.json").write_text(json.dumps(cfg, indent=1))
    save_weights(head.state_dict(), out / "head.safetensors")


def load_local_head(checkpoint: str | Path, target) -> LocalHead:
    """A local head on `target`'s frozen embedding and head (a Transformer). ValueError if it does not fit."""
    root = Path(checkpoint)
    cfg_file, weights = root / "head_config.json", weights_path(root / "head.safetensors")
    if not cfg_file.is_file() or not weights.is_file():
        raise ValueError(f"{root} is not a DeLS local head (needs head_config.json and head.safetensors[.xz])")
    cfg = json.loads(cfg_file.read_text())
    if cfg.pop("kind", None) != "dels-local-head":
        raise ValueError(f"{root} does not hold a DeLS local head")
    cfg.pop("card", None)
    c = LocalHeadConfig(**cfg)
    a = target.args
    if (c.embed_dim, c.vocab_size) != (a.hidden_size, a.vocab_size):
        raise ValueError(f"local head {root} does not fit the target: {(c.embed_dim, c.vocab_size)}")
    head = LocalHead(c, target.embed.weight, target.lm_head.weight)
    try:
        head.load_state_dict(load_weights(weights, torch.float32))  # the head runs in fp32 whatever the target
    except RuntimeError as e:
        raise ValueError(f"local head {root}: {e}") from e
    return head.to(target.device).eval()  # beside the target's matrices it reads, in fp32


__all__ = [
    "LocalHead",
    "LocalHeadConfig",
    "load_local_head",
    "read_frozen_io",
    "save_local_head",
    "token_counts",
    "unigram_log_prior",
]
