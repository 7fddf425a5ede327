"""Drafters, one file per family, all behind `Drafter` (base.py), and the method registry.

A method is a drafter family and its options (`Method`): `longspec` with `mode="beam"` or `span=True`, `dflash` with
`dels=True` and `span=True`, `composite` of parts... `METHODS` names the served ones (`longspec-span`,
`dflash-dels-span`, ...). `build_drafter`, the CLI's `--method`, the verifier config's `methods` and the README's
methods table (`methods_table`) all come from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spyglass.drafters.base import Drafter, NullDrafter, load_once
from spyglass.drafters.composite import CompositeDrafter
from spyglass.drafters.dflash import build_dflash_drafter
from spyglass.drafters.longspec import LongSpecDrafter, load_longspec_draft, shipped_draft
from spyglass.drafters.ngram import NgramDrafter
from spyglass.drafters.small_lm import SmallLMDrafter, load_draft_model
from spyglass.drafters.streaming import StreamingDrafter
from spyglass.drafters.suffix import SuffixDrafter
from spyglass.drafters.tokenswift import build_tokenswift
from spyglass.spans import SPAN


@dataclass(frozen=True)
class Family:
    """A drafter family: what it drafts (the methods table's line), how its drafter is built
    (`build(target, method, options, max_batch=, max_context=, loaded=)`, `options` being build_drafter's), and the
    options its methods set, each with its allowed values, the first the default (None: any value, and required)."""

    summary: str
    build: Callable[..., Drafter | None]
    choices: dict[str, tuple | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    """A family and its options, every one of the family's set (`method` checks and completes them)."""

    family: str
    options: dict[str, Any]

    @property
    def name(self) -> str:
        """Its name in METHODS, or the family and its options spelled out."""
        for name, m in METHODS.items():
            if m == self:
                return name
        return f"{self.family}({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


def method(family: str, **options) -> Method:
    """The method of `family` with `options` (the others at the family's defaults); ValueError naming what is wrong."""
    if family not in FAMILIES:
        raise ValueError(f"unknown drafter family {family!r}; available: {', '.join(FAMILIES)}")
    choices = FAMILIES[family].choices
    if unknown := sorted(set(options) - set(choices)):
        raise ValueError(f"{family} has no option {', '.join(unknown)}; its options: {', '.join(choices) or 'none'}")
    for key, allowed in choices.items():
        if key not in options and allowed is None:
            raise ValueError(f"{family} needs option {key}")
        value = options.setdefault(key, allowed[0] if allowed else None)
        if allowed is not None and value not in allowed:
            raise ValueError(f"{family} option {key}={value!r}: choose from {', '.join(map(repr, allowed))}")
    return Method(family, {k: options[k] for k in choices})


# --------------------------------------------------------------------------- the families' builders


def _ar(target, m: Method, options: dict, **build) -> None:
    return None


def _ngram(target, m: Method, options: dict, **build) -> Drafter:
    keys = ("n_min", "n_max", "draft_len", "max_candidates")
    return NgramDrafter(**{k: options[k] for k in keys if options.get(k) is not None})


def _suffix(target, m: Method, options: dict, **build) -> Drafter:
    # suffix_global=False: no replica-wide index of earlier outputs (each request drafts from its own text only)
    return SuffixDrafter(use_global=bool(options.get("suffix_global", True)))


def _small_lm(target, m: Method, options: dict, max_batch: int, max_context: int, **build) -> Drafter:
    draft = load_draft_model(target, options.get("draft_model"), options.get("draft_layers"))
    gamma = options.get("gamma") or 4
    return SmallLMDrafter(draft, gamma=gamma, max_batch=max_batch, max_context=max_context)


def _composite(target, m: Method, options: dict, **build) -> Drafter:
    """Suffix + a learned drafter's candidates in one tree; the parts share `loaded`."""
    build["token_matched"] = True  # the merged tree is verified by token matching
    parts = [build_drafter(part, target, **build, **options) for part in m.options["parts"]]
    return CompositeDrafter(parts, name=m.name)


def _longspec(
    target, m: Method, options: dict, loaded: dict | None = None, token_matched: bool = False, **build
) -> Drafter:
    checkpoint = options.get("draft_checkpoint")
    if checkpoint is None:  # the draft of its family that ships for this model
        checkpoint = shipped_draft(target, m.family)
    draft = load_once(loaded, "longspec", checkpoint, lambda path: load_longspec_draft(path, target))
    span = SPAN if m.options.get("span") else 0  # a chain whose copied tokens bring their context's continuation
    gamma = options.get("gamma") or 5
    return LongSpecDrafter(draft, gamma=gamma, mode=m.options["mode"], span=span, token_matched=token_matched)


def _dflash(
    target, m: Method, options: dict, loaded: dict | None = None, token_matched: bool = False, **build
) -> Drafter:
    return build_dflash_drafter(
        target,
        options.get("draft_checkpoint"),
        options.get("dels_checkpoint"),
        dels=m.options["dels"],
        block_size=options.get("block_size"),
        alpha=options.get("alpha"),
        beta=options.get("beta"),
        span=SPAN if m.options["span"] else None,  # a copied token brings its context's continuation
        loaded=loaded,
        token_matched=token_matched,
    )


def _tokenswift(target, m: Method, options: dict, **build) -> Drafter:
    keys = ("ngram_k", "sinks", "policy", "draft_pass")
    extra = {k: options[k] for k in keys if options.get(k) is not None}
    return build_tokenswift(target, options.get("draft_checkpoint"), budget=options.get("partial_budget"), **extra)


def _streaming(target, m: Method, options: dict, **build) -> Drafter:
    return StreamingDrafter(budget=options.get("partial_budget"), gamma=options.get("gamma") or 4)


FAMILIES = {
    "ar": Family("plain decoding through the same engine, no drafter", _ar),
    "ngram": Family("earlier occurrences of the last n-gram in prompt and output (several form a small tree)", _ngram),
    "suffix": Family(
        "suffix automata over the request and earlier requests' outputs grow a scored tree (the default)", _suffix
    ),
    "small-lm": Family(
        "a chain from a separate draft model with the same tokenizer (`--draft-model`, or `--draft-layers N`)",
        _small_lm,
    ),
    "longspec": Family(
        "the trained LongSpec draft, reading the target's KV cache in place: a chain, a dynamic beam or a chain with "
        "CAPE's extra candidates; `span`: a copied token brings what followed its source in the context",
        _longspec,
        {"mode": ("chain", "beam", "cape"), "span": (False, True)},
    ),
    "glide": Family(
        "the trained GLIDE draft (LongSpec's with two layers, each reading its own target layer): a chain or with "
        "CAPE's extra candidates",
        _longspec,
        {"mode": ("chain", "cape")},
    ),
    "composite": Family(
        "its parts' trees merged into one (the learned part drafts only where the suffix lookup is unsure)",
        _composite,
        {"parts": None},
    ),
    "dflash": Family(
        "the trained DFlash block draft; `dels`: fused with the DeLS-Spec local head; `span`: a copied token brings "
        "what followed its source in the context",
        _dflash,
        {"dels": (False, True), "span": (False, True)},
    ),
    "tokenswift": Family("TokenSwift's residual heads over a partial KV cache, with n-gram reuse", _tokenswift),
    "streaming": Family("self-speculation over attention sinks and a recent window (StreamingLLM)", _streaming),
}

# The served methods by name, in the order the CLI and the methods table list them.
METHODS: dict[str, Method] = {
    "ar": method("ar"),
    "ngram": method("ngram"),
    "suffix": method("suffix"),
    "small-lm": method("small-lm"),
    "longspec": method("longspec"),
    "longspec-beam": method("longspec", mode="beam"),
    "longspec-cape": method("longspec", mode="cape"),
    "longspec-span": method("longspec", span=True),
    "glide": method("glide"),
    "glide-cape": method("glide", mode="cape"),
    # a composite's parts, the model-free one first (the learned one drafts only where it is unsure)
    "composite": method("composite", parts=("suffix", "longspec")),
    "composite-span": method("composite", parts=("suffix", "longspec-span")),
    "composite-dflash": method("composite", parts=("suffix", "dflash-dels")),
    "dflash": method("dflash"),
    "dflash-dels": method("dflash", dels=True),
    "dflash-span": method("dflash", span=True),
    "dflash-dels-span": method("dflash", dels=True, span=True),
    "tokenswift": method("tokenswift"),
    "streaming": method("streaming"),
}


def resolve_method(name: str) -> Method:
    """The method served as `name`; ValueError listing the names otherwise."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name]


def build_drafter(
    method: str | Method,
    target,
    *,
    max_batch: int = 4,
    max_context: int = 8192,
    loaded: dict | None = None,
    token_matched: bool = False,
    **options,
) -> Drafter | None:
    """The drafter for `method`, a name in METHODS or a `Method` ("ar" = plain decoding, no drafter). Unknown names
    raise ValueError. `options`: the drafters' settings (checkpoints, gamma, ...), each read by the families it
    concerns. `loaded`: a memo shared by the drafters of one replica (one dict for all its build_drafter calls), so
    methods that use the same draft checkpoint (the longspec variants and the composites built on them, the dflash
    variants) load it once and share its weights; None loads afresh. `token_matched`: a learned chain drafts its
    argmax under sampling (a composite's part: its merged tree is verified by token matching)."""
    m = resolve_method(method) if isinstance(method, str) else method
    build = FAMILIES[m.family].build
    return build(
        target, m, options, max_batch=max_batch, max_context=max_context, loaded=loaded, token_matched=token_matched
    )


def _spelled(m: Method) -> str:
    """A method's options that differ from its family's defaults, as the methods table shows them."""
    choices = FAMILIES[m.family].choices
    shown = []
    for key, value in m.options.items():
        if key == "parts":
            shown.append(" + ".join(f"`{p}`" for p in value))
        elif value is True:
            shown.append(key)
        elif value != choices[key][0]:
            shown.append(f"{key}={value}")
    return ", ".join(shown)


def methods_table() -> str:
    """The README's methods table (markdown): per family, its methods (with the options each sets) and what it
    drafts."""
    rows = ["| family | methods | what it drafts |", "|---|---|---|"]
    for family, fam in FAMILIES.items():
        names = []
        for name, m in METHODS.items():
            if m.family == family:
                spelled = _spelled(m)
                names.append(f"`{name}`" + (f" ({spelled})" if spelled else ""))
        rows.append(f"| `{family}` | {', '.join(names)} | {fam.summary} |")
    return "\n".join(rows) + "\n"


__all__ = [
    "FAMILIES",
    "METHODS",
    "Drafter",
    "Family",
    "Method",
    "NullDrafter",
    "build_drafter",
    "method",
    "methods_table",
    "resolve_method",
]
