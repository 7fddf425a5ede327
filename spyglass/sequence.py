"""A live generation request: its tokens, KV slot, sampling state and statistics."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from spyglass.detokenize import TextStream
from spyglass.sampling import SamplingParams

_ids = itertools.count()


@dataclass
class ControllerStats:
    """What the controller decided for one sequence (reported in the per-request stats)."""

    drafted_steps: int = 0
    plain_steps: int = 0
    probe_steps: int = 0
    proposed_nodes: int = 0
    verified_nodes: int = 0

    def summary(self) -> dict:
        steps = self.drafted_steps + self.plain_steps
        return {
            "plain_steps": self.plain_steps,
            "probe_steps": self.probe_steps,
            "proposed_nodes": self.proposed_nodes,
            "verified_nodes": self.verified_nodes,
            "mean_verified_nodes": self.verified_nodes / steps if steps else 0.0,
        }


@dataclass
class SeqStats:
    steps: int = 0
    new_tokens_per_step: list[int] = field(default_factory=list)
    depth_trials: list[int] = field(default_factory=list)  # [d-1]: steps whose tree reached depth d
    depth_hits: list[int] = field(default_factory=list)  # [d-1]: steps that accepted >= d drafted tokens
    drafted_nodes: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0  # admission to first token (chunked prefill: steps shared with decoding streams)
    prefill_compute_time: float = 0.0  # of that, the prefill forwards of this prompt
    prefill_tokens: int = 0
    cached_prefix_tokens: int = 0  # prompt tokens whose K/V came from the context cache or another slot
    live_prefix_tokens: int = 0  # of those, from a slot: another sequence's (copied) or a released one (taken)
    batch_sizes: list[int] = field(default_factory=list)
    t_start: float = field(default_factory=time.perf_counter)
    t_admit: float | None = None  # given a KV slot (its prefill starts)
    t_first_token: float | None = None
    t_end: float | None = None
    control: ControllerStats = field(default_factory=ControllerStats)

    def record_step(self, tree_depth: int, tree_nodes: int, accepted: int, new_tokens: int, batch: int) -> None:
        self.steps += 1
        self.new_tokens_per_step.append(new_tokens)
        self.drafted_nodes += tree_nodes - 1
        self.batch_sizes.append(batch)
        while len(self.depth_trials) < tree_depth:
            self.depth_trials.append(0)
            self.depth_hits.append(0)
        for d in range(tree_depth):
            self.depth_trials[d] += 1
            if accepted > d:
                self.depth_hits[d] += 1

    def summary(self, num_generated: int) -> dict:
        decode_time = (self.t_end or time.perf_counter()) - (self.t_first_token or self.t_start)
        decode_tokens = max(num_generated - 1, 0)  # the first token comes from prefill
        return {
            "tau": sum(self.new_tokens_per_step) / self.steps if self.steps else 0.0,
            "steps": self.steps,
            "generated_tokens": num_generated,
            "acceptance_by_depth": [h / t for h, t in zip(self.depth_hits, self.depth_trials, strict=True) if t],
            "drafted_tokens": self.drafted_nodes,
            "draft_time_s": self.draft_time,
            "verify_time_s": self.verify_time,
            "prefill_time_s": self.prefill_time,
            "prefill_compute_s": self.prefill_compute_time,
            "prefill_tokens": self.prefill_tokens,
            "cached_prefix_tokens": self.cached_prefix_tokens,
            "live_prefix_tokens": self.live_prefix_tokens,
            "ttft_s": (self.t_first_token - self.t_start) if self.t_first_token else None,
            "decode_time_s": decode_time,
            "tokens_per_s": decode_tokens / decode_time if decode_time > 0 else 0.0,
            "mean_batch_size": sum(self.batch_sizes) / len(self.batch_sizes) if self.batch_sizes else 0.0,
            "controller": self.control.summary(),
            **{f"controller_{k}": v for k, v in self.control.summary().items() if k != "mean_verified_nodes"},
        }


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, seq_id: str | None = None) -> None:
        self.seq_id = seq_id if seq_id is not None else f"seq-{next(_ids)}"
        self.params = params
        self.num_prompt = len(prompt_ids)
        self._buf = torch.empty(self.num_prompt + params.max_new_tokens + 1, dtype=torch.long)
        self._buf[: self.num_prompt] = torch.tensor(prompt_ids, dtype=torch.long)
        self.num_tokens = self.num_prompt
        self.slot: int | None = None
        self.prefill_credit = 0  # prompt tokens the engine prefilled for other prompts while this one waited
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()
        self.finished = False
        self.finish_reason: str | None = None
        self.stats = SeqStats()
        self.method = "default"  # which of the engine's drafters serves it (SpecEngine.add_request sets it)
        self.drafter_state: object = None  # owned by the drafter
        self.text_stream: TextStream | None = None  # the output's text as it grows (set by an engine with a tokenizer)
        self.control: object = None  # owned by the engine's speculation controller
        self.drafted_before = False  # the engine does not time a sequence's first drafting step (one-off costs)

    @property
    def tokens(self) -> torch.Tensor:
        """All tokens so far (prompt + output) as a view; the last one is the root of the next tree."""
        return self._buf[: self.num_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self._buf[self.num_prompt : self.num_tokens].tolist()

    @property
    def num_generated(self) -> int:
        return self.num_tokens - self.num_prompt

    @property
    def root(self) -> int:
        return int(self._buf[self.num_tokens - 1])

    @property
    def committed(self) -> int:
        """Tokens whose target KV is committed: all but the root."""
        return self.num_tokens - 1

    def append(self, token: int) -> None:
        self._buf[self.num_tokens] = token
        self.num_tokens += 1

    def finish(self, reason: str) -> None:
        if not self.finished:
            self.finished = True
            self.finish_reason = reason
            self.stats.t_end = time.perf_counter()
