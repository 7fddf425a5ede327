"""The `spyglass` command line: generate (in process or on a server), serve, health, extract and train. Errors
about the input print one line naming the problem and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from spyglass.client import Client, SpyglassError, env_token
from spyglass.demo import code_edit_task
from spyglass.device import DEVICE_HELP, resolve_device
from spyglass.drafters import METHODS, build_drafter, resolve_method
from spyglass.engine import EngineConfig, RequestError, SpecEngine
from spyglass.kv_cache import context_capacity
from spyglass.limits import check_prompt_ids
from spyglass.models.llama import load_transformer, model_args
from spyglass.models.loader import ModelLoadError, load_tokenizer, resolve_model
from spyglass.sampling import SamplingParams

EXIT_BAD_INPUT = 2


class CliError(Exception):
    """A problem with what the user asked for; printed without a traceback."""


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate from a prompt with speculative decoding")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    src.add_argument("--demo", action="store_true", help="the built-in long-context code-editing task")
    p.add_argument(
        "--model",
        default=None,
        help="local HF directory, .gguf file or qwen2.5-coder-0.5b (`make model-qwen`; default: embedded SmolLM2)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="auto (default): bf16 on a GPU; on the CPU the stored dtype where the C++ kernels build, else fp32",
    )
    p.add_argument("--device", default="auto", help=f"where the model runs: {DEVICE_HELP} (default auto)")
    p.add_argument("--method", default="suffix", help=f"{' | '.join(METHODS)} (default suffix)")
    p.add_argument("--draft-model", default=None, help="small-lm: draft model source (same tokenizer)")
    p.add_argument(
        "--draft-layers", type=int, default=None, help="small-lm without --draft-model: use the target's first N layers"
    )
    p.add_argument(
        "--draft-checkpoint",
        default=None,
        help="longspec, glide, dflash: a trained draft (trainer checkpoint dir); tokenswift: heads (default: the "
        "ones shipped for the model)",
    )
    p.add_argument(
        "--partial-budget", type=int, default=None, help="tokenswift, streaming: partial KV budget in tokens"
    )
    p.add_argument("--gamma", type=int, default=None, help="small-lm, longspec, glide: tokens drafted per step")
    p.add_argument("--ngram-min", type=int, default=None)
    p.add_argument("--ngram-max", type=int, default=None)
    p.add_argument("--draft-len", type=int, default=None, help="ngram: tokens per candidate")
    p.add_argument("--max-candidates", type=int, default=None, help="ngram: candidates merged into the tree")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument(
        "--contextual-penalty", type=float, default=1.0, help="TokenSwift: theta (>= 1) on tokens of the last W"
    )
    p.add_argument("--penalty-window", type=int, default=1024, help="W: tokens the contextual penalty looks back")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--max-context", type=int, default=None, help="KV capacity per sequence (default: the model's window)"
    )
    p.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    p.add_argument("--compare-ar", action="store_true", help="also run plain decoding and compare")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument(
        "--server",
        metavar="ADDRESS",
        default=None,
        help="generate on a running `spyglass serve` (host:port, gRPC; sends $SPYGLASS_AUTH_TOKEN when set)",
    )


def _read_prompt(args) -> str:
    if args.demo:
        return code_edit_task().prompt
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"cannot read prompt file {args.prompt_file!r}: {e}") from e
    return args.prompt


def _params(args):
    try:
        return SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            contextual_penalty=args.contextual_penalty,
            penalty_window=args.penalty_window,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
            stop=tuple(args.stop),
        )
    except ValueError as e:
        raise CliError(str(e)) from e


def _encode(tokenizer, text: str, raw: bool) -> list[int]:
    if not text.strip():
        raise CliError("the prompt is empty")
    if not raw and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer.encode(text, add_special_tokens=False)


def _run_generate(args) -> int:
    if args.server:
        return _run_remote_generate(args)
    try:
        resolve_method(args.method)
    except ValueError as e:
        raise CliError(str(e)) from e
    params = _params(args)
    prompt = _read_prompt(args)

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise CliError(str(e)) from e
    try:
        resolved = resolve_model(args.model, dtype=args.dtype, device=device)  # "auto" resolved here (resolve_dtype)
        dtype = getattr(torch, resolved.dtype)
        tokenizer = load_tokenizer(resolved.path)
        shapes = model_args(resolved.path)
    except ModelLoadError as e:
        raise CliError(str(e)) from e
    prompt_ids = _encode(tokenizer, prompt, args.raw)
    try:
        # the prompt and the context are checked before the weights load (and their kernels are timed)
        capacity = context_capacity(shapes, args.max_context, max_batch=1, dtype=dtype, device=device)
        check_prompt_ids(prompt_ids, shapes.vocab_size, capacity)
    except (RequestError, ValueError) as e:
        raise CliError(str(e)) from e
    try:
        target = load_transformer(resolved.path, dtype=dtype, device=device)
    except ModelLoadError as e:
        raise CliError(str(e)) from e
    try:
        config = EngineConfig(max_batch=1, max_context=capacity)
        drafter = build_drafter(
            args.method,
            target,
            max_batch=1,
            max_context=capacity,
            n_min=args.ngram_min,
            n_max=args.ngram_max,
            draft_len=args.draft_len,
            max_candidates=args.max_candidates,
            draft_model=args.draft_model,
            draft_layers=args.draft_layers,
            draft_checkpoint=args.draft_checkpoint,
            gamma=args.gamma,
            partial_budget=args.partial_budget,
        )
        engine = SpecEngine(target, drafter, config, tokenizer)
        result = _generate_once(engine, prompt_ids, params, stream=not args.json)
        out = {"text": result["text"], "token_ids": result["token_ids"], "stats": result["stats"]}
        out["stats"]["method"] = args.method
        out["stats"]["dtype"] = resolved.dtype
        out["stats"]["prompt_tokens"] = len(prompt_ids)
        if args.compare_ar:
            if not args.json:
                print("\n--- plain decoding (ar) for comparison ---", file=sys.stderr)
            ar_engine = SpecEngine(target, None, config, tokenizer)
            ar = _generate_once(ar_engine, prompt_ids, params, stream=False)
            out["ar_stats"] = ar["stats"]
            out["ar_identical"] = ar["token_ids"] == result["token_ids"]
            spec_tps, ar_tps = result["stats"]["tokens_per_s"], ar["stats"]["tokens_per_s"]
            out["speedup"] = spec_tps / ar_tps if ar_tps else None
            out["e2e_speedup"] = ar["stats"]["wall_s"] / result["stats"]["wall_s"]
    except (RequestError, ValueError) as e:
        raise CliError(str(e)) from e
    if args.json:
        print(json.dumps(out))
    else:
        _print_stats(out)
    return 0


def _generate_once(engine, prompt_ids: list[int], params, stream: bool) -> dict:
    t0 = time.perf_counter()
    seq = None
    for event in engine.generate(prompt_ids, params):
        seq = event.seq
        if stream and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    wall = time.perf_counter() - t0
    if stream:
        print()
    stats = seq.stats.summary(seq.num_generated)
    stats["finish_reason"] = seq.finish_reason
    stats["wall_s"] = wall
    return {"text": engine.text(seq), "token_ids": seq.output_ids, "stats": stats}


def _print_stats(out: dict) -> None:
    s = out["stats"]
    lines = [
        f"method {s['method']}: {s['generated_tokens']} tokens from a {s['prompt_tokens']}-token prompt, "
        f"finish={s['finish_reason']}",
        f"  decode {s['tokens_per_s']:.1f} tok/s, tau {s['tau']:.2f} tokens/step over {s['steps']} steps, "
        f"prefill {s['prefill_time_s']:.2f} s, wall {s['wall_s']:.2f} s",
        "  acceptance by depth: " + " ".join(f"{a:.2f}" for a in s["acceptance_by_depth"][:8]),
    ]
    if "ar_stats" in out:
        a = out["ar_stats"]
        lines.append(
            f"plain decoding: {a['tokens_per_s']:.1f} tok/s, wall {a['wall_s']:.2f} s -> "
            f"decode speedup {out['speedup']:.2f}x, end to end {out['e2e_speedup']:.2f}x, "
            f"identical output: {'yes' if out['ar_identical'] else 'NO'}"
        )
    print("\n".join(lines), file=sys.stderr)


def _add_training(sub) -> None:
    """`extract` and `train`: handlers live in actors/jobs.py."""
    for name, help_text in (
        ("extract", "sharded target-forward extraction on Ray actors (resumable, Redis context reuse)"),
        ("train", "extract (finished shards are skipped), then train the draft with Ray Train"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", help="YAML config (see configs/)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
        p.add_argument("--workdir", default=None, help="output directory (overrides the config's workdir)")
        if name == "train":
            p.add_argument("--skip-extract", action="store_true", help="train on existing shards only")
            p.add_argument(
                "--diagnose",
                action="store_true",
                help="after each checkpoint, print the draft's top-1 agreement with the target by lag (eval split)",
            )


def _run_training_command(args) -> int:
    try:
        from actors import jobs  # Ray: only the training commands load it
    except ImportError as e:
        raise CliError(f"the training commands need the repository's actors package: {e}") from e
    try:
        return jobs.extract_command(args) if args.command == "extract" else jobs.train_command(args)
    except (FileNotFoundError, ValueError) as e:
        raise CliError(str(e)) from e


def _run_remote_generate(args) -> int:
    """`generate --server`: the same request through the gRPC SDK (no model loaded here)."""
    params = _params(args)  # validates locally first: one clear message, no round trip
    prompt = _read_prompt(args)
    if not prompt.strip():
        raise CliError("the prompt is empty")
    kw = dict(
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        contextual_penalty=params.contextual_penalty,
        penalty_window=params.penalty_window,
        seed=params.seed,
        stop=list(params.stop),
        raw=args.raw,
    )
    t0 = time.perf_counter()
    try:
        with Client(args.server, token=env_token()) as client:
            text, ids, stats = "", [], {}
            for chunk in client.generate(prompt, method=args.method, **kw):
                text += chunk.text
                ids += chunk.token_ids
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                if chunk.final:
                    stats = dict(chunk.stats or {}, finish_reason=chunk.finish_reason)
            if not args.json:
                print()
            stats["wall_s"] = time.perf_counter() - t0
            out = {"text": text, "token_ids": ids, "stats": stats}
            if args.compare_ar:
                ar = client.generate_text(prompt, method="ar", **kw)
                ar_stats = dict(ar.stats, wall_s=ar.stats.get("latency_s", 0.0))
                out["ar_stats"] = ar_stats
                out["ar_identical"] = ar.token_ids == ids
                out["speedup"] = stats["tokens_per_s"] / ar_stats["tokens_per_s"] if ar_stats["tokens_per_s"] else None
                out["e2e_speedup"] = ar_stats["wall_s"] / stats["latency_s"] if stats.get("latency_s") else None
    except SpyglassError as e:
        raise CliError(f"server {args.server}: {e.code.name}: {e.details}") from e
    if args.json:
        print(json.dumps(out))
    else:
        _print_stats(out)
    return 0


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run the serving stack locally (Ray Serve gateway + verifier, Redis, gRPC)")
    p.add_argument("--config", default=None, help="Ray Serve config YAML (default: infra/serve_config.yaml)")
    p.add_argument("--once", action="store_true", help="exit after the demo request instead of serving")
    p.add_argument("--port", type=int, default=None, help="gRPC port (default: the config's, 9000)")
    p.add_argument("--http-port", type=int, default=None, help="Serve HTTP port (default: the config's, 8000)")
    p.add_argument("--demo-tokens", type=int, default=64, help="new tokens for the demo request")
    p.add_argument("--no-demo", action="store_true", help="do not send the demo request")
    p.add_argument(
        "--grpc-host",
        default=None,
        help="address the gRPC port listens on (default: $SPYGLASS_GRPC_HOST, else 127.0.0.1; 0.0.0.0 = every "
        "interface)",
    )
    p.add_argument("--tls-cert", default=None, help="PEM server certificate: TLS on the gRPC port ($SPYGLASS_TLS_CERT)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert ($SPYGLASS_TLS_KEY)")
    p.add_argument(
        "--device", default=None, help=f"where each verifier replica computes: {DEVICE_HELP} (default: the config's)"
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default=None,
        help="the verifiers' dtype (default: the config's, auto)",
    )


def _run_serve(args) -> int:
    for name in ("port", "http_port"):
        port = getattr(args, name)
        if port is not None and (not 0 < port < 65536 or 10002 <= port <= 19999):
            raise CliError(f"--{name.replace('_', '-')} must be in 1-65535 and outside Ray's worker range 10002-19999")
    if args.device is not None:  # a device this machine lacks fails here, before Ray starts
        try:
            resolve_device(args.device)
        except ValueError as e:
            raise CliError(str(e)) from e
    try:
        from services.app import serve_main  # Ray Serve: only `serve` loads it
    except ImportError as e:
        raise CliError(f"`spyglass serve` needs the repository's services package and ray[serve]: {e}") from e
    try:
        return serve_main(
            args.config,
            args.once,
            args.port,
            args.http_port,
            args.demo_tokens,
            args.no_demo,
            grpc_host=args.grpc_host,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            device=args.device,
            dtype=args.dtype,
        )
    except (FileNotFoundError, ValueError) as e:
        raise CliError(str(e)) from e


def _add_health(sub) -> None:
    # The readiness probe of the serving pods (infra/k8s/rayservice.yaml).
    p = sub.add_parser(
        "health",
        help="probe a running server's Health RPC: exit 0 when a verifier replica serves ($SPYGLASS_AUTH_TOKEN: the "
        "bearer token to send)",
    )
    p.add_argument("--server", metavar="ADDRESS", default="127.0.0.1:9000", help="gRPC host:port (default %(default)s)")
    p.add_argument("--timeout", type=float, default=5.0, help="RPC deadline in seconds (default %(default)s)")


def _run_health(args) -> int:
    """Ready = the RPC answers through this node's proxy and some replica has KV slots (a replica that failed
    its own check is reported by name only, with no slots). "degraded" with one healthy replica is still ready."""
    if args.timeout <= 0:
        raise CliError("--timeout must be > 0")
    try:
        with Client(args.server, timeout=args.timeout, token=env_token()) as client:
            health = client.health()
    except SpyglassError as e:
        print(f"spyglass: unhealthy: {args.server}: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    print(json.dumps(health))
    serving = [r["name"] for r in health.get("replicas", []) if r.get("total_kv_slots")]
    if not serving:
        print(f"spyglass: unhealthy: {args.server}: no verifier replica is serving", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spyglass", description="lossless speculative decoding for long contexts")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_health(sub)
    _add_training(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve":
            return _run_serve(args)
        if args.command == "health":
            return _run_health(args)
        if args.command in ("extract", "train"):
            return _run_training_command(args)
    except CliError as e:
        print(f"spyglass: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
