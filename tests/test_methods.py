"""The method registry: every method name builds the drafter it built before the registry (BEFORE below was captured
from the `if` chain the registry replaced, on the real default model, with the default options and with explicit
ones), bad names and options are refused, and the CLI and the verifier config take their names from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from spyglass.drafters import METHODS, Method, build_drafter, method, methods_table, resolve_method

# Each drafter class's settings that build_drafter chooses from the method name and the options.
KEYS = {
    "NgramDrafter": ("n_min", "n_max", "draft_len", "max_candidates"),
    "SuffixDrafter": ("global_index",),
    "SmallLMDrafter": ("gamma",),
    "LongSpecDrafter": ("draft", "gamma", "mode", "span", "span_mass"),
    "CompositeDrafter": ("parts", "confident"),
    "DFlashDrafter": ("draft", "local", "block", "alpha", "beta", "span", "span_mass"),
    "TokenSwiftDrafter": ("heads", "budget", "sinks", "policy", "ngram_k", "draft_pass"),
    "StreamingDrafter": ("budget", "sinks", "gamma", "policy"),
}

# build_drafter's options: none (every default, the shipped drafts) and explicit ones (each routed to its drafter)
OPTIONS = {
    "defaults": {"draft_layers": 2},  # small-lm has no default draft
    "explicit": dict(
        n_min=2, n_max=4, draft_len=5, max_candidates=3, suffix_global=False, draft_layers=2, gamma=3, block_size=3,
        alpha=0.5, beta=0.2, partial_budget=64, ngram_k=2, sinks=2, policy="window", draft_pass=False,
    ),
}  # fmt: skip


def describe(drafter, loaded: dict):
    """(class, name, its KEYS settings): a draft loaded through `loaded` (a replica's memo) as (kind, checkpoint
    folder), another object as its class name, a composite's parts described in turn."""
    if drafter is None:
        return None
    shared = {id(v): (kind, Path(path).name) for (kind, path), v in loaded.items()}
    settings = {}
    for key in KEYS[type(drafter).__name__]:
        value = getattr(drafter, key)
        if key == "parts":
            value = [describe(p, loaded) for p in value]
        elif id(value) in shared:
            value = shared[id(value)]
        elif not isinstance(value, (bool, int, float, str, tuple, type(None))):
            value = type(value).__name__
        settings[key] = value
    return (type(drafter).__name__, drafter.name, settings)


LONGSPEC, GLIDE = ("longspec", "smollm2-135m-longspec"), ("longspec", "smollm2-135m-glide")
DFLASH, DELS = ("dflash", "smollm2-135m-dflash"), ("dels", "smollm2-135m-dels")


def _longspec(name: str, draft: tuple, gamma: int, mode: str = "chain", span: int = 0) -> tuple:
    return ("LongSpecDrafter", name, {"draft": draft, "gamma": gamma, "mode": mode, "span": span, "span_mass": 0.1})


def _dflash(name: str, local, block: int, alpha: float, beta: float, span: int = 0) -> tuple:
    settings = {"draft": DFLASH, "local": local, "block": block, "alpha": alpha, "beta": beta}
    return ("DFlashDrafter", name, {**settings, "span": span, "span_mass": 0.0005})


def _composite(name: str, suffix: tuple, part: tuple) -> tuple:
    return ("CompositeDrafter", name, {"parts": [suffix, part], "confident": 0.25})


