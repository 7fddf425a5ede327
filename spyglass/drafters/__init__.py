"""Drafters, one file per method, all behind `Drafter` (base.py). `build_drafter` maps CLI names."""

from __future__ import annotations

from spyglass.drafters.base import Drafter, NullDrafter

METHODS = (
    "ar",
    "ngram",
    "suffix",
    "small-lm",
    "longspec",
    "longspec-beam",
    "longspec-cape",
    "longspec-span",
    "glide",
    "glide-cape",
    "composite",
    "composite-span",
    "composite-dflash",
    "dflash",
    "dflash-dels",
    "dflash-span",
    "dflash-dels-span",
    "tokenswift",
    "streaming",
)

# A composite's parts, the model-free one first (the learned one drafts only where it is unsure).
COMPOSITES = {
    "composite": ("suffix", "longspec"),
    "composite-span": ("suffix", "longspec-span"),
    "composite-dflash": ("suffix", "dflash-dels"),
}


def build_drafter(
    method: str,
    target,
    *,
    max_batch: int = 4,
    max_context: int = 8192,
    loaded: dict | None = None,
    token_matched: bool = False,
    **options,
) -> Drafter | None:
    """The drafter for `method` ("ar" = plain decoding, no drafter). Unknown names raise ValueError. `loaded`: a
    memo shared by the drafters of one replica (one dict for all its build_drafter calls), so methods that use
    the same draft checkpoint (the longspec variants and the composites built on them, the dflash variants) load
    it once and share its weights; None loads afresh. `token_matched`: a learned chain drafts its argmax under
    sampling (a composite's part: its merged tree is verified by token matching)."""
    if method == "ar":
        return None
    if method == "ngram":
        from spyglass.drafters.ngram import NgramDrafter

        keys = ("n_min", "n_max", "draft_len", "max_candidates")
        return NgramDrafter(**{k: options[k] for k in keys if options.get(k) is not None})
    if method == "suffix":
        from spyglass.drafters.suffix import SuffixDrafter

        # suffix_global=False: no replica-wide index of earlier outputs (each request drafts from its own text only)
        return SuffixDrafter(use_global=bool(options.get("suffix_global", True)))
    if method == "small-lm":
        from spyglass.drafters.small_lm import SmallLMDrafter, load_draft_model

        draft = load_draft_model(target, options.get("draft_model"), options.get("draft_layers"))
        gamma = options.get("gamma") or 4
        return SmallLMDrafter(draft, gamma=gamma, max_batch=max_batch, max_context=max_context)
    if method in COMPOSITES:  # suffix + a learned drafter's candidates in one tree
        from spyglass.drafters.composite import CompositeDrafter

        parts = [
            build_drafter(
                m, target, max_batch=max_batch, max_context=max_context, loaded=loaded, token_matched=True, **options
            )
            for m in COMPOSITES[method]
        ]
        return CompositeDrafter(parts, name=method)
    if method in ("longspec", "longspec-beam", "longspec-cape", "longspec-span", "glide", "glide-cape"):
        from spyglass.drafters.base import load_once
        from spyglass.drafters.longspec import SHIPPED, SHIPPED_GLIDE, LongSpecDrafter, load_longspec_draft
        from spyglass.spans import SPAN

        family, _, mode = method.partition("-")
        shipped = SHIPPED if family == "longspec" else SHIPPED_GLIDE  # used when no checkpoint is given
        checkpoint = shipped if options.get("draft_checkpoint") is None else options["draft_checkpoint"]
        draft = load_once(loaded, "longspec", checkpoint, lambda path: load_longspec_draft(path, target))
        span = SPAN if mode == "span" else 0  # a chain whose copied tokens bring their context's continuation
        mode = "chain" if mode in ("", "span") else mode
        return LongSpecDrafter(
            draft, gamma=options.get("gamma") or 5, mode=mode, span=span, token_matched=token_matched
        )
    if method in ("dflash", "dflash-dels", "dflash-span", "dflash-dels-span"):
        from spyglass.drafters.dflash import build_dflash_drafter
        from spyglass.spans import SPAN

        return build_dflash_drafter(
            target,
            options.get("draft_checkpoint"),
            options.get("dels_checkpoint"),
            dels=method.startswith("dflash-dels"),
            block_size=options.get("block_size"),
            alpha=options.get("alpha"),
            beta=options.get("beta"),
            span=SPAN if method.endswith("-span") else None,  # a copied token brings its context's continuation
            loaded=loaded,
            token_matched=token_matched,
        )
    if method == "tokenswift":
        from spyglass.drafters.tokenswift import build_tokenswift

        keys = ("ngram_k", "sinks", "policy", "draft_pass")
        extra = {k: options[k] for k in keys if options.get(k) is not None}
        return build_tokenswift(target, options.get("draft_checkpoint"), budget=options.get("partial_budget"), **extra)
    if method == "streaming":
        from spyglass.drafters.streaming import StreamingDrafter

        return StreamingDrafter(budget=options.get("partial_budget"), gamma=options.get("gamma") or 4)
    raise ValueError(f"unknown method {method!r}; available: {', '.join(METHODS)}")


__all__ = ["METHODS", "Drafter", "NullDrafter", "build_drafter"]
