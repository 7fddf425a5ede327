"""What sending each step's tokens as its own chunk costs served decoding, against `stream_interval_s` (the most often
a stream sends). A `spyglass serve` per setting, the settings alternating server by server (A B B A ...); on each,
long held-out prompts (cut to `--prompt-tokens`) are read once, then decoded again from the slot they left (no
prefill to speak of) through the OpenAI route, streamed, greedy, plain decoding (`ar`: a token a step), one stream
at a time and `--streams` at once. Each setting's decode seconds are summed per server; the figures are the medians'
ratios to the first setting's (every step's chunk sent).

    python bench/probes/stream_interval.py [--intervals 0,0.05] [--servers 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import wait_for_quiet, write_results  # noqa: E402
from bench.load import start_spyglass, workloads  # noqa: E402
from bench.probes.served_repeat import stream  # noqa: E402
from spyglass.models.loader import load_tokenizer, resolve_model  # noqa: E402


def decode_seconds(base_url: str, prompts: list[str], streams: int, max_tokens: int) -> tuple[float, int]:
    """The prompts decoded `streams` at a time: the sum of their decode seconds, and of their chunks."""
    rows: list[dict] = []

    def one(prompt: str) -> None:
        rows.append(stream(base_url, prompt, "ar", max_tokens))

    for i in range(0, len(prompts), streams):
        threads = [threading.Thread(target=one, args=(p,)) for p in prompts[i : i + streams]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return sum(r["decode_s"] for r in rows), sum(r["chunks"] for r in rows)


def main() -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--intervals", default="0,0.05", help="stream_interval_s settings; the first is the baseline")
    ap.add_argument("--servers", type=int, default=2, help="servers per setting")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--name", default="stream_interval")
    args = ap.parse_args()
    args.max_batch, args.prefill_step_s, args.cache_min_uses = 16, None, None  # as bench/load.py serves
    intervals = [float(x) for x in args.intervals.split(",")]
    resolved = resolve_model(None, dtype=args.dtype)
    tok = load_tokenizer(resolved.path)
    long = workloads(tok, False, 4)["long"][: args.prompts]
    prompts = [tok.decode(tok.encode(p)[: args.prompt_tokens]) for p in long]
    quiet = wait_for_quiet(max_load=1.0, timeout_s=300)
    order = [intervals[(k + k // len(intervals)) % len(intervals)] for k in range(args.servers * len(intervals))]
    rows = []
    with tempfile.TemporaryDirectory(prefix="stream-interval-") as tmp:
        for k, interval in enumerate(order):
            args.stream_interval_s = interval
            server, _ = start_spyglass(args, Path(resolved.path), Path(tmp), f"interval{k}")
            try:
                server.wait_ready(args.ready_timeout)
                for p in prompts:  # read once: each prompt's K/V left in a released slot
                    stream(server.base_url, p, "ar", 1)
                row = {"interval_s": interval, "server": k}
                for streams in (1, args.streams):
                    seconds, chunks = decode_seconds(server.base_url, prompts, streams, args.max_new_tokens)
                    row[f"decode_s_{streams}"], row[f"chunks_{streams}"] = round(seconds, 3), chunks
                print(row, flush=True)
                rows.append(row)
            finally:
                server.stop()

    def median(interval: float, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["interval_s"] == interval)

    figures = {}
    for interval in intervals[1:]:
        for streams in (1, args.streams):
            key = f"decode_s_{streams}"
            figures[f"decode_{interval}_vs_{intervals[0]}_streams{streams}"] = round(
                median(interval, key) / median(intervals[0], key), 3
            )
    meta = {  # write_results adds the CPU model (`environment`) and the load at the end (`load_at_write`)
        "what": "served plain decoding's seconds by stream_interval_s (chunks sent at most that often)",
        "dtype": args.dtype,
        "order": order,
        "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "quiet_before": quiet,
    }
    path = write_results(args.name, figures, {"runs": rows}, meta)
    print(path, figures)
    return path


if __name__ == "__main__":
    main()
