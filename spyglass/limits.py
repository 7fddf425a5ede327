"""Request limits and sampling rules, each written once with its message.

Three places check a request: the gateway (services/gateway.py, before anything is tokenized, queued or
allocated), `SamplingParams` (every engine request) and `SpecEngine.add_request` (the prompt's token ids). They
all call these functions, so a bad value gets the same message whichever path it takes. `RequestError` is a
`ValueError`. Imports nothing heavy: the gateway loads it without torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class RequestError(ValueError):
    """A request that cannot be served as given (the message says why)."""


# Request limits. The gateway's config may set its own prompt, id and timeout limits (GatewayConfig); stop strings
# are limited here only, since every engine checks them too.
MAX_PROMPT_CHARS = 1 << 20  # prompt text (the context limit is checked on tokens)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string
MAX_ID_CHARS = 128  # request_id and context_id
MAX_TIMEOUT_S = 3600.0
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Rule:
    """One sampling field: the values it allows (`ok`, described by `expect`); floats must also be finite."""

    name: str
    ok: Callable[[Any], bool]
    expect: str
    finite: bool = False

    def check(self, value: Any) -> None:
        if self.finite and not math.isfinite(value):
            raise RequestError(f"{self.name} must be a finite number, got {value}")
        if not self.ok(value):
            raise RequestError(f"{self.name} must be {self.expect}, got {value}")


SAMPLING_RULES: dict[str, Rule] = {
    r.name: r
    for r in (
        Rule("temperature", lambda v: v >= 0, ">= 0 (0 = greedy)", finite=True),
        Rule("top_k", lambda v: v >= 0, ">= 0 (0 = off)"),
        Rule("top_p", lambda v: 0 < v <= 1, "in (0, 1]", finite=True),
        Rule("min_p", lambda v: 0 <= v < 1, "in [0, 1)", finite=True),
        Rule("repetition_penalty", lambda v: v > 0, "> 0", finite=True),
        Rule("contextual_penalty", lambda v: v >= 1, ">= 1 (1 = off)", finite=True),
        Rule("penalty_window", lambda v: v > 0, "> 0 tokens"),
        Rule("seed", lambda v: 0 <= v < 2**63, "in [0, 2**63)"),
    )
}


def check_sampling(values: Mapping[str, Any]) -> None:
    """Every sampling field given in `values` (None = unset) against its rule."""
    for name, rule in SAMPLING_RULES.items():
        if values.get(name) is not None:
            rule.check(values[name])


def check_max_new_tokens(n: int, limit: int | None = None, name: str = "max_new_tokens") -> None:
    """At least one new token, and at most the server's `limit` when one applies."""
    if not n > 0:
        raise RequestError(f"{name} must be > 0, got {n}")
    if limit is not None and n > limit:
        raise RequestError(f"{name} must be <= {limit}, got {n}")


def check_stop(stop: Sequence[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
            raise RequestError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters")


def check_prompt_text(text: str, limit: int = MAX_PROMPT_CHARS) -> None:
    if len(text) > limit:
        raise RequestError(f"the prompt has {len(text)} characters; the limit is {limit}")
    if not text.strip():
        raise RequestError("the prompt is empty")


def check_prompt_ids(ids: Sequence[int], vocab: int, context: int) -> None:
    """Token ids in the vocabulary, at least one, and room in the context for one new token."""
    if len(ids) == 0:
        raise RequestError("the prompt is empty")
    if len(ids) >= context:
        raise RequestError(
            f"the prompt has {len(ids)} tokens but the context holds {context}: shorten it or raise max_context"
        )
    if not 0 <= min(ids) <= max(ids) < vocab:
        raise RequestError(f"prompt token ids must be in [0, {vocab})")


def check_messages(messages: Iterable[Mapping[str, Any]], limit: int = MAX_PROMPT_CHARS) -> None:
    """Chat messages: at least one, each a known role with text content; their text within the prompt limit."""
    messages = list(messages)
    if not messages:
        raise RequestError("messages must hold at least one message")
    chars = 0
    for m in messages:
        if m.get("role") not in CHAT_ROLES:
            raise RequestError(f"a message's role must be one of {', '.join(CHAT_ROLES)}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise RequestError("a message's content must be text")
        chars += len(m["content"])
    if chars > limit:
        raise RequestError(f"the prompt has {chars} characters; the limit is {limit}")


def check_method(method: str, served: Sequence[str]) -> None:
    if method not in served:
        raise RequestError(f"unknown method {method!r}; available: {', '.join(served)}")


def check_id(name: str, value: str, limit: int = MAX_ID_CHARS, required: bool = False) -> None:
    if len(value) > limit or (required and not value):
        raise RequestError(f"{name} must have {'1 to' if required else 'at most'} {limit} characters")


def check_timeout(seconds: float, limit: float = MAX_TIMEOUT_S) -> None:
    if not 0 <= seconds <= limit:  # also NaN
        raise RequestError(f"timeout_s must be in [0, {limit:g}], got {seconds}")


def check_stream_interval(seconds: Any, limit: float = MAX_TIMEOUT_S) -> None:
    """The most often a stream sends its new tokens: a number of seconds in [0, limit] (0: every step's)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= limit:  # also NaN
        raise RequestError(f"stream_interval_s must be a number of seconds in [0, {limit:g}], got {seconds!r}")


__all__ = [
    "CHAT_ROLES",
    "MAX_ID_CHARS",
    "MAX_PROMPT_CHARS",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_TIMEOUT_S",
    "SAMPLING_RULES",
    "RequestError",
    "Rule",
    "check_id",
    "check_max_new_tokens",
    "check_method",
    "check_messages",
    "check_prompt_ids",
    "check_prompt_text",
    "check_sampling",
    "check_stop",
    "check_stream_interval",
    "check_timeout",
]