_SUFFIX = ("SuffixDrafter", "suffix", {"global_index": "GlobalIndex"})
_SUFFIX_LOCAL = ("SuffixDrafter", "suffix", {"global_index": None})
BEFORE = {
    "defaults": {
        "ar": None,
        "ngram": ("NgramDrafter", "ngram", {"n_min": 1, "n_max": 3, "draft_len": 12, "max_candidates": 2}),
        "suffix": _SUFFIX,
        "small-lm": ("SmallLMDrafter", "small-lm", {"gamma": 4}),
        "longspec": _longspec("longspec", LONGSPEC, 5),
        "longspec-beam": _longspec("longspec-beam", LONGSPEC, 5, mode="beam"),
        "longspec-cape": _longspec("longspec-cape", LONGSPEC, 5, mode="cape"),
        "longspec-span": _longspec("longspec-span", LONGSPEC, 5, span=16),
        "glide": _longspec("glide", GLIDE, 5),
        "glide-cape": _longspec("glide-cape", GLIDE, 5, mode="cape"),
        "composite": _composite("composite", _SUFFIX, _longspec("longspec", LONGSPEC, 5)),
        "composite-span": _composite("composite-span", _SUFFIX, _longspec("longspec-span", LONGSPEC, 5, span=16)),
        "composite-dflash": _composite("composite-dflash", _SUFFIX, _dflash("dflash-dels", DELS, 4, 0.3, 0.3)),
        "dflash": _dflash("dflash", None, 4, 0.3, 0.3),
        "dflash-dels": _dflash("dflash-dels", DELS, 4, 0.3, 0.3),
        "dflash-span": _dflash("dflash-span", None, 4, 0.3, 0.3, span=16),
        "dflash-dels-span": _dflash("dflash-dels-span", DELS, 4, 0.3, 0.3, span=16),
        "tokenswift": ("TokenSwiftDrafter", "tokenswift", {"heads": "TokenSwiftHeads", "budget": None, "sinks": 16,
                                                           "policy": "importance", "ngram_k": 20, "draft_pass": True}),
        "streaming": ("StreamingDrafter", "streaming", {"budget": None, "sinks": 4, "gamma": 4, "policy": "window"}),
    },
    "explicit": {
        "ar": None,
        "ngram": ("NgramDrafter", "ngram", {"n_min": 2, "n_max": 4, "draft_len": 5, "max_candidates": 3}),
        "suffix": _SUFFIX_LOCAL,
        "small-lm": ("SmallLMDrafter", "small-lm", {"gamma": 3}),
        "longspec": _longspec("longspec", LONGSPEC, 3),
        "longspec-beam": _longspec("longspec-beam", LONGSPEC, 3, mode="beam"),
        "longspec-cape": _longspec("longspec-cape", LONGSPEC, 3, mode="cape"),
        "longspec-span": _longspec("longspec-span", LONGSPEC, 3, span=16),
        "glide": _longspec("glide", GLIDE, 3),
        "glide-cape": _longspec("glide-cape", GLIDE, 3, mode="cape"),
        "composite": _composite("composite", _SUFFIX_LOCAL, _longspec("longspec", LONGSPEC, 3)),
        "composite-span": _composite("composite-span", _SUFFIX_LOCAL, _longspec("longspec-span", LONGSPEC, 3, span=16)),
        "composite-dflash": _composite("composite-dflash", _SUFFIX_LOCAL, _dflash("dflash-dels", DELS, 3, 0.5, 0.2)),
        "dflash": _dflash("dflash", None, 3, 0.5, 0.2),
        "dflash-dels": _dflash("dflash-dels", DELS, 3, 0.5, 0.2),
        "dflash-span": _dflash("dflash-span", None, 3, 0.5, 0.2, span=16),
        "dflash-dels-span": _dflash("dflash-dels-span", DELS, 3, 0.5, 0.2, span=16),
        "tokenswift": ("TokenSwiftDrafter", "tokenswift", {"heads": "TokenSwiftHeads", "budget": 64, "sinks": 2,
                                                           "policy": "window", "ngram_k": 2, "draft_pass": False}),
        "streaming": ("StreamingDrafter", "streaming", {"budget": 64, "sinks": 4, "gamma": 3, "policy": "window"}),
    },
}  # fmt: skip


def test_every_method_builds_the_drafter_it_built_before(smollm2):
    target, _ = smollm2
    assert list(METHODS) == list(BEFORE["defaults"])  # the same names, listed in the same order
    for label, options in OPTIONS.items():
        loaded: dict = {}  # one replica's memo: each shipped draft loads once
        for name, before in BEFORE[label].items():
            drafter = build_drafter(name, target, max_batch=2, max_context=1024, loaded=loaded, **options)
            assert describe(drafter, loaded) == before, (label, name)
            # the same drafter from the method itself (its family and options)
            again = build_drafter(METHODS[name], target, max_batch=2, max_context=1024, loaded=loaded, **options)
            assert describe(again, loaded) == before, (label, name)


def test_a_method_is_its_family_and_options_and_a_name_is_its_alias():
    assert method("dflash", span=True, dels=True) == METHODS["dflash-dels-span"]
    assert METHODS["dflash-dels-span"].options == {"dels": True, "span": True}
    assert METHODS["longspec-beam"] == Method("longspec", {"mode": "beam", "span": False})
    assert METHODS["composite-dflash"].options["parts"] == ("suffix", "dflash-dels")
    assert method("glide", mode="cape").name == "glide-cape"
    assert method("longspec", mode="cape", span=True).name == "longspec(mode='cape', span=True)"  # not served
    for m in METHODS.values():  # a composite's parts are served methods
        assert all(part in METHODS for part in m.options.get("parts", ()))


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: resolve_method("telepathy"), "unknown method 'telepathy'; available: ar, ngram, suffix, small-lm"),
        (lambda: build_drafter("dflash-tree", None), "unknown method 'dflash-tree'"),
        (lambda: method("telepathy"), "unknown drafter family 'telepathy'"),
        (lambda: method("dflash", tree=True), "dflash has no option tree; its options: dels, span"),
        (lambda: method("glide", span=True), "glide has no option span"),
        (lambda: method("suffix", span=True), "its options: none"),
        (lambda: method("longspec", mode="sideways"), "mode='sideways': choose from 'chain', 'beam', 'cape'"),
        (lambda: method("composite"), "composite needs option parts"),
    ],
)
def test_unknown_methods_families_and_options_are_refused(make, needle):
    with pytest.raises(ValueError) as e:
        make()
    assert needle in str(e.value)


def test_the_cli_and_the_verifier_config_take_the_registrys_names(capsys):
    from cli.main import build_parser, main
    from services.verifier import VerifierConfig, build_engine

    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    method_help = next(a.help for a in generate._actions if "--method" in a.option_strings)
    assert method_help.startswith(" | ".join(METHODS))
    assert main(["generate", "--prompt", "hi", "--method", "dflash-tree"]) == 2
    assert "unknown method 'dflash-tree'; available: ar, ngram" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown method 'dflash-tree' in verifier config; available: ar, ngram"):
        build_engine(VerifierConfig(methods=["suffix", "dflash-tree"]))  # refused before the model loads


def test_the_readme_shows_the_registrys_methods_table():
    """README.md holds the table `methods_table` renders (regenerate it there when a method or family changes)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert methods_table() in readme
