"""What the scheduling priority of a local cluster's processes costs a served prompt. One `spyglass serve`; before
each request the probe sets every thread of its processes to one of three settings (it needs root to lower a nice
value again): `ray` (Ray's own: workers at nice 15, its daemons and the raylet at 0), `even` (all at 0), and
`low` (workers at 0; Ray's daemons, Serve's controller and the driver at 19).
Long held-out prompts through the OpenAI route (streamed, greedy, plain decoding), each made unique by a leading
line so that no slot or cache holds its prefix; the settings rotate request by request.

    sudo python bench/probes/served_priority.py [--prompts 3] [--rounds 2] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import machine_load, wait_for_quiet, write_results  # noqa: E402
from bench.load import start_spyglass, workloads  # noqa: E402
from bench.probes.served_repeat import stream  # noqa: E402
from spyglass.cost import cpu_model  # noqa: E402
from spyglass.models.loader import load_tokenizer, resolve_model  # noqa: E402

WORKER_TITLES = ("ray::ServeReplica", "ray::ProxyActor", "ray::IDLE", "ray::ServeController")
# Processes no request passes through: Ray's GCS, monitors, dashboard and agents (not the raylet: it starts workers)
DAEMONS = ("gcs_server", "monitor.py", "dashboard.py", "ray::DashboardAgent", "ray::RuntimeEnvAgent")
SETTINGS = {  # setting -> (workers' nice, daemons' nice, the raylet's and the driver's nice)
    "ray": (15, 0, 0),
    "even": (0, 0, 0),
    "low": (0, 19, 0),
}


def apply(root: int, setting: str) -> None:
    workers, daemons, rest = SETTINGS[setting]
    top = psutil.Process(root)
    for proc in [top, *top.children(recursive=True)]:
        try:
            cmd = " ".join(proc.cmdline())
            if cmd.startswith("ray::ServeController"):
                nice = daemons if setting == "low" else workers
            elif cmd.startswith(WORKER_TITLES):
                nice = workers
            elif any(d in cmd for d in DAEMONS) or (proc is top and setting == "low"):
                nice = daemons
            elif "redis-server" in cmd:
                continue
            else:
                nice = rest
            for t in proc.threads():
                os.setpriority(os.PRIO_PROCESS, t.id, nice)
        except psutil.Error:
            continue


def main() -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--name", default="served_priority")
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("run as root: the probe sets nice values back down")
    args.max_batch, args.prefill_step_s, args.cache_min_uses = 16, None, None  # as bench/load.py serves
    resolved = resolve_model(None, dtype=args.dtype)
    prompts = workloads(load_tokenizer(resolved.path), False, 4)["long"][: args.prompts]
    quiet = wait_for_quiet(max_load=1.0, timeout_s=300)
    rows = []
    n = 0
    with tempfile.TemporaryDirectory(prefix="served-priority-") as tmp:
        server, _ = start_spyglass(args, Path(resolved.path), Path(tmp), "priority")
        try:
            server.wait_ready(args.ready_timeout)
            stream(server.base_url, "Warm up.", "ar", 4)
            names = list(SETTINGS)
            for r in range(args.rounds):
                for i, prompt in enumerate(prompts):
                    for k in range(len(names)):
                        setting = names[(k + i + r) % len(names)]  # each setting first, second and third in turn
                        apply(server.proc.pid, setting)
                        n += 1
                        row = {"setting": setting, "prompt": i, "round": r}
                        row.update(stream(server.base_url, f"[{n}]\n{prompt}", "ar", args.max_new_tokens))
                        row.pop("text")
                        print(row, flush=True)
                        rows.append(row)
        finally:
            server.stop()

    def total(setting: str, key: str) -> float:
        runs = [[x[key] for x in rows if (x["setting"], x["round"]) == (setting, r)] for r in range(args.rounds)]
        return statistics.median(sum(run) for run in runs)

    figures = {}
    for s in SETTINGS:
        figures[f"ttft_{s}_vs_ray"] = round(total(s, "ttft_s") / total("ray", "ttft_s"), 3)
        figures[f"decode_{s}_vs_ray"] = round(total(s, "decode_s") / total("ray", "decode_s"), 3)
    meta = {
        "what": "served prompts' time to first token and decode under three nice settings of the cluster",
        "settings": SETTINGS,
        "cpu": cpu_model(),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "prompt_chars": [len(p) for p in prompts],
        "quiet_before": quiet,
        "load_after": machine_load(),
    }
    path = write_results(args.name, figures, {"runs": rows}, meta)
    print(path, figures)
    return path


if __name__ == "__main__":
    main()
