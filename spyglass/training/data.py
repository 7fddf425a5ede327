"""Offline training corpora: real code (the Python source of installed packages) and real prose
(Debian's Python documentation sources), tokenized into fixed-length contexts.

No dataset hub is reachable, so the corpus is built from what is on disk. Splits are decided per
*group* (a code package, a prose document) by a salted hash, so evaluation never sees a training
source; every split's manifest lists the groups and files it holds and its size in tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sysconfig
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from spyglass.models.loader import load_tokenizer

log = logging.getLogger(__name__)

PROSE_DEFAULT_ROOTS = ("/usr/share/doc/python3.11/html/_sources", "/usr/share/doc/python3/html/_sources")
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Document:
    kind: str  # "code" | "prose"
    group: str  # the unit of splitting: a package (code) or a document (prose)
    path: str


@dataclass
class CorpusConfig:
    """What goes into the corpus. `code_packages` are top-level stdlib/site-packages names (None = all
    stdlib packages); `prose_roots` are directories of documentation text (missing ones are skipped)."""

    code_packages: list[str] | None = None
    code_roots: list[str] | None = None
    prose_roots: list[str] = field(default_factory=lambda: list(PROSE_DEFAULT_ROOTS))
    prose_suffixes: list[str] = field(default_factory=lambda: [".txt", ".rst"])
    seq_len: int = 512
    max_contexts: dict[str, int] = field(default_factory=lambda: {"train": 64, "eval": 8})
    eval_fraction: float = 0.1
    prose_fraction: float = 0.5  # share of each split's contexts taken from prose (when prose exists)
    # Per split, how many contexts of the packed stream to pass over before keeping any (split the same way
    # between prose and code): a follow-up run reads text an earlier run did not, with the same split and salt.
    skip_contexts: dict[str, int] = field(default_factory=dict)
    salt: str = "spyglass-v1"
    max_file_bytes: int = 400_000

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> CorpusConfig:
        unknown = set(d or {}) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown corpus option(s): {', '.join(sorted(unknown))}")
        return cls(**(d or {}))


# --------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """Bytes folded into a small vocabulary: lets tiny random test models train on real text."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1 + b % (self.vocab_size - 1) for b in text.encode("utf-8")]

    def fingerprint(self) -> str:
        return f"bytes-{self.vocab_size}"


def tokenizer_hash(tokenizer: Any) -> str:
    """A stable identity for a tokenizer (vocabulary + merges), recorded in manifests."""
    if hasattr(tokenizer, "fingerprint"):
        return hashlib.sha256(tokenizer.fingerprint().encode()).hexdigest()[:16]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    blob = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_corpus_tokenizer(spec: str | None, model_path: Path | None, vocab_size: int) -> Any:
    """`bytes` (tests with tiny random models) or the model's own tokenizer."""
    if spec == "bytes":
        return ByteTokenizer(vocab_size)
    return load_tokenizer(model_path)


# --------------------------------------------------------------------------- documents and splits


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _code_roots(cfg: CorpusConfig) -> list[Path]:
    if cfg.code_roots:
        return [Path(r) for r in cfg.code_roots]
    return [_stdlib_root(), Path(sysconfig.get_paths()["purelib"])]


def code_documents(cfg: CorpusConfig) -> list[Document]:
    """Python files, one group per top-level package/module (tests and generated data excluded)."""
    docs: list[Document] = []
    wanted = set(cfg.code_packages) if cfg.code_packages is not None else None
    seen: set[str] = set()
    for root in _code_roots(cfg):
        if not root.is_dir():
            continue
        for entry in sorted(root.iterdir()):
            name = entry.stem if entry.suffix == ".py" else entry.name
            if name in seen or name.startswith((".", "_")) or name in ("site-packages", "test", "tests"):
                continue
            if wanted is not None and name not in wanted:
                continue
            if entry.is_dir():
                files = sorted(p for p in entry.rglob("*.py") if not ({"test", "tests"} & set(p.parts)))
            elif entry.suffix == ".py":
                files = [entry]
            else:
                continue
            files = [f for f in files if f.is_file() and f.stat().st_size <= cfg.max_file_bytes]
            if files:
                seen.add(name)
                docs.extend(Document("code", f"code:{name}", str(f)) for f in files)
    return docs


def prose_documents(cfg: CorpusConfig) -> list[Document]:
    """Documentation text files, one group per document."""
    docs: list[Document] = []
    for root in map(Path, cfg.prose_roots):
        if not root.is_dir():
            continue
        for f in sorted(root.rglob("*")):
            if f.is_file() and any(f.name.endswith(s) for s in cfg.prose_suffixes):
                if f.stat().st_size <= cfg.max_file_bytes:
                    docs.append(Document("prose", f"prose:{f.relative_to(root)}", str(f)))
        if docs:
            break  # the first root that exists is the prose source
    return docs


