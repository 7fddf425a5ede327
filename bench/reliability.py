"""`make reliability`: faults and load against a real local serving stack (loopback only); not part of `make test`.

Sections (run all, or some with `--only load,redis,...`), each recorded in bench/results/reliability.json:

- load:     N requests (default 200) at concurrency C (default 16), mixed prompt lengths, methods (ngram, suffix,
            ar), streaming and unary; no errors, every greedy output equal to plain decoding (computed in this
            process), p50/p99 latency and aggregate decode tok/s.
- queue:    a burst beyond the admission bound: the excess gets RESOURCE_EXHAUSTED quickly; replica memory before
            and after.
- corrupt:  every cached block of a prompt corrupted in Redis: the next request detects it, ignores it (same
            output, nothing reused) and the one after uses the cache again.
- redis:    Redis killed mid-run: requests go on as cache misses with no client error; Redis back on the same
            port: the cache is used again.
- verifier: the verifier replica killed (SIGKILL) mid-stream: the client's status, message and how long it took;
            Serve restarts the replica and the next request succeeds (time to recovery).
- gateway:  the gateway replica killed: a client created before it gets through by the SDK's retry.
- sigterm:  `spyglass serve` started as users do, SIGTERM mid-stream: exit time, the stream's outcome, and no
            process of it left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from services.local_redis import free_port  # noqa: E402
from spyglass.client import AsyncClient, Client, SpyglassError  # noqa: E402

SECTIONS = ("load", "queue", "corrupt", "redis", "gateway", "verifier", "sigterm")
MAX_CONTEXT = 2048
MAX_BATCH = 4
MAX_QUEUED = 16
METHODS = ["ngram", "suffix", "ar"]
RAY_INTERNALS = ("Traceback", "RayTaskError", "ActorID", "actor_id", "ray::", "ServeReplica", "node_ip", "pid=")


def log(msg: str) -> None:
    print(f"[reliability {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- a restartable redis-server on a fixed loopback port --------------------------------------------------------
class Redis:
    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="spyglass-rel-redis-"))
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--daemonize", "yes", "--dir", str(self.dir), "--pidfile", str(self.dir / "redis.pid")]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        import redis

        for _ in range(100):
            try:
                redis.Redis(host="127.0.0.1", port=self.port).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        pidfile = self.dir / "redis.pid"
        for _ in range(100):
            if pidfile.exists():
                break
            time.sleep(0.05)
        pid = int(pidfile.read_text())
        os.kill(pid, signal.SIGKILL)
        pidfile.unlink(missing_ok=True)
        for _ in range(100):
            try:
                os.kill(pid, 0)
                time.sleep(0.05)
            except ProcessLookupError:
                return

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)


# --- prompts and references --------------------------------------------------------------------------------------
def prompts() -> list[str]:
    """Mixed lengths (about 20 to 700 tokens): short instructions and pieces of standard-library code."""
    from spyglass.demo import code_edit_task

    short = [
        "List the days of the week, one per line.",
        "Count from one to twenty in words, separated by commas.",
        "Write the alphabet in capital letters separated by spaces.",
        "Name the planets of the solar system in order from the Sun.",
    ]
    code = [code_edit_task(m, max_chars=c).prompt for m, c in [("textwrap.py", 600), ("shlex.py", 1200)]]
    code += [code_edit_task(m, max_chars=c).prompt for m, c in [("fnmatch.py", 1800), ("colorsys.py", 2400)]]
    return short + code


def references(texts: list[str], n: int, lengths: list[int] | None = None) -> list[list[int]]:
    """Plain greedy decoding in this process (the oracle), fp32 like the served model; `lengths` gets the prompts'
    token counts."""
    import torch

    from bench.common import load_model
    from services.verifier import encode_prompt
    from spyglass.engine import plain_generate
    from spyglass.sampling import SamplingParams

    model, tok, _ = load_model(threads=1)
    params = SamplingParams(max_new_tokens=n)
    ids = [encode_prompt(tok, t, raw=False) for t in texts]
    if lengths is not None:
        lengths.extend(len(x) for x in ids)
    with torch.inference_mode():
        return [plain_generate(model, x, params) for x in ids]


def expected(ref: list[int], n: int) -> list[int]:
    return ref[:n]


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))] if v else float("nan")


def user_facing(details: str) -> bool:
    return bool(details) and not any(s in details for s in RAY_INTERNALS)


# --- the stack -----------------------------------------------------------------------------------------------
def start_stack(redis_url: str) -> str:
    from services.app import deploy, start_local_ray, wait_ready

    start_local_ray(num_cpus=4)
    args = {
        "num_verifiers": 1,
        "redis_url": redis_url,
        "gateway": {"max_queued": MAX_QUEUED},
        "verifier": {
            "methods": METHODS,
            "max_batch": MAX_BATCH,
            "max_context": MAX_CONTEXT,
            "threads": 1,
            "max_new_tokens_limit": 1024,
            "cache_block_size": 64,
        },
    }
    doc = {"applications": [{"name": "spyglass", "route_prefix": "/", "args": args}]}
    address, _ = deploy(doc, grpc_port=free_port(), http_port=free_port())
    wait_ready(address, timeout_s=900)
    return address


def replica_pid(deployment: str) -> int:
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name="spyglass").process_id.remote().result(timeout_s=60)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# --- sections ------------------------------------------------------------------------------------------------
def section_load(address: str, n_requests: int, concurrency: int) -> dict:
    texts = prompts()
    lengths = [8, 16, 24]
    log(f"load: plain-decoding references for {len(texts)} prompts")
    prompt_tokens: list[int] = []
    refs = references(texts, max(lengths), prompt_tokens)
    plan = [(k % len(texts), METHODS[k % 3], lengths[(k // 3) % 3], k % 2 == 0) for k in range(n_requests)]
    results: list[dict] = []

    async def one(c: AsyncClient, sem: asyncio.Semaphore, k: int) -> None:
        p, method, n, stream = plan[k]
        async with sem:
            t0 = time.perf_counter()
            try:
                if stream:
                    ids, stats = [], {}
                    async for ch in c.generate(texts[p], max_new_tokens=n, method=method):
                        ids += ch.token_ids
                        if ch.final:
                            stats = ch.stats or {}
                else:
                    out = await c.generate_text(texts[p], max_new_tokens=n, method=method)
                    ids, stats = out.token_ids, out.stats
                err = None
            except SpyglassError as e:
                ids, stats, err = [], {}, f"{e.code.name}: {e.details}"
            results.append(
                {
                    "k": k,
                    "prompt": p,
                    "method": method,
                    "stream": stream,
                    "latency_s": time.perf_counter() - t0,
                    "tokens": len(ids),
                    "identical": ids == expected(refs[p], n),
                    "error": err,
                    "decode_s": stats.get("decode_time_s", 0.0),
                    "cached": stats.get("cached_prefix_tokens", 0),
                }
            )

    async def main() -> float:
        sem = asyncio.Semaphore(concurrency)
        async with AsyncClient(address, timeout=900) as c:
            t0 = time.perf_counter()
            await asyncio.gather(*(one(c, sem, k) for k in range(n_requests)))
            return time.perf_counter() - t0

    log(f"load: {n_requests} requests at concurrency {concurrency}")
    wall = asyncio.run(main())
    lat = [r["latency_s"] for r in results]
    errors = [r for r in results if r["error"]]
    mismatched = [r for r in results if not r["error"] and not r["identical"]]
    tokens = sum(r["tokens"] for r in results)
    by_method = {
        m: {
            "requests": sum(r["method"] == m for r in results),
            "p50_latency_s": pct([r["latency_s"] for r in results if r["method"] == m], 50),
        }
        for m in METHODS
    }
    return {
        "requests": n_requests,
        "concurrency": concurrency,
        "prompt_tokens": prompt_tokens,
        "max_new_tokens": lengths,
        "errors": len(errors),
        "error_examples": [r["error"] for r in errors[:5]],
        "greedy_identical": len(results) - len(errors) - len(mismatched),
        "greedy_mismatched": len(mismatched),
        "mismatch_examples": [{k: r[k] for k in ("k", "prompt", "method", "stream")} for r in mismatched[:5]],
        "wall_s": wall,
        "p50_latency_s": pct(lat, 50),
        "p99_latency_s": pct(lat, 99),
        "max_latency_s": max(lat) if lat else float("nan"),
        "generated_tokens": tokens,
        "aggregate_tokens_per_s": tokens / wall if wall else float("nan"),
        "requests_with_cached_prefix": sum(r["cached"] > 0 for r in results),
        "by_method": by_method,
        "ok": not errors and not mismatched,
    }


def section_queue(address: str) -> dict:
    pid = replica_pid("Verifier0")
    rss_before = rss_mb(pid)
    burst = MAX_BATCH + MAX_QUEUED + 8
    outcomes: list[tuple[str, float]] = []

    async def one(c: AsyncClient, k: int) -> None:
        t0 = time.perf_counter()
        try:
            await c.generate_text(f"Request {k}: count from one to ten.", max_new_tokens=24, ignore_eos=True)
            outcomes.append(("ok", time.perf_counter() - t0))
        except SpyglassError as e:
            outcomes.append((e.code.name, time.perf_counter() - t0))

    async def main() -> None:
        async with AsyncClient(address, timeout=900, retries=0) as c:
            await asyncio.gather(*(one(c, k) for k in range(burst)))

    log(f"queue: a burst of {burst} requests (bound {MAX_BATCH} in flight + {MAX_QUEUED} queued)")
    asyncio.run(main())
    rejected = [t for s, t in outcomes if s == "RESOURCE_EXHAUSTED"]
    return {
        "burst": burst,
        "ok": sum(s == "ok" for s, _ in outcomes),
        "resource_exhausted": len(rejected),
        "other": sorted({s for s, _ in outcomes} - {"ok", "RESOURCE_EXHAUSTED"}),
        "max_reject_latency_s": max(rejected) if rejected else None,
        "replica_rss_mb_before": rss_before,
        "replica_rss_mb_after": rss_mb(pid),
        "pass": len(rejected) >= burst - MAX_BATCH - MAX_QUEUED and (max(rejected) if rejected else 9) < 5.0,
    }


def long_prompt(tag: str) -> str:
    from spyglass.demo import code_edit_task

    return f"# {tag}\n" + code_edit_task("shlex.py", max_chars=1500).prompt


def section_corrupt(address: str, redis: Redis) -> dict:
    r = redis.client()
    prompt = long_prompt(f"corrupt-{time.time_ns()}")
    with Client(address, timeout=900) as c:
        first = c.generate_text(prompt, max_new_tokens=12)
        time.sleep(2.0)  # blocks are written asynchronously after prefill
        keys = [k for k in r.scan_iter("spyglass:ctx:*") if r.type(k) == b"string"]
        for k in keys:
            v = r.get(k)
            r.set(k, v[:-1] + bytes([v[-1] ^ 0xFF]))
        second = c.generate_text(prompt, max_new_tokens=12)
        time.sleep(2.0)
        third = c.generate_text(prompt, max_new_tokens=12)
    return {
        "corrupted_blocks": len(keys),
        "first_cached": first.stats["cached_prefix_tokens"],
        "after_corruption_cached": second.stats["cached_prefix_tokens"],
        "after_corruption_identical": second.token_ids == first.token_ids,
        "next_cached": third.stats["cached_prefix_tokens"],
        "pass": second.token_ids == first.token_ids
        and second.stats["cached_prefix_tokens"] == 0
        and third.stats["cached_prefix_tokens"] > 0,
    }


def section_redis(address: str, redis: Redis) -> dict:
    out: dict = {}
    errors = []
    with Client(address, timeout=900) as c:
        warm = long_prompt(f"redis-{time.time_ns()}")
        c.generate_text(warm, max_new_tokens=4)
        # a stream in flight while Redis dies
        stream = c.generate(long_prompt(f"redis-mid-{time.time_ns()}"), max_new_tokens=32, ignore_eos=True)
        next(stream)
        redis.kill()
        t0 = time.perf_counter()
        try:
            rest = list(stream)
            out["in_flight_stream"] = rest[-1].finish_reason
        except SpyglassError as e:
            errors.append(f"{e.code.name}: {e.details}")
        misses = []
        for k in range(3):
            try:
                res = c.generate_text(long_prompt(f"redis-down-{k}-{time.time_ns()}"), max_new_tokens=8)
                misses.append(res.stats["cached_prefix_tokens"])
            except SpyglassError as e:
                errors.append(f"{e.code.name}: {e.details}")
        try:  # the prompt cached before the outage: now a miss, not an error
            res = c.generate_text(warm, max_new_tokens=4)
            misses.append(res.stats["cached_prefix_tokens"])
        except SpyglassError as e:
            errors.append(f"{e.code.name}: {e.details}")
        out["down_requests_s"] = time.perf_counter() - t0
        out["cached_tokens_while_down"] = misses
        redis.start()
        back = long_prompt(f"redis-back-{time.time_ns()}")
        c.generate_text(back, max_new_tokens=4)
        time.sleep(2.0)
        again = c.generate_text(back, max_new_tokens=4)
    out["cached_after_restart"] = again.stats["cached_prefix_tokens"]
    out["client_errors"] = errors
    out["pass"] = not errors and all(m == 0 for m in misses) and out["cached_after_restart"] > 0
    return out


def section_verifier(address: str) -> dict:
    pid = replica_pid("Verifier0")
    out: dict = {"killed_pid": pid}
    got: dict = {}

    def consume() -> None:
        with Client(address, timeout=900, retries=0) as c:
            n = 0
            try:
                for ch in c.generate(long_prompt(f"kill-{time.time_ns()}"), max_new_tokens=600, ignore_eos=True):
                    n += len(ch.token_ids)
                    if n >= 8 and "t_tokens" not in got:
                        got["t_tokens"] = time.monotonic()
                got["outcome"] = "finished"
            except SpyglassError as e:
                got["outcome"] = e.code.name
                got["details"] = e.details
            got["t_end"] = time.monotonic()
            got["tokens"] = n

    th = threading.Thread(target=consume)
    th.start()
    while "t_tokens" not in got and th.is_alive():
        time.sleep(0.05)
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    th.join(timeout=600)
    out["client_status"] = got.get("outcome")
    out["client_message"] = got.get("details")
    out["tokens_before_kill"] = got.get("tokens")
    out["error_after_kill_s"] = got["t_end"] - t_kill if "t_end" in got else None
    with Client(address, timeout=900, retries=60, retry_backoff_s=1.0) as c:
        while True:
            try:
                res = c.generate_text("List the days of the week, one per line.", max_new_tokens=8)
                break
            except SpyglassError as e:
                if time.monotonic() - t_kill > 900:
                    out["recovery_error"] = f"{e.code.name}: {e.details}"
                    res = None
                    break
                time.sleep(1.0)
    out["next_request_ok_after_s"] = time.monotonic() - t_kill if res else None
    out["new_pid"] = replica_pid("Verifier0")
    out["pass"] = (
        out["client_status"] in ("UNAVAILABLE", "ABORTED")
        and user_facing(out["client_message"] or "")
        and (out["error_after_kill_s"] or 99) < 30
        and res is not None
        and out["new_pid"] != pid
    )
    return out


def section_gateway(address: str) -> dict:
    pid = replica_pid("Gateway")
    with Client(address, timeout=900, retries=30, retry_backoff_s=0.5) as c:
        c.generate_text("Say hello.", max_new_tokens=2)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        try:
            res = c.generate_text("List the days of the week, one per line.", max_new_tokens=8)
            err = None
        except SpyglassError as e:
            res, err = None, f"{e.code.name}: {e.details}"
        took = time.monotonic() - t0
    new_pid = replica_pid("Gateway")
    return {
        "killed_pid": pid,
        "new_pid": new_pid,
        "request_after_kill_s": took,
        "error": err,
        "pass": res is not None and new_pid != pid,
    }


def section_sigterm() -> dict:
    from services.app import descendants

    cfg = Path(tempfile.mkdtemp(prefix="spyglass-rel-")) / "serve.yaml"
    import yaml

    doc = yaml.safe_load((REPO / "infra" / "serve_config.yaml").read_text())
    v = doc["applications"][0]["args"]["verifier"]
    v.update(methods=["ngram"], max_context=MAX_CONTEXT, threads=1, max_batch=2, warmup_prompt_tokens=200)
    cfg.write_text(yaml.safe_dump(doc))
    port, http = free_port(), free_port()
    cmd = [sys.executable, "-m", "spyglass", "serve", "--config", str(cfg), "--no-demo"]
    cmd += ["--port", str(port), "--http-port", str(http)]
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    logf = open(cfg.parent / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    from services.app import wait_ready

    wait_ready(address, timeout_s=900)
    tree = descendants(proc.pid)
    got: dict = {}

    def consume() -> None:
        with Client(address, timeout=300, retries=0) as c:
            try:
                chunks = list(c.generate(long_prompt("sigterm"), max_new_tokens=40, ignore_eos=True))
                got["outcome"] = chunks[-1].finish_reason
            except SpyglassError as e:
                got["outcome"] = f"{e.code.name}: {e.details}"

    th = threading.Thread(target=consume)
    th.start()
    time.sleep(3.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        code = None
    exit_s = time.monotonic() - t0
    th.join(timeout=60)
    time.sleep(2.0)
    left = []
    for p in tree:
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] != "Z":
                left.append({"pid": p, "cmd": Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:120]})
        except OSError:
            pass
    if code is None:  # clean up our own child before reporting the failure
        proc.kill()
    for p in left:  # processes of the serve command we started: never leave them behind
        try:
            os.kill(p["pid"], signal.SIGKILL)
        except OSError:
            pass
    return {
        "processes_under_serve": len(tree),
        "exit_code": code,
        "exit_after_sigterm_s": exit_s,
        "in_flight_stream": got.get("outcome"),
        "left_behind": [dict(x, cmd=x["cmd"].decode(errors="replace")) for x in left],
        "pass": code == 0 and not left and got.get("outcome") in ("length", "stop"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "reliability.json"))
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    from spyglass.cost import cpu_model

    report: dict = {"cpu": cpu_model(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sections": {}}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out_path.write_text(json.dumps(report, indent=1, default=str))

    stack_sections = [s for s in only if s != "sigterm"]
    redis = None
    if stack_sections:
        redis = Redis()
        t0 = time.monotonic()
        log("starting the stack (Ray on loopback, Serve, gateway + verifier, Redis)")
        address = start_stack(redis.url)
        report["stack_start_s"] = time.monotonic() - t0
        try:
            for name in stack_sections:
                log(f"section {name}")
                t = time.monotonic()
                try:
                    if name == "load":
                        res = section_load(address, args.requests, args.concurrency)
                    elif name == "queue":
                        res = section_queue(address)
                    elif name == "corrupt":
                        res = section_corrupt(address, redis)
                    elif name == "redis":
                        res = section_redis(address, redis)
                    elif name == "verifier":
                        res = section_verifier(address)
                    else:
                        res = section_gateway(address)
                except (SpyglassError, grpc.RpcError, RuntimeError, TimeoutError, OSError) as e:
                    res = {"pass": False, "exception": f"{type(e).__name__}: {e}"}
                res["section_s"] = time.monotonic() - t
                report["sections"][name] = res
                log(f"{name}: {json.dumps(res, default=str)[:600]}")
                save()
        finally:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
            try:
                redis.kill()
            except (OSError, ValueError):
                pass
    if "sigterm" in only:
        log("section sigterm")
        t = time.monotonic()
        res = section_sigterm()
        res["section_s"] = time.monotonic() - t
        report["sections"]["sigterm"] = res
        log(f"sigterm: {json.dumps(res, default=str)[:600]}")
    report["pass"] = all(r.get("pass", r.get("ok", False)) for r in report["sections"].values())
    save()
    print(json.dumps({k: v.get("pass", v.get("ok")) for k, v in report["sections"].items()}))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
