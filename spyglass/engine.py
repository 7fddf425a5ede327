"""SpecEngine: prefill, then draft -> verify -> accept -> commit over a continuous batch.

Every running sequence contributes one draft tree to a single packed target forward per step; new
requests are prefilled in chunks, a bounded number of prompt tokens per step in forwards of their own
(chunked prefill), so the running sequences keep decoding while a long prompt is read; a prompt joins
the batch once its prefill completes, finished ones leave it. Plain decoding is the same loop with
root-only trees (`drafter=None`).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from spyglass.chain_controller import controller_for
from spyglass.context_cache import ContextCache, PendingCopy, kv_blocks_from_cache, load_blocks_into_cache
from spyglass.controller import Controller, ControllerConfig, size_batch
from spyglass.cost import CostCurve, measured_curve, measured_prefill_cost
from spyglass.detokenize import TextStream
from spyglass.device import synchronize
from spyglass.drafters.base import Drafter, DraftRequest, NullDrafter
from spyglass.kv_cache import context_capacity
from spyglass.limits import RequestError, check_method, check_prompt_ids
from spyglass.models.llama import PREFILL_CHUNK, Segment, StagedForward, Transformer
from spyglass.sampling import SamplingParams, process_in_context, sample
from spyglass.sequence import Sequence
from spyglass.tree import DraftTree
from spyglass.verify import Accepted, accept

PREFILL_GRAIN = 16  # the least tokens a forward prefills of a prompt where chunks may have any size (the GEMM's lanes)
PREFILL_STEP_ROUNDS = 2.0  # a step's prefill beside decoding streams, in their recent round's time (EngineConfig)


@dataclass
class EngineConfig:
    max_batch: int = 4
    max_context: int | None = None  # KV capacity per sequence: a cap in 2..the model's window (default: the window)
    # Prompt tokens per prefill forward while other sequences decode (4 chunks' worth when none does). Where the
    # model's prefill is row-invariant (`Transformer.prefill_row_invariant`: a prompt's K/V do not depend on its
    # chunks) several prompts may share a forward's tokens and a cache hit loads any whole blocks; otherwise every
    # chunk but a prompt's last has this size, so a prompt's K/V come from the same forwards under any load (and in
    # `plain_generate`).
    prefill_chunk: int = PREFILL_CHUNK
    # Chunked prefill, spread over steps: while other sequences decode, a step runs a prefill forward's layers for
    # about `prefill_step_s` (timed on its layers so far, before them from the cost measured at start-up:
    # spyglass.cost.measured_prefill_cost), at least one, so a decoding stream waits about that long at most for
    # other prompts between two of its rounds. Unset, the budget is PREFILL_STEP_ROUNDS times the running batch's
    # round lately (its drafting and verify pass), so a stream's step is about 3 of its rounds on any machine. The
    # forward costs the same however many steps it is spread over, so a small budget costs the prompts little: served
    # under 4 streams of long prompts (Zen 3, bf16) 0.25 / 0.15 / 0.1 s gave a median time per output token of 94 /
    # 67 / 49 ms, the same median time to first token (79 / 78 / 76 s) and wall time (235 / 224 / 224 s).
    # `prefill_layers` fixes the number of layers instead.
    prefill_step_s: float | None = None
    prefill_layers: int | None = None
    # Tree sizing: "measure" = the speculation controller with the verify-cost curve measured at start-up on
    # this machine; "off" = verify every node the drafter proposes. A CostCurve here is used as given.
    controller: str | CostCurve = "measure"
    control: ControllerConfig = field(default_factory=ControllerConfig)  # the controller's tuned constants


@dataclass
class StagedPrefill:
    """A prefill forward under way: its chunks (prompt, start, tokens) and the seconds its layers took so far."""

    picks: list[tuple[Sequence, int, int]]
    forward: StagedForward
    seconds: float = 0.0


@dataclass
class Event:
    """What one step did for one sequence: the tokens it appended, the text they released, and for a speculative
    round what was verified (a prefill's event carries zeros there)."""

    seq: Sequence
    new_tokens: list[int]
    text: str = ""  # new output text clients may see (see TextStream.release); "" without a tokenizer
    drafted: int = 0  # drafted tokens verified this step (tree nodes past the root)
    accepted: int = 0  # of those, the ones the target accepted
    batch_size: int = 0  # sequences in this step's verify forward (0: no verify step for this sequence)

    @property
    def finished(self) -> bool:
        return self.seq.finished

    def then(self, later: Event) -> Event:
        """This event followed by a later one of the same sequence and step (a prefill, then its first round)."""
        return Event(
            self.seq,
            self.new_tokens + later.new_tokens,
            self.text + later.text,
            self.drafted + later.drafted,
            self.accepted + later.accepted,
            later.batch_size or self.batch_size,
        )


class SpecEngine:
    """One continuous batch over one KV pool. `drafter` serves every request (plain decoding when None); or
    `drafters` maps method names to drafters (None = plain decoding) and each request names its method: the step
    groups the running sequences by method, each drafter proposes for its group, and every tree of every method is
    verified in one packed target forward. The first method is the default."""

    def __init__(
        self,
        target: Transformer,
        drafter: Drafter | None = None,
        config: EngineConfig | None = None,
        tokenizer=None,
        context_cache: ContextCache | None = None,
        drafters: dict[str, Drafter | None] | None = None,
    ) -> None:
        if drafters is not None and drafter is not None:
            raise ValueError("give either one drafter or a drafters mapping, not both")
        if drafters is not None and not drafters:
            raise ValueError("drafters must name at least one method")
        self.target = target
        self.context_cache = context_cache
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        cfg = self.config
        self.capacity = context_capacity(
            target.args, cfg.max_context, max_batch=cfg.max_batch, dtype=target.dtype, device=target.device
        )
        self.cache = target.new_cache(self.capacity, self.config.max_batch)
        named = drafters if drafters is not None else {"default": drafter}
        self.drafters: dict[str, Drafter] = {m: d or NullDrafter() for m, d in named.items()}
        self.default_method = next(iter(self.drafters))
        curve = self.config.controller
        if curve == "measure" and any(d is not None for d in named.values()):
            curve = measured_curve(target, self.cache)  # one curve per process: every method sizes trees by it
        elif curve not in ("measure", "off") and not isinstance(curve, CostCurve):
            raise ValueError(f"controller must be 'measure', 'off' or a CostCurve, not {curve!r}")
        self.controllers: dict[str, Controller | None] = {}
        n_layers = target.args.n_layers
        capture: set[int] = set()
        for method, d in self.drafters.items():
            d.bind(target, self.cache)
            capture.update(i % n_layers for i in d.traits.hidden_layers)
            drafts = named[method] is not None and self.config.controller != "off"
            self.controllers[method] = controller_for(d, curve, cfg.control) if drafts else None
        self._capture = tuple(sorted(capture))
        self.prefill_chunk = cfg.prefill_chunk
        self.any_chunk = bool(getattr(target, "prefill_row_invariant", False))
        # the least a forward prefills of a prompt (unless less is left): a fixed chunk, or PREFILL_GRAIN tokens
        self.prefill_unit = min(PREFILL_GRAIN, cfg.prefill_chunk) if self.any_chunk else cfg.prefill_chunk
        self.prefill_cost = self._prefill_cost()
        self.staged: StagedPrefill | None = None  # a prefill forward whose layers run over several steps
        self.round_times: deque[float] = deque(maxlen=5)  # the last rounds' seconds (drafting and verify pass)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()  # hold a slot, in admission order (see _prefill_step)
        self.running: list[Sequence] = []
        self._copying: dict[int, PendingCopy] = {}  # slot -> its prompt's blocks the cache's writer still copies
        self.eos_ids = set(target.args.eos_token_ids)

    def _prefill_cost(self):
        cfg = self.config
        if cfg.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, not {cfg.prefill_chunk}")
        if cfg.prefill_layers is not None:
            if cfg.prefill_layers < 1:
                raise ValueError(f"prefill_layers must be >= 1, not {cfg.prefill_layers}")
            return None
        if cfg.prefill_step_s is not None and cfg.prefill_step_s <= 0:
            raise ValueError(f"prefill_step_s must be > 0, not {cfg.prefill_step_s}")
        return measured_prefill_cost(self.target, self.cache, cfg.prefill_chunk)

    def prefill_layers(self, staged: StagedPrefill) -> int:
        """Layers of `staged` a step runs while sequences decode: the configured number, or those that take
        `prefill_step_s` (unset: PREFILL_STEP_ROUNDS of a round lately, `round_s`) at the time its layers took so far
        (before any ran: the measured `PrefillCost` of its chunks), at least one."""
        if self.prefill_cost is None:
            return self.config.prefill_layers
        budget = self.config.prefill_step_s
        if budget is None:
            budget = PREFILL_STEP_ROUNDS * self.round_s
        fwd = staged.forward
        if fwd.layers_run:
            per_layer = staged.seconds / fwd.layers_run
        else:
            per_layer = self.prefill_cost.seconds([(start, take) for _, start, take in staged.picks]) / fwd.n_layers
        return max(1, int(budget / max(per_layer, 1e-9)))

    @property
    def round_s(self) -> float:
        """A round's seconds lately: the median of the last few (one slow round, such as a drafter's first with its
        set-up, does not buy the next step a long prefill); 0 before any."""
        return statistics.median_high(self.round_times) if self.round_times else 0.0

    @property
    def drafter(self) -> Drafter:
        """The default method's drafter."""
        return self.drafters[self.default_method]

    @property
    def controller(self) -> Controller | None:
        """The default method's speculation controller (None: plain decoding, or sizing off)."""
        return self.controllers[self.default_method]

    @property
    def methods(self) -> list[str]:
        return list(self.drafters)

    def _drafter(self, seq: Sequence) -> Drafter:
        return self.drafters[seq.method]

    # --- requests ---------------------------------------------------------------------------
    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, seq_id: str | None = None, method: str | None = None
    ) -> Sequence:
        method = self.default_method if method is None else method
        check_method(method, list(self.drafters))
        check_prompt_ids(prompt_ids, self.target.args.vocab_size, self.capacity)
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this engine has none")
        seq = Sequence(list(prompt_ids), params, seq_id)
        seq.method = method
        if self.tokenizer is not None:
            seq.text_stream = TextStream(self.tokenizer, params.stop)
        self.waiting.append(seq)
        return seq

    def abort(self, seq_id: str) -> bool:
        for seq in list(self.waiting):
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                seq.finish("abort")
                return True
        for seq in list(self.prefilling):
            if seq.seq_id == seq_id:
                self.prefilling.remove(seq)
                if self.staged and any(s is seq for s, _, _ in self.staged.picks):
                    self.staged = None  # its chunks' K/V were not committed: the others' are computed again
                seq.finish("abort")
                self._drafter(seq).release(seq)  # what it kept of the chunks' hidden states
                self.cache.release(seq.slot)
                return True
        for seq in self.running:
            if seq.seq_id == seq_id:
                seq.finish("abort")
                self._retire(seq)
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # --- the loop -----------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Admit waiting requests to free slots, prefill at most the step's budget of their prompt tokens, then one
        speculative round over the running batch (with the prompts whose prefill completed); one event per sequence
        that advanced."""
        self._admit()
        events = {ev.seq.seq_id: ev for ev in self._prefill_step()}
        batch = [s for s in self.running if not s.finished]
        if batch:
            for ev in self._spec_round(batch):
                first = events.get(ev.seq.seq_id)
                events[ev.seq.seq_id] = first.then(ev) if first else ev
        for seq in [s for s in self.running if s.finished]:
            self._retire(seq)
        return list(events.values())

    def _admit(self) -> None:
        """Waiting requests take free slots in arrival order, each starting from the longest prefix it can get: a
        prompt held in another slot (`_live_prefix`: copied there, or a released slot taken as it is), else the
        context cache's (loaded once). A prompt that shares at least half its loadable prefix with a prompt being
        prefilled (several questions about one document arriving together), or whose prefix blocks the context
        cache is still writing and no slot holds, waits while the engine has other work, rather than computing what
        is about to be there; with nothing else to do its lookup waits for the blocks being written."""
        deferred = []
        while self.waiting and self.cache.free_slots:
            seq = self.waiting.popleft()
            busy = bool(self.running or self.prefilling)
            in_prefill = busy and self._prefix_in_prefill(seq)
            donor, shared = (None, 0) if in_prefill else self._live_prefix(seq)
            if busy and not shared and (in_prefill or self._prefix_being_written(seq)):
                deferred.append(seq)
                continue
            seq.stats.t_admit = time.perf_counter()
            if shared and donor in self.cache.kept:  # a released slot that still holds the prefix: taken as it is
                seq.slot = self.cache.allocate(donor)
                self.cache.lengths[seq.slot] = shared
            else:
                seq.slot = self.cache.allocate()
                if shared:
                    self.cache.copy_prefix(donor, seq.slot, shared)
            if shared:
                seq.stats.cached_prefix_tokens = seq.stats.live_prefix_tokens = shared
            else:
                seq.stats.cached_prefix_tokens = self._load_cached_prefix(seq)
            self.prefilling.append(seq)
        self.waiting.extendleft(reversed(deferred))

    def _live_prefix(self, seq: Sequence) -> tuple[int | None, int]:
        """The slot holding the longest committed prefix of `seq`'s prompt, another sequence's within its own prompt
        (the K/V of generated tokens come from other forwards than a prefill's) or a released slot's (`cache.kept`),
        and how many tokens of it `seq` may take: whole prefill chunks where chunks have a fixed size (as the
        context cache loads), >= 1 token left to compute; (None, 0) where that is under half of what `seq` could
        take. A drafter that reads the prompt's hidden states takes none (`_reads_cache`)."""
        if not self._reads_cache(seq):
            return None, 0
        grain = 1 if self.any_chunk else self.prefill_chunk
        most = (seq.num_tokens - 1) // grain * grain
        held = itertools.chain(  # lazily: the first slot holding all `most` tokens ends the search
            (
                (o.slot, min(o.num_prompt, self.cache.lengths[o.slot]), o.tokens)
                for o in (*self.running, *self.prefilling)
            ),
            ((slot, len(tokens), tokens) for slot, tokens in self.cache.kept.items()),
        )
        donor, best = None, 0
        for slot, length, tokens in held:
            n = min(most, length)
            if n <= best:
                continue
            same = int((seq.tokens[:n] == tokens[:n]).cumprod(0).sum()) // grain * grain
            if same > best:
                donor, best = slot, same
                if best == most:
                    break
        return (donor, best) if best and 2 * best >= most else (None, 0)

    def _prefix_being_written(self, seq: Sequence) -> bool:
        cc = self.context_cache
        return cc is not None and self._reads_cache(seq) and cc.writing(seq.tokens, self._loadable(seq, cc))

    def _prefix_in_prefill(self, seq: Sequence) -> bool:
        """Whether a prompt being prefilled starts with at least half of the whole chunks `seq` could load from the
        context cache: that prompt stores them when its prefill completes."""
        cc = self.context_cache
        if cc is None or not self.prefilling or not self._reads_cache(seq):
            return False
        loadable = self._loadable(seq, cc)
        if loadable == 0:
            return False
        grain = self._cache_grain(cc)
        for other in self.prefilling:
            n = min(loadable, other.num_tokens // cc.block_size * cc.block_size)
            same = int((seq.tokens[:n] == other.tokens[:n]).cumprod(0).sum()) if n else 0
            if same // grain * grain * 2 >= loadable:
                return True
        return False

    def _prefill_step(self) -> list[Event]:
        """Prefill the admitted prompts: while sequences decode, the layers of one forward of up to a chunk's tokens
        that take about `prefill_step_s` (`prefill_layers`; the forward goes on in the next steps), else whole
        forwards of up to 4 chunks' tokens in all (`_pick_chunks`). Each prompt whose prefill completes picks its
        first token and joins the running batch."""
        budget = self.prefill_chunk if self.running else 4 * self.prefill_chunk  # the tokens of forwards it starts
        done: list[tuple[Sequence, torch.Tensor]] = []
        while True:
            if self.staged is None:
                if not (picks := self._pick_chunks(budget)):
                    break
                budget -= sum(take for _, _, take in picks)
                segs = [
                    Segment(seq.slot, start, seq.tokens[start : start + take].clone(),
                            torch.arange(start, start + take), None, "last")
                    for seq, start, take in picks
                ]  # fmt: skip
                self.target.capture_layers = self._capture
                self.staged = StagedPrefill(picks, self.target.staged(segs, self.cache))
            staged = self.staged
            t0 = time.perf_counter()
            try:
                logits = staged.forward.run(self.prefill_layers(staged) if self.running else None)
            except BaseException:
                self.staged = None  # a forward that failed midway is not resumed
                raise
            synchronize(self.target.device)
            staged.seconds += time.perf_counter() - t0
            if logits is None:
                break  # the step's layers are spent: the forward goes on in the next step
            self.staged = None
            done += self._commit_prefill(staged, logits)
            if self.running:
                break
        events = []
        for seq, last in done:
            self._store_prefix(seq)
            seq.stats.prefill_tokens = seq.num_tokens
            self.running.append(seq)
            new = self._append(seq, [self._choose(last, seq)])
            if not seq.finished:
                self._drafter(seq).start(seq)
            events.append(Event(seq, new, self._release(seq)))
            # The first token leaves with this event, after the drafter's own set-up (e.g. a draft model's prompt
            # prefill): that set-up is prompt processing, so it counts in the time to first token, not in decoding.
            now = time.perf_counter()
            seq.stats.prefill_time = now - seq.stats.t_admit
            seq.stats.t_first_token = now
            if seq.finished:  # it ended at its first token
                seq.stats.t_end = now
        return events

    def _pick_chunks(self, budget: int) -> list[tuple[Sequence, int, int]]:
        """The chunks (prompt, start, tokens) of the next prefill forward, at most `budget` tokens. Each goes to the
        prompt with the least work left less its credit, the tokens prefilled for other prompts since it was
        admitted (ties: the earlier admitted): a short prompt is not held up behind a long one, prompts admitted
        together finish one after another rather than all at the end, and a long prompt passed over by shorter ones
        gains credit until it goes first, so none starves. With fixed chunks a forward is one chunk; where chunks
        may have any size (`any_chunk`) a prompt takes what is left of the budget and several short prompts share
        the forward, as a row's bits do not depend on its call."""
        picks: list[tuple[Sequence, int, int]] = []
        # Each pick credits every other prompt alike, so the order of those left stays as sorted here.
        for seq in sorted(self.prefilling, key=lambda s: s.num_tokens - self.cache.lengths[s.slot] - s.prefill_credit):
            start = self.cache.lengths[seq.slot]
            left = seq.num_tokens - start
            take = min(left, budget) if self.any_chunk else min(left, self.prefill_chunk)
            if take > budget or take < min(left, self.prefill_unit):
                break
            budget -= take
            picks.append((seq, start, take))
            if not self.any_chunk:
                break
        total = sum(take for _, _, take in picks)
        for seq in self.prefilling:
            seq.prefill_credit += total
        for seq, _, take in picks:
            seq.prefill_credit -= take
        return picks

    def _commit_prefill(self, staged: StagedPrefill, logits) -> list[tuple[Sequence, torch.Tensor]]:
        """Commit a completed prefill forward's chunks; returns the prompts it completed with their last row's
        logits, and leaves them out of `prefilling`."""
        done = []
        for j, (seq, start, take) in enumerate(staged.picks):
            self._hidden(seq, start, j, list(range(take)))
            self.cache.commit(seq.slot, start, list(range(take)))
            if self.cache.lengths[seq.slot] == seq.num_tokens:
                self.prefilling.remove(seq)
                done.append((seq, logits[j][-1]))
        share = staged.seconds / sum(take for _, _, take in staged.picks)
        for seq, _, take in staged.picks:
            seq.stats.prefill_compute_time += share * take
        return done

    def _load_cached_prefix(self, seq: Sequence) -> int:
        """Fill the slot from the context cache's longest cached prefix of whole prefill chunks (leaving >= 1 token
        to compute).

        The cache holds K/V only. A drafter that reads the target's hidden states of the prompt (DFlash, TokenSwift:
        `traits.hidden_layers`) would see none for a cached part, and so draft from a shorter context on a hit than
        on a miss; its requests prefill the whole prompt instead (they still store it for the other methods). One
        that keeps only the last token's (LongSpec: `traits.newest_hidden_only`) gets it from the computed tail."""
        cc = self.context_cache
        if cc is None or not self._reads_cache(seq):
            return 0
        # With fixed chunks, whole prefill chunks only: the rest is then computed in the chunks plain decoding
        # computes (a library's prefill matmuls give a row bits that depend on the chunk's row count).
        blocks = cc.lookup(seq.tokens, max_tokens=self._loadable(seq, cc))
        grain = self._cache_grain(cc) // cc.block_size  # blocks per grain
        return load_blocks_into_cache(self.cache, seq.slot, blocks[: len(blocks) // grain * grain], cc.block_size)

    def _cache_grain(self, cc: ContextCache) -> int:
        """Tokens a cache hit loads in: whole blocks, and whole prefill chunks where chunks have a fixed size."""
        return cc.block_size if self.any_chunk else math.lcm(cc.block_size, self.prefill_chunk)

    def _loadable(self, seq: Sequence, cc: ContextCache) -> int:
        """The most prompt tokens a cache hit may fill: whole grains (`_cache_grain`), >= 1 token left."""
        grain = self._cache_grain(cc)
        return (seq.num_tokens - 1) // grain * grain

    def _reads_cache(self, seq: Sequence) -> bool:
        traits = self._drafter(seq).traits
        return not (traits.hidden_layers and not traits.newest_hidden_only)

    def _store_prefix(self, seq: Sequence) -> None:
        """Hand the prompt's new full blocks to the context cache's writer as views of the slot: the prompt's K/V
        stay as they are while it decodes (new tokens go after them), and the writer copies each block straight
        into its value; `_retire` copies those it has not reached yet before the slot is reused. (A copy of them
        all here, in the engine loop, costs ~0.2 s per 5K-token fp32 prompt, mostly the fresh memory's page
        faults.)"""
        cc = self.context_cache
        if cc is None:
            return
        # the blocks not loaded from the cache: a prefix taken from a slot is another use of its blocks (with
        # `min_uses` 2, how a prefix that comes back gets stored), and the writer skips those stored already
        first = (seq.stats.cached_prefix_tokens - seq.stats.live_prefix_tokens) // cc.block_size
        last = seq.num_tokens // cc.block_size
        if last > first:
            blocks = kv_blocks_from_cache(self.cache, seq.slot, first, last, cc.block_size)
            if pending := cc.store(seq.tokens.clone(), blocks):
                self._copying[seq.slot] = pending

    def _choose(self, logits: torch.Tensor, seq: Sequence) -> int:
        rows = process_in_context(logits.unsqueeze(0), seq.params, seq.tokens)
        return int(rows[0].argmax()) if seq.params.greedy else sample(rows[0], seq.generator)

    def _spec_round(self, batch: list[Sequence]) -> list[Event]:
        t0 = time.perf_counter()
        proposed: dict[int, DraftTree] = {}
        for method, group in self._by_method(batch).items():
            ctl = self.controllers[method]
            wants = {id(s): DraftRequest() if ctl is None else ctl.wants_draft(s, len(batch)) for s in group}
            drafting = [s for s in group if wants[id(s)] is not None]
            if not drafting:
                continue
            t = time.perf_counter()
            drafted = self.drafters[method].propose(drafting, [wants[id(s)] for s in drafting])
            proposed.update(zip(map(id, drafting), drafted, strict=True))
            if ctl is not None:
                synchronize(self.target.device)  # a drafter's GPU kernels may still be running: time them too
                share = (time.perf_counter() - t) / len(drafting)
                for seq in drafting:
                    # A sequence's first drafting step also pays one-off costs (its drafter state's buffers,
                    # kernels set up for new shapes, lazily built matrices): counted, they read as the cost of every
                    # step and kept the controller on plain decoding until probes had decayed them (~30 steps for
                    # DeLS).
                    if seq.drafted_before:
                        ctl.note_draft_time(seq, share, proposed[id(seq)].max_depth)
                    seq.drafted_before = True
        trees = size_batch([(seq, proposed.get(id(seq)), self.controllers[seq.method]) for seq in batch])
        t1 = time.perf_counter()
        segments = []
        for seq, tree in zip(batch, trees, strict=True):
            room = self.capacity - seq.committed
            if len(tree) > room:
                tree = DraftTree(tree.tokens[:room], tree.parents[:room])
            segments.append(Segment(seq.slot, seq.committed, tree.tokens, tree.positions(seq.committed), tree.mask()))
        logits = self._forward(segments)
        events = []
        for j, (seq, seg, tree, lg) in enumerate(zip(batch, segments, trees, logits, strict=True)):
            if len(seg.tokens) < len(tree):
                tree = DraftTree(seg.tokens, tree.parents[: len(seg.tokens)])
            result = accept(tree, lg, seq.tokens, seq.params, seq.generator)
            if (ctl := self.controllers[seq.method]) is not None:
                ctl.observe(seq, tree, result)
            start = seq.committed
            self._hidden(seq, start, j, result.path)
            self.cache.commit(seq.slot, start, result.path)
            new = self._append(seq, result.tokens)
            accepted = result.num_drafted_accepted
            seq.stats.record_step(tree.max_depth, len(tree), accepted, len(new), len(batch))
            if not seq.finished:
                if seq.committed + 1 >= self.capacity:
                    seq.finish("length")
                else:
                    self._drafter(seq).commit(seq, result)
            events.append(Event(seq, new, self._release(seq), len(tree) - 1, accepted, len(batch)))
        t2 = time.perf_counter()
        for seq in batch:
            seq.stats.draft_time += t1 - t0
            seq.stats.verify_time += t2 - t1
        self.round_times.append(t2 - t0)
        return events

    @staticmethod
    def _by_method(batch: list[Sequence]) -> dict[str, list[Sequence]]:
        groups: dict[str, list[Sequence]] = {}
        for seq in batch:
            groups.setdefault(seq.method, []).append(seq)
        return groups

    def _forward(self, segments: list[Segment]) -> list[torch.Tensor | None]:
        self.target.capture_layers = self._capture
        return self.target(segments, self.cache)

    def _hidden(self, seq: Sequence, start: int, index: int, kept: list[int]) -> None:
        """Hand the drafter the target's hidden states of the tokens just committed (if it reads them)."""
        drafter = self._drafter(seq)
        if drafter.traits.hidden_layers:
            drafter.observe_hidden(seq, start, self.target.captured[index], kept)

    def _append(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Append accepted tokens up to the one where plain decoding ends the output: EOS, the max_new_tokens-th
        token, or the first token whose text makes the output contain a stop string. Tokens after it are dropped:
        never part of the output, streamed or counted (the KV committed for them does not matter: the sequence is
        done)."""
        stream = seq.text_stream
        watch = bool(seq.params.stop)  # (add_request made sure there is a stream to watch)
        added = []
        for tok in tokens:
            seq.append(tok)
            added.append(tok)
            if (watch and stream.add([tok])) or (tok in self.eos_ids and not seq.params.ignore_eos):
                seq.finish("stop")
                break
            if seq.num_generated >= seq.params.max_new_tokens:
                seq.finish("length")
                break
        if stream is not None and not watch:
            stream.add(added)
        return added

    @staticmethod
    def _release(seq: Sequence) -> str:
        """The output text that clients may see now (all of it, cut at the stop, once the sequence is done)."""
        return seq.text_stream.release(final=seq.finished) if seq.text_stream is not None else ""

    def _retire(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self._drafter(seq).release(seq)
            if pending := self._copying.pop(seq.slot, None):  # blocks of the slot the cache's writer has not copied
                pending.release()
            kept = min(seq.num_prompt, self.cache.lengths[seq.slot])  # the prompt's K/V, for a prompt starting alike
            self.cache.release(seq.slot, keep=seq.tokens[:kept].clone())

    # --- conveniences ---------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams, method: str | None = None) -> Iterator[Event]:
        """Stream the events of one request (other queued requests advance too)."""
        seq = self.add_request(prompt_ids, params, method=method)
        while not seq.finished:
            for ev in self.step():
                if ev.seq is seq:
                    yield ev

    def run(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        method: str | list[str] | None = None,
    ) -> list[Sequence]:
        """Run several requests to completion as one continuous batch (`method`: one for all, or one each)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        mlist = method if isinstance(method, list) else [method] * len(prompts)
        seqs = [self.add_request(p, sp, method=m) for p, sp, m in zip(prompts, plist, mlist, strict=True)]
        while self.has_work:
            self.step()
        return seqs

    def decode(self, ids: list[int]) -> str:
        """Token ids -> user-facing text: special tokens (EOS such as `<|im_end|>`, chat markers) are never shown."""
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def text(self, seq: Sequence) -> str:
        """Decoded output without special tokens, cut at the first stop string (what every output path shows:
        the CLI, and the verifier's streamed deltas and final text)."""
        text = self.decode(seq.output_ids)
        cuts = [text.find(s) for s in seq.params.stop if s in text]
        return text[: min(cuts)] if cuts else text


def plain_generate(model: Transformer, prompt_ids: list[int], params: SamplingParams, tokenizer=None) -> list[int]:
    """Reference plain decoding: prefill, then one token per forward, up to EOS, max_new_tokens, or the first
    token whose text makes the output contain a stop string (which needs `tokenizer`; the whole output is decoded
    at every token, as that reads). The oracle the tests compare with."""
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    cache = model.new_cache(len(prompt_ids) + params.max_new_tokens + 1, 1)
    slot = cache.allocate()
    seq = Sequence(list(prompt_ids), params)
    logits = model.prefill(cache, slot, seq.tokens.clone())
    eos = set(model.args.eos_token_ids)
    while True:
        rows = process_in_context(logits.unsqueeze(0), params, seq.tokens)
        tok = int(rows[0].argmax()) if params.greedy else sample(rows[0], seq.generator)
        seq.append(tok)
        if seq.num_generated >= params.max_new_tokens or (tok in eos and not params.ignore_eos):
            return seq.output_ids
        if params.stop:
            text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            if any(s in text for s in params.stop):
                return seq.output_ids
        start = cache.lengths[slot]
        seg = Segment(slot, start, torch.tensor([tok]), torch.tensor([start]), None, "all")
        logits = model([seg], cache)[0][0]
        cache.commit(slot, start, [0])


__all__ = ["Accepted", "EngineConfig", "Event", "RequestError", "SpecEngine", "plain_generate"]
