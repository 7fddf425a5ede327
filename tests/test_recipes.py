"""The training recipes under configs/. Each shipped draft (spyglass/drafts/<draft>/) is rebuilt by `make
train-<draft>` from configs/<draft>.yaml or from the numbered steps of configs/<draft>/, each step warm-starting from
the output of the step before, and its model card names the target. Every other config is an ablation
(configs/ablation/) or a test's tiny config; documents name only configs that exist."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from actors.common import read_yaml_config
from actors.jobs import validate
from spyglass.training.tokenswift_train import resolve_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
ABLATION = CONFIGS / "ablation"
DRAFTS = sorted(p.name for p in (REPO / "spyglass" / "drafts").iterdir() if (p / "MODEL_CARD.md").is_file())
MAKEFILE = (REPO / "Makefile").read_text()
# Documents that may name configs (`configs/....yaml`): the model cards, the top-level documents, docs/, infra/.
DOCUMENTS = [
    *(REPO / "spyglass" / "drafts").glob("*/MODEL_CARD.md"),
    *REPO.glob("*.md"),
    *(REPO / "docs").rglob("*.md"),
    REPO / "infra" / "README.md",
]
NAMED_CONFIG = re.compile(r"(?<![\w/.-])configs/[\w./-]+?\.yaml")
# Options an ablation arm may change besides the one it tests: where it writes, its seed and length, and the learning
# rate of the weights its option adds (`new_lr_scale` applies only to weights its start lacks).
ARM_FREE = {"out_name", "seed", "steps", "new_lr_scale"}


def all_configs() -> list[Path]:
    return sorted(CONFIGS.rglob("*.yaml"))


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def trainer(cfg: dict) -> str:
    return cfg.get("trainer", "longspec")


def output(cfg: dict) -> str:
    """Where a config's run writes its draft (repository-relative), which a later run warm-starts from."""
    if trainer(cfg) == "longspec":
        return f"{cfg['workdir']}/{cfg['train'].get('out_name', 'train')}"
    return cfg["out_dir"] if trainer(cfg) == "tokenswift" else cfg["out"]


def warm_start(cfg: dict) -> str | None:
    """The run output a config's draft starts from, if any."""
    if trainer(cfg) == "longspec":
        return cfg["train"].get("init_from")
    return (cfg.get("args") or {}).get("init_from")


def written_by(path: str, cfg: dict) -> bool:
    out = output(cfg)
    return path == out or path.startswith(out + "/")


def make_dry_run(target: str) -> str:
    """The commands `make TARGET` would run, without its setup prerequisites."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    proc = subprocess.run(
        ["make", "-n", "-o", "setup", "-o", "model-qwen", target], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def steps_of(commands: str) -> list[str]:
    """The configs `spyglass train` runs, in order, in a make target's commands (`$(call train-steps,...)`)."""
    loops = re.findall(r"^for c in ([^;]*); do \S*spyglass train \$c", commands, re.M)
    return [config for loop in loops for config in loop.split()]


def recipe_of(draft: str) -> list[str]:
    chain = CONFIGS / draft
    if chain.is_dir():
        return [rel(p) for p in sorted(chain.glob("*.yaml"))]
    return [rel(CONFIGS / f"{draft}.yaml")] if (CONFIGS / f"{draft}.yaml").is_file() else []


@pytest.mark.parametrize("path", all_configs(), ids=lambda p: rel(p))
def test_every_config_parses(path):
    cfg = read_yaml_config(path)  # YAML, and the configs it starts from (`base:`)
    assert cfg.get("workdir"), "no workdir"
    if trainer(cfg) == "longspec":
        validate(cfg)  # corpus, extraction and training options, as `spyglass train` checks them
    elif trainer(cfg) == "tokenswift":
        resolve_config(cfg)
    else:
        assert trainer(cfg) in ("dflash", "dels") and cfg.get("out") and isinstance(cfg.get("args"), dict)


