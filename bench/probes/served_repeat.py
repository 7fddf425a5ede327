"""A long prompt sent twice through `spyglass serve`'s OpenAI route (streamed, greedy, 128 new tokens, plain
decoding), then once more with `suffix`: the first request's decode with and without the context cache's write of
its prompt (`cache_min_uses` 1: every prompt's blocks written to Redis while it decodes; 2: only a prefix that comes
back), and the repeat's time to first token (its prefix from the KV slot the first one released). The `copy` load's
editing prompts (~6.8K tokens); a server per setting, the settings' order alternating by round.

    python bench/probes/served_repeat.py [--dtype bfloat16] [--prompts 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import machine_load, wait_for_quiet, write_results  # noqa: E402
from bench.load import start_spyglass, workloads  # noqa: E402
from spyglass.cost import cpu_model  # noqa: E402
from spyglass.models.loader import load_tokenizer, resolve_model  # noqa: E402


def stream(base_url: str, prompt: str, method: str, max_tokens: int) -> dict:
    """One streamed completion: time to its first chunk, the rest's seconds, the chunks and the text."""
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "method": method,
    }
    req = urllib.request.Request(
        f"{base_url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0, times, text = time.perf_counter(), [], []
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter() - t0)
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return {"ttft_s": round(times[0], 3), "decode_s": round(times[-1] - times[0], 3), "chunks": len(times),
            "text": "".join(text)}  # fmt: skip


def serve_once(args, model_dir: Path, logs: Path, prompts: list[str], min_uses: int) -> list[dict]:
    args.cache_min_uses = min_uses
    server, _ = start_spyglass(args, model_dir, logs, f"uses{min_uses}")
    rows = []
    try:
        server.wait_ready(args.ready_timeout)
        for i, prompt in enumerate(prompts):
            for method, what in (("ar", "first"), ("ar", "repeat"), ("suffix", "repeat")):
                row = {"min_uses": min_uses, "prompt": i, "method": method, "what": what}
                row.update(stream(server.base_url, prompt, method, args.max_new_tokens))
                print({k: v for k, v in row.items() if k != "text"}, flush=True)
                rows.append(row)
                time.sleep(args.gap_s)  # the writer's work (if any) done before the next request
    finally:
        server.stop()
    return rows


def main() -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gap-s", type=float, default=10.0)
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--name", default="served_repeat")
    args = ap.parse_args()
    args.max_batch, args.prefill_step_s = 16, None  # as bench/load.py serves
    resolved = resolve_model(None, dtype=args.dtype)
    prompts = workloads(load_tokenizer(resolved.path), False, 4)["copy"][: args.prompts]
    quiet = wait_for_quiet(max_load=1.0, timeout_s=300)
    rows = []
    with tempfile.TemporaryDirectory(prefix="served-repeat-") as tmp:
        for r in range(args.rounds):
            for uses in (2, 1) if r % 2 == 0 else (1, 2):
                rows += serve_once(args, Path(resolved.path), Path(tmp), prompts, uses)

    def med(uses: int, what: str, method: str, key: str) -> float:
        return statistics.median(
            x[key] for x in rows if (x["min_uses"], x["what"], x["method"]) == (uses, what, method)
        )

    texts = {(x["prompt"], x["method"]): set() for x in rows}
    for x in rows:
        texts[x["prompt"], x["method"]].add(x["text"])
    figures = {
        "first_decode_s_uses1": med(1, "first", "ar", "decode_s"),
        "first_decode_s_uses2": med(2, "first", "ar", "decode_s"),
        "first_decode_uses1_vs_uses2": round(med(1, "first", "ar", "decode_s") / med(2, "first", "ar", "decode_s"), 3),
        "first_ttft_s": med(2, "first", "ar", "ttft_s"),
        "repeat_ttft_s": med(2, "repeat", "ar", "ttft_s"),
        "outputs_equal": all(len(t) == 1 for t in texts.values())
        and all(texts[p, "ar"] == texts[p, "suffix"] for p in range(len(prompts))),
    }
    meta = {
        "what": "a long prompt twice through the OpenAI route: the first's decode with the cache write on or off, "
        "the repeat's time to first token",
        "cpu": cpu_model(),
        "dtype": args.dtype,
        "prompt_chars": [len(p) for p in prompts],
        "max_new_tokens": args.max_new_tokens,
        "quiet_before": quiet,
        "load_after": machine_load(),
    }
    path = write_results(
        args.name, figures, {"runs": [{k: v for k, v in x.items() if k != "text"} for x in rows]}, meta
    )
    print(path, figures)
    return path


if __name__ == "__main__":
    main()
