"""Sharded target-forward extraction on Ray actors.

Each actor (one per GPU, or per CPU slot here) loads the target once and turns its contexts into what the
drafters learn from: the K/V of chosen layers (the last one for LongSpec, the top ones for GLIDE), hidden
states of chosen layers (TokenSwift, DFlash) and optionally the target's top-k log-probs (distillation),
at the configured positions (plain or Anchor-Offset). Output per split: `shard-NNNNN.safetensors` plus
`shard-NNNNN.json` (written last: its presence means the shard is complete, so a rerun skips it) and a
`manifest.json`. Contexts already extracted by anyone are read from the Redis ContextCache instead of
recomputed; a miss or a Redis failure only costs the recomputation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from actors.common import ensure_ray
from spyglass.context_cache import ContextCache
from spyglass.models.llama import ModelArgs, Segment, Transformer, load_transformer
from spyglass.models.loader import ResolvedModel, load_config, resolve_model
from spyglass.training.data import CorpusConfig, build_corpus, load_corpus_tokenizer, tokenizer_hash
from spyglass.training.positions import PositionScheme

log = logging.getLogger(__name__)

SHARD_FORMAT = 1


def build_section(cls, d: dict | None, section: str):
    """A config section as a dataclass; unknown keys are a clear error, not a TypeError."""
    unknown = set(d or {}) - set(cls.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown {section} option(s): {', '.join(sorted(unknown))}")
    return cls(**(d or {}))


@dataclass
class ExtractSpec:
    """What to extract and how (the `extract:` section of a config)."""

    kv_layers: list[int] = field(default_factory=lambda: [-1])
    hidden_layers: list[int] = field(default_factory=list)
    topk: int = 8
    positions: dict = field(default_factory=dict)
    shard_size: int = 8
    workers: int = 2
    splits: list[str] = field(default_factory=lambda: ["train", "eval"])
    redis_url: str | None = None
    block_size: int = 128
    cache_max_bytes: int = 2 << 30
    threads: int = 1
    logits_chunk: int = 256
    # > 0: each context keeps its first `continue_from` tokens and the rest becomes the target's own greedy
    # continuation of them (on-policy text: what a draft reads and predicts in T=0 serving)
    continue_from: int = 0
    generate_batch: int = 16

    @classmethod
    def from_dict(cls, d: dict | None) -> ExtractSpec:
        return build_section(cls, d, "extract")

    @property
    def scheme(self) -> PositionScheme:
        return PositionScheme.from_dict(self.positions)


def normalize_layers(layers: list[int], n_layers: int) -> list[int]:
    out = sorted({(layer + n_layers) if layer < 0 else layer for layer in layers})
    bad = [layer for layer in out if not 0 <= layer < n_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range for a {n_layers}-layer target")
    return out


@torch.inference_mode()
def greedy_continuations(target: Transformer, contexts: torch.Tensor, keep: int, batch: int = 16) -> torch.Tensor:
    """`contexts [n, L]` with every row's tokens from `keep` on replaced by the target's greedy continuation of
    its first `keep` tokens (plain positions 0..L-1, as a served prompt has; sequences decoded `batch` at a
    time in one packed forward per step). EOS does not stop a row: the length is fixed."""
    n, length = contexts.shape
    if not 0 < keep < length:
        raise ValueError(f"continue_from must be in 1..{length - 1} for {length}-token contexts, not {keep}")
    out = contexts.clone()
    for lo in range(0, n, batch):
        rows = range(lo, min(n, lo + batch))
        cache = target.new_cache(length, len(rows))
        slots = [cache.allocate() for _ in rows]
        block = out[lo : lo + len(rows)]  # a view: writes land in `out`
        block[:, keep] = torch.stack(
            [target.prefill(cache, s, block[i, :keep]).argmax(-1) for i, s in enumerate(slots)]
        )
        for pos in range(keep, length - 1):  # feed token `pos`, read token `pos + 1`
            where = torch.tensor([pos], device=out.device)
            segments = [Segment(s, pos, block[i, pos : pos + 1], where, None, "last") for i, s in enumerate(slots)]
            logits = target.forward(segments, cache)
            for s in slots:
                cache.commit(s, pos, [0])
            block[:, pos + 1] = torch.stack([lg[-1] for lg in logits]).argmax(-1)
    return out


class Extractor:
    """Runs the target's layers over one context at a time and keeps what the spec asks for."""

    def __init__(self, target: Transformer, spec: ExtractSpec, model_id: str | None = None) -> None:
        self.target = target
        self.spec = spec
        self.scheme = spec.scheme
        n = target.args.n_layers
        self.kv_layers = normalize_layers(spec.kv_layers, n)
        self.hidden_layers = normalize_layers(spec.hidden_layers, n)
        self.model_id = model_id or target.model_id
        self.dtype_name = str(target.dtype).removeprefix("torch.")
        self.cache: ContextCache | None = None
        self._cache_retry_at = 0.0
        if spec.redis_url:
            self.cache = ContextCache(
                spec.redis_url, self.namespace, spec.block_size, spec.cache_max_bytes, async_writes=False
            )

    @property
    def namespace(self) -> str:
        """Keys differ whenever the model, dtype, positions or the extracted set differ."""
        kv = ",".join(map(str, self.kv_layers))
        hid = ",".join(map(str, self.hidden_layers))
        return f"extract:{self.model_id}:{self.dtype_name}:{self.scheme.tag()}:kv{kv}:h{hid}:k{self.spec.topk}"

    # --- the forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def compute(self, tokens: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """One context `[L]` -> features; the same layer calls as `Transformer.forward` (one segment)."""
        t = self.target
        length = tokens.shape[0]
        cache = t.new_cache(length, 1)
        slot = cache.allocate()
        segments = [Segment(slot, 0, tokens, positions, None, "none")]
        cos, sin = t._rope(positions)
        x = t.embed(tokens)
        out: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(t.layers):
            x = layer(x, cos, sin, segments, cache, i, t.attention_backend)
            if i in self.hidden_layers:
                out[f"hidden.{i}"] = x.clone()
        for i in self.kv_layers:
            k, v = cache.layer(slot, i)
            out[f"kv.{i}"] = torch.stack([k[:, :length], v[:, :length]]).clone()
        if self.spec.topk > 0:
            ids, lps = [], []
            for c in range(0, length, self.spec.logits_chunk):
                logits = t.lm_head(t.norm(x[c : c + self.spec.logits_chunk])).float()
                lp, idx = torch.log_softmax(logits, dim=-1).topk(self.spec.topk, dim=-1)
                ids.append(idx)
                lps.append(lp)
            out["topk_ids"] = torch.cat(ids)
            out["topk_logprobs"] = torch.cat(lps)
        return out

    # --- cache packing: one fp32 tensor [block, F] per block (exact for fp32/bf16 values and ids < 2^24)
    def _pack(self, feats: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        parts = []
        for name in sorted(feats):
            f = feats[name]
            if name.startswith("kv."):
                parts.append(f[:, :, lo:hi].permute(2, 0, 1, 3).reshape(hi - lo, -1).float())
            else:
                parts.append(f[lo:hi].reshape(hi - lo, -1).float())
        return torch.cat(parts, dim=1)

    def _unpack(self, blocks: list[torch.Tensor], template: dict[str, tuple]) -> dict[str, torch.Tensor]:
        flat = torch.cat(blocks, dim=0)  # [L, F]
        length = flat.shape[0]
        out, col = {}, 0
        for name in sorted(template):
            shape, dtype = template[name]
            if name.startswith("kv."):
                two, heads, _, hd = shape
                width = two * heads * hd
                out[name] = flat[:, col : col + width].reshape(length, two, heads, hd).permute(1, 2, 0, 3)
            else:
                width = math.prod(shape[1:]) if len(shape) > 1 else 1
                out[name] = flat[:, col : col + width].reshape(length, *shape[1:])
            out[name] = out[name].to(dtype).contiguous()
            col += width
        return out

    def _template(self, length: int) -> dict[str, tuple]:
        a, dt = self.target.args, self.target.dtype
        tpl: dict[str, tuple] = {f"kv.{i}": ((2, a.n_kv_heads, length, a.head_dim), dt) for i in self.kv_layers}
        tpl.update({f"hidden.{i}": ((length, a.hidden_size), dt) for i in self.hidden_layers})
        if self.spec.topk > 0:
            tpl["topk_ids"] = ((length, self.spec.topk), torch.int64)
            tpl["topk_logprobs"] = ((length, self.spec.topk), torch.float32)
        return tpl

    def features(self, tokens: torch.Tensor) -> tuple[dict[str, torch.Tensor], bool]:
        """Features of one context and whether they came from the cache (all blocks hit)."""
        positions = self.scheme.positions(tokens, self.target.args.max_position)
        length = tokens.shape[0]
        bs = self.spec.block_size
        cacheable = self.cache is not None and length % bs == 0 and bs >= self.scheme.hash_tokens
        cacheable = cacheable and time.monotonic() >= self._cache_retry_at
        if cacheable:
            errors = self.cache.stats.errors
            blocks = self.cache.lookup(tokens)
            if self.cache.stats.errors > errors:  # Redis is down: recompute, retry it in a while (less noise)
                self._cache_retry_at = time.monotonic() + 30.0
                cacheable = False
            if len(blocks) * bs == length:
                feats = self._unpack(blocks, self._template(length))
                feats["positions"] = positions
                return feats, True
        feats = self.compute(tokens, positions)
        if cacheable:
            self.cache.store(tokens, {b: self._pack(feats, b * bs, (b + 1) * bs) for b in range(length // bs)})
        feats["positions"] = positions
        return feats, False

    # --- shards --------------------------------------------------------------------------------
    def run_shard(self, contexts: torch.Tensor, shard: int, out_dir: Path, meta: dict[str, Any]) -> dict[str, Any]:
        """Extract `contexts [n, L]` into shard `shard` of `out_dir`; skipped if already complete."""
        out_dir = Path(out_dir)
        name = f"shard-{shard:05d}"
        done = out_dir / f"{name}.json"
        if done.exists():
            info = json.loads(done.read_text())
            info["skipped"] = True
            return info
        t0 = time.perf_counter()
        if self.spec.continue_from:
            contexts = greedy_continuations(self.target, contexts, self.spec.continue_from, self.spec.generate_batch)
        hits0 = self.cache.stats.hits if self.cache else 0
        per: dict[str, list[torch.Tensor]] = {}
        from_cache = 0
        for row in contexts:
            feats, cached = self.features(row)
            from_cache += int(cached)
            for k, v in feats.items():
                per.setdefault(k, []).append(v)
        tensors = {k: torch.stack(v).contiguous() for k, v in per.items()}
        tensors["tokens"] = contexts.clone().contiguous()
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".{name}.{os.getpid()}.tmp"
        save_file(tensors, str(tmp), metadata={"format": str(SHARD_FORMAT)})  # one key: byte-stable files
        tmp.replace(out_dir / f"{name}.safetensors")
        seconds = time.perf_counter() - t0
        info = {
            "shard": shard,
            "file": f"{name}.safetensors",
            "contexts": int(contexts.shape[0]),
            "tokens": int(contexts.numel()),
            "contexts_from_cache": from_cache,
            "cache_block_hits": (self.cache.stats.hits - hits0) if self.cache else 0,
            "seconds": round(seconds, 4),
            "tokens_per_s": round(contexts.numel() / max(seconds, 1e-9), 2),
            "shapes": {k: list(v.shape) for k, v in tensors.items()},
            **meta,
        }
        tmp_json = out_dir / f".{name}.json.tmp"
        tmp_json.write_text(json.dumps(info, indent=1))
        tmp_json.replace(done)
        info["skipped"] = False
        log.info(
            "extracted %s/%s: %d tokens in %.2f s (%.0f tok/s), %d/%d contexts from cache",
            out_dir.name,
            name,
            info["tokens"],
            seconds,
            info["tokens_per_s"],
            from_cache,
            contexts.shape[0],
        )
        return info


# --------------------------------------------------------------------------- Ray side


def _extraction_actor_cls():
    import ray  # Ray: imported when actors start, so the extraction itself runs without it (tests, bench)

    @ray.remote
    class ExtractionActor:
        """Loads the target once; extracts the shards it is handed."""

        def __init__(self, model_path: str, dtype: str, model_id: str, spec: dict, meta: dict) -> None:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # per-shard throughput
            self.spec = ExtractSpec.from_dict(spec)
            torch.set_num_threads(self.spec.threads)
            device = "cuda" if torch.cuda.is_available() else "cpu"
            target = load_transformer(model_path, dtype=getattr(torch, dtype), device=device)
            self.extractor = Extractor(target, self.spec, model_id)
            self.meta = meta

        def run(self, jobs: list[tuple[str, int, int, int, str]]) -> list[dict]:
            """jobs: (contexts file, shard, first row, last row, out dir)."""
            from tqdm import tqdm  # the `train` extra

            results = []
            cached_files: dict[str, torch.Tensor] = {}
            for path, shard, lo, hi, out_dir in tqdm(jobs, desc="extract shards", mininterval=5.0):
                if path not in cached_files:
                    cached_files[path] = load_file(path)["tokens"]
                results.append(self.extractor.run_shard(cached_files[path][lo:hi], shard, Path(out_dir), self.meta))
            return results

        def cache_stats(self) -> dict:
            c = self.extractor.cache
            return asdict(c.stats) if c else {}

    return ExtractionActor


def resolve_target(source: str | None, dtype: str, needs_tokenizer: bool = True):
    """The loader's resolution; a bare weights directory (tiny test models, byte tokenizer) is used in place."""
    if needs_tokenizer or source is None:
        return resolve_model(source, dtype=dtype)
    path = Path(source).resolve()
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
        h.update(str(f.stat().st_size).encode())
    return ResolvedModel(path=path, model_id=f"{path.name}-{h.hexdigest()[:8]}", dtype=dtype)


def shard_plan(n_contexts: int, shard_size: int) -> list[tuple[int, int, int]]:
    return [(i, lo, min(n_contexts, lo + shard_size)) for i, lo in enumerate(range(0, n_contexts, shard_size))]


def run_extraction(cfg: dict[str, Any]) -> dict[str, Any]:
    """Driver: build the corpus, plan shards, fan them out to actors, write one manifest per split."""
    import ray  # Ray: imported when actors start, so the extraction itself runs without it (tests, bench)

    workdir = Path(cfg["workdir"])
    spec = ExtractSpec.from_dict(cfg.get("extract"))
    dtype = cfg.get("dtype", "float32")
    resolved = resolve_target(cfg.get("model"), dtype, needs_tokenizer=cfg.get("tokenizer") != "bytes")
    args = ModelArgs.from_hf_config(load_config(resolved.path))
    tokenizer = load_corpus_tokenizer(cfg.get("tokenizer"), resolved.path, args.vocab_size)
    corpus = build_corpus(CorpusConfig.from_dict(cfg.get("corpus")), tokenizer, workdir / "corpus")
    kv_layers = normalize_layers(spec.kv_layers, args.n_layers)
    hidden_layers = normalize_layers(spec.hidden_layers, args.n_layers)
    meta = {
        "model_id": resolved.model_id,
        "model_path": str(resolved.path),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "dtype": dtype,
        "n_layers": args.n_layers,
        "kv_layers": kv_layers,
        "hidden_layers": hidden_layers,
        "topk": spec.topk,
        "continue_from": spec.continue_from,
        "position_scheme": spec.scheme.to_dict(),
        "position_tag": spec.scheme.tag(),
    }
    jobs, skipped = [], 0
    for split in spec.splits:
        path = workdir / "corpus" / f"contexts-{split}.safetensors"
        n = corpus["splits"][split]["contexts"]
        for shard, lo, hi in shard_plan(n, spec.shard_size):
            if (workdir / "extract" / split / f"shard-{shard:05d}.json").exists():
                skipped += 1
            else:
                jobs.append((str(path), shard, lo, hi, str(workdir / "extract" / split)))
    t0 = time.perf_counter()
    results: list[dict] = []
    cache_stats: list[dict] = []
    if jobs:
        ensure_ray()  # joins RAY_ADDRESS's cluster, else a loopback one
        use_gpu = ray.cluster_resources().get("GPU", 0) >= 1
        n_actors = max(1, min(spec.workers, len(jobs)))
        actor_cls = _extraction_actor_cls().options(num_gpus=1 if use_gpu else 0, num_cpus=0 if use_gpu else 1)
        actors = [
            actor_cls.remote(str(resolved.path), dtype, resolved.model_id, asdict(spec), meta) for _ in range(n_actors)
        ]
        work = [jobs[i::n_actors] for i in range(n_actors)]
        for out in ray.get([a.run.remote(w) for a, w in zip(actors, work, strict=True)]):
            results.extend(out)
        cache_stats = ray.get([a.cache_stats.remote() for a in actors])
        for a in actors:
            ray.kill(a)
    seconds = time.perf_counter() - t0
    manifests = {}
    for split in spec.splits:
        out_dir = workdir / "extract" / split
        shards = sorted(out_dir.glob("shard-*.json")) if out_dir.exists() else []
        infos = [json.loads(p.read_text()) for p in shards]
        manifest = {
            **meta,
            "split": split,
            "seq_len": corpus["seq_len"],
            "shards": [{k: i[k] for k in ("shard", "file", "contexts", "tokens")} for i in infos],
            "contexts": sum(i["contexts"] for i in infos),
            "tokens": sum(i["tokens"] for i in infos),
            "corpus_tokens": corpus["splits"][split]["tokens"],
        }
        if out_dir.exists():
            (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
        manifests[split] = manifest
    new_tokens = sum(r["tokens"] for r in results if not r.get("skipped"))
    summary = {
        "shards_written": sum(1 for r in results if not r.get("skipped")),
        "shards_skipped": skipped + sum(1 for r in results if r.get("skipped")),
        "tokens_extracted": new_tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(new_tokens / seconds, 2) if seconds > 0 and new_tokens else 0.0,
        "contexts_from_cache": sum(r.get("contexts_from_cache", 0) for r in results if not r.get("skipped")),
        "cache_block_hits": sum(s.get("hits", 0) for s in cache_stats),
        "cache_errors": sum(s.get("errors", 0) for s in cache_stats),
        "manifests": {s: str(workdir / "extract" / s / "manifest.json") for s in spec.splits},
    }
    log.info("extraction: %s", {k: v for k, v in summary.items() if k != "manifests"})
    return summary