def test_configs_top_level_holds_the_recipes_of_shipped_drafts():
    recipes = {name for draft in DRAFTS for name in recipe_of(draft)}
    problems = []
    for path in all_configs():
        name = rel(path)
        if path.is_relative_to(ABLATION) or name in recipes:
            continue
        if path.name.startswith("tiny-"):  # a test's config
            if not any(path.name in test.read_text() for test in (REPO / "tests").glob("*.py")):
                problems.append(f"{name}: no test uses it")
            continue
        problems.append(f"{name}: not the recipe of a shipped draft (spyglass/drafts/*), an ablation or a test's")
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("draft", DRAFTS)
def test_each_shipped_draft_is_rebuilt_by_its_make_target_from_its_recipe(draft):
    recipe = recipe_of(draft)
    assert recipe, f"no configs/{draft}.yaml or configs/{draft}/"
    assert re.search(rf"^train-{re.escape(draft)}:", MAKEFILE, re.M), f"no `make train-{draft}`"
    card = (REPO / "spyglass" / "drafts" / draft / "MODEL_CARD.md").read_text()
    assert f"make train-{draft}" in card, "its model card does not say how to rebuild it"
    commands = make_dry_run(f"train-{draft}")
    steps = steps_of(commands)
    assert steps[-len(recipe) :] == recipe, f"make runs {steps}, the recipe is {recipe}"
    cfgs = [read_yaml_config(REPO / s) for s in steps]
    for i, (step, cfg) in enumerate(zip(steps, cfgs, strict=True)):
        start = warm_start(cfg)
        if i == 0:
            assert start is None or not start.startswith(".cache/"), f"{step}: the first step starts from {start}"
        else:
            assert start and written_by(start, cfgs[i - 1]), f"{step} starts from {start}, not the step before's output"
    # the shipped files come from the last step's output, into the draft's directory
    shipping = commands[commands.rindex("spyglass train") :]
    last = cfgs[-1]
    if trainer(last) == "longspec":  # actors.export_draft WORKDIR OUT --train-dir NAME
        assert f"{last['workdir']} spyglass/drafts/{draft}" in shipping
        assert f"--train-dir {last['train'].get('out_name', 'train')}" in shipping
    else:
        assert f"{output(last)}/" in shipping and f"spyglass/drafts/{draft}/" in shipping, shipping


def test_documents_name_only_configs_that_exist():
    problems = []
    for doc in [*DOCUMENTS, REPO / "Makefile"]:
        for name in sorted(set(NAMED_CONFIG.findall(doc.read_text()))):
            if "*" not in name and "..." not in name and not (REPO / name).is_file():
                problems.append(f"{rel(doc)}: {name}")
    assert problems == [], "documents name configs that do not exist:\n" + "\n".join(problems)


def test_runs_do_not_overwrite_each_other_and_a_shared_extraction_is_one_extraction():
    cfgs = {rel(p): read_yaml_config(p) for p in all_configs()}
    writers: dict[str, list[str]] = {}
    for name, cfg in cfgs.items():
        writers.setdefault(output(cfg), []).append(name)
    assert {out: names for out, names in writers.items() if len(names) > 1} == {}
    # configs that train in one workdir read one extraction: the same target, corpus and extraction options
    by_workdir: dict[str, list[str]] = {}
    for name, cfg in cfgs.items():
        if trainer(cfg) == "longspec":
            by_workdir.setdefault(cfg["workdir"], []).append(name)
    keys = ("model", "dtype", "tokenizer", "corpus", "extract")
    for workdir, names in by_workdir.items():
        first = {k: cfgs[names[0]].get(k) for k in keys}
        for name in names[1:]:
            assert {k: cfgs[name].get(k) for k in keys} == first, f"{name} and {names[0]} share {workdir}"


@pytest.mark.parametrize("path", sorted(ABLATION.glob("*.yaml")), ids=lambda p: p.name)
def test_each_ablation_is_an_arm_of_its_base_or_continues_a_run(path):
    """An arm starts where its base starts, on its base's extraction, and changes one training option; a follow-up
    run starts from another config's output."""
    cfg = read_yaml_config(path)
    base_name = yaml.safe_load(path.read_text()).get("base")
    start = warm_start(cfg)
    if base_name is None:  # a run of its own
        assert start is None, f"starts from {start}"
        return
    control = read_yaml_config(path.parent / base_name)
    if cfg["workdir"] == control["workdir"] and start == warm_start(control):
        changed = {k for k, v in cfg["train"].items() if v != control["train"].get(k)} - ARM_FREE
        assert len(changed) == 1, changed
        assert cfg["train"]["out_name"] != control["train"].get("out_name", "train")
    else:
        others = [read_yaml_config(p) for p in all_configs() if p != path]
        assert start and any(written_by(start, other) for other in others), f"starts from {start}, no config's output"