def split_of(group: str, cfg: CorpusConfig) -> str:
    """Deterministic, salted: the same group lands in the same split on every machine and run."""
    h = int.from_bytes(hashlib.sha256(f"{cfg.salt}:{group}".encode()).digest()[:8], "little")
    return "eval" if (h % 10_000) < cfg.eval_fraction * 10_000 else "train"


def _group_order(groups: Iterable[str], cfg: CorpusConfig) -> list[str]:
    """A fixed pseudo-random order of groups, so a capped split samples many sources, not a-z."""
    return sorted(set(groups), key=lambda g: hashlib.sha256(f"{cfg.salt}:order:{g}".encode()).digest())


def _pack(docs: list[Document], budget: int, tokenizer: Any, seq_len: int, cfg: CorpusConfig, used: dict) -> list:
    """Tokenize documents in group order and cut the stream into `budget` contexts of `seq_len` tokens."""
    by_group: dict[str, list[Document]] = {}
    for d in docs:
        by_group.setdefault(d.group, []).append(d)
    eos = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    contexts: list[list[int]] = []
    for g in _group_order(by_group, cfg):
        for d in by_group[g]:
            if len(contexts) >= budget:
                return contexts
            try:
                text = Path(d.path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            ids = tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                continue
            stream.extend(ids)
            if eos is not None:
                stream.append(int(eos))
            used.setdefault(g, []).append(d.path)
            while len(stream) >= seq_len and len(contexts) < budget:
                contexts.append(stream[:seq_len])
                stream = stream[seq_len:]
    return contexts


def build_corpus(cfg: CorpusConfig, tokenizer: Any, out_dir: Path) -> dict[str, Any]:
    """Write `contexts-<split>.safetensors` (`tokens [n, seq_len]` int64) and `corpus.json` (the split
    manifest). Idempotent: an existing manifest with the same config is returned as is."""
    out_dir = Path(out_dir)
    manifest_path = out_dir / "corpus.json"
    tok_hash = tokenizer_hash(tokenizer)
    cfg_dict = asdict(cfg)
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        if old.get("config") == cfg_dict and old.get("tokenizer_hash") == tok_hash:
            return old
    out_dir.mkdir(parents=True, exist_ok=True)
    all_docs = code_documents(cfg) + prose_documents(cfg)
    manifest: dict[str, Any] = {"config": cfg_dict, "tokenizer_hash": tok_hash, "seq_len": cfg.seq_len, "splits": {}}
    for split in SPLITS:
        budget = int(cfg.max_contexts.get(split, 0))
        split_docs = [d for d in all_docs if split_of(d.group, cfg) == split]
        code = [d for d in split_docs if d.kind == "code"]
        prose = [d for d in split_docs if d.kind == "prose"]
        n_prose = int(round(budget * cfg.prose_fraction)) if prose else 0
        skip = int(cfg.skip_contexts.get(split, 0))
        skip_prose = int(round(skip * cfg.prose_fraction)) if prose else 0
        used: dict[str, list[str]] = {}  # (documents read, skipped ones included)
        contexts = _pack(prose, skip_prose + n_prose, tokenizer, cfg.seq_len, cfg, used)[skip_prose:]
        skip_code = skip - skip_prose
        contexts += _pack(code, skip_code + budget - len(contexts), tokenizer, cfg.seq_len, cfg, used)[skip_code:]
        tokens = torch.tensor(contexts, dtype=torch.int64).reshape(len(contexts), cfg.seq_len)
        save_file({"tokens": tokens}, str(out_dir / f"contexts-{split}.safetensors"))
        manifest["splits"][split] = {
            "contexts": len(contexts),
            "tokens": int(tokens.numel()),
            "groups_assigned": sorted({d.group for d in split_docs}),
            "groups_used": sorted(used),
            "files_used": sorted(p for ps in used.values() for p in ps),
            "kinds": {k: sum(1 for g in used if g.startswith(k + ":")) for k in ("code", "prose")},
        }
        log.info("corpus split %s: %d contexts, %d tokens, %d groups", split, len(contexts), tokens.numel(), len(used))
    tmp = manifest_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(manifest_path)
    return manifest


def load_contexts(out_dir: Path, split: str = "train") -> torch.Tensor:
    return load_file(str(Path(out_dir) / f"contexts-{split}.safetensors"))["tokens"]
