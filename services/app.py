"""Build the Serve application from a config, and run the whole stack locally (`spyglass serve`).

`infra/serve_config.yaml` is a regular Ray Serve config file: `serve deploy` and KubeRay's
`serveConfigV2` use it as is (the application's `import_path` is `services.app:build_app`, its `args`
this module's options), and `spyglass serve --config` reads the same file to start a local
loopback-only Ray cluster, a local redis-server when none is configured, Serve with the gRPC proxy,
and then sends the demo long-context request through the SDK.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import serve
from ray.serve.config import gRPCOptions

from services import grpc_bind
from services.gateway import Gateway
from services.local_redis import LocalRedis
from services.verifier import Verifier
from spyglass.client import AUTH_TOKEN_ENV, Client, SpyglassError, env_token
from spyglass.demo import code_edit_task

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "infra" / "serve_config.yaml"
SERVICER = "services.grpc_api.add_SpyglassServicer_to_server"
APP_NAME = "spyglass"
# Where the context cache lives when the config names no Redis (`redis_url: null`): set on the pods by
# infra/k8s/rayservice.yaml, so the Serve config stays the same file locally and on Kubernetes.
REDIS_URL_ENV = "SPYGLASS_REDIS_URL"


def redis_url(args: dict[str, Any]) -> str | None:
    """The Redis URL a config resolves to: `verifier.redis_url`, else `redis_url`, else $SPYGLASS_REDIS_URL."""
    vcfg = args.get("verifier") or {}
    return vcfg.get("redis_url") or args.get("redis_url") or os.environ.get(REDIS_URL_ENV) or None


def verifier_actor_options(args: dict[str, Any]) -> dict[str, Any]:
    """One GPU per replica when the cluster has GPUs, else `num_cpus` CPUs."""
    opts: dict[str, Any] = {"num_cpus": float(args.get("verifier_num_cpus", 1))}
    want_gpu = args.get("verifier_num_gpus", "auto")
    if want_gpu == "auto":
        want_gpu = 1 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1 else 0
    if want_gpu:
        opts["num_gpus"] = int(want_gpu)
    return opts


def build_app(args: dict[str, Any] | None = None):
    """Application builder (Serve `import_path`): `num_verifiers` Verifier deployments behind one Gateway.

    Each verifier is its own deployment with one replica so the gateway can route with context
    affinity (Serve's router would spread requests at random among the replicas of one deployment).
    """
    args = dict(args or {})
    vcfg = dict(args.get("verifier") or {})
    url = redis_url(args)
    if url:
        vcfg["redis_url"] = url
    opts = verifier_actor_options(args)
    verifiers = [
        Verifier.options(name=f"Verifier{i}", ray_actor_options=opts).bind(vcfg, f"verifier-{i}")
        for i in range(int(args.get("num_verifiers", 1)))
    ]
    return Gateway.options(name="Gateway").bind(verifiers, args.get("gateway") or {})


# --- a local redis-server (the same approach as the tests', shipped here because tests/ is not) -----------
# --- the local stack ---------------------------------------------------------------------------------------------
def load_config(path: str | Path | None) -> dict[str, Any]:
    path = Path(path or DEFAULT_CONFIG)
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read serve config {path}: {e}") from e
    apps = doc.get("applications") or []
    if len(apps) != 1:
        raise ValueError(f"{path}: expected exactly one application, found {len(apps)}")
    return doc


# Largest gRPC message the proxy accepts (Serve's default is 2 GiB): a bigger one is RESOURCE_EXHAUSTED before
# it is read into memory. Prompts are limited further by the gateway (`max_prompt_chars`).
MAX_GRPC_MESSAGE_BYTES = 8 << 20


# Ray adds `worker_niceness` (15 by default) to the nice value of the process that starts the cluster, putting its
# workers (the replicas, the proxy, Serve's controller) below every other process on the machine (its own daemons,
# a benchmark client, a shell), each of which then preempts the engine's threads. A local cluster adds 0: its
# workers run at the starting process's nice value (BENCHMARKS.md, "Which of the server's processes cost it").
WORKER_NICENESS = 0


def start_local_ray(num_cpus: int | None = None) -> None:
    """A local cluster on loopback (services/__init__.py sets the env var for it; usage stats off), its workers
    WORKER_NICENESS nice steps below the calling process."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(MAX_GRPC_MESSAGE_BYTES))  # inherited by the proxy
    if not ray.is_initialized():
        ray.init(
            address="local",  # always a fresh cluster: never attach to a stale `ray start` one
            num_cpus=num_cpus or max(4, os.cpu_count() or 1),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            runtime_env=grpc_bind.runtime_env(),  # the gRPC proxy's host and TLS (services/grpc_bind.py)
            # no idle workers kept for later tasks: each one's main thread wakes ~100 times a second, and beside an
            # idle server an engine's prefill took ~4% longer with them than with them stopped (2 cores)
            _system_config={"worker_niceness": WORKER_NICENESS, "num_workers_soft_limit": 0},
        )


def deploy(
    doc: dict[str, Any],
    grpc_port: int | None = None,
    http_port: int | None = None,
    *,
    grpc_host: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> tuple[str, str]:
    """serve.start with the config's proxy options (loopback), then serve.run the application.

    The gRPC proxy listens on `grpc_host` (else $SPYGLASS_GRPC_HOST, else 127.0.0.1), with TLS when a PEM
    certificate and key are given (else $SPYGLASS_TLS_CERT / $SPYGLASS_TLS_KEY): see services/grpc_bind.py.
    Ray must have been started with `grpc_bind.runtime_env()` (as `start_local_ray` does).
    Returns the gRPC address a local client dials (host:port) and the HTTP base URL (OpenAI-compatible
    /v1/completions)."""
    grpc_bind.check()
    if not grpc_bind.hook_installed():
        raise RuntimeError(
            "Ray was started without spyglass's gRPC proxy hook (ray.init(runtime_env=grpc_bind.runtime_env()), "
            "as start_local_ray does): Serve's proxy would listen on every interface without TLS"
        )
    host, cert, key = grpc_bind.settings(grpc_host, tls_cert, tls_key)
    controller = {"runtime_env": {"env_vars": grpc_bind.controller_env(host, cert, key)}}
    grpc_cfg = dict(doc.get("grpc_options") or {})
    grpc_cfg["port"] = grpc_port or grpc_cfg.get("port", 9000)
    grpc_cfg["grpc_servicer_functions"] = grpc_cfg.get("grpc_servicer_functions") or [SERVICER]
    http_cfg = dict(doc.get("http_options") or {})
    http_cfg["host"] = http_cfg.get("host", "127.0.0.1")
    if http_port:
        http_cfg["port"] = http_port
    options = {"http_options": http_cfg, "grpc_options": gRPCOptions(**grpc_cfg), "controller_options": controller}
    try:
        serve.start(**options)
    except ray.exceptions.ActorDiedError as e:
        # Serve's controller kills a proxy that is slow to start and starts another, but serve.start waited on the
        # first one only (seen on cold 2-core machines): wait on the proxies the controller runs now, once
        print(
            f"spyglass: Serve's first proxy died while starting ({e.error_msg.splitlines()[0]}); retrying once",
            file=sys.stderr,
        )
        time.sleep(2.0)
        serve.start(**options)
    app = doc["applications"][0]
    args = dict(app.get("args") or {})
    serve.run(build_app(args), name=app.get("name", APP_NAME), route_prefix=app.get("route_prefix", "/"))
    return grpc_bind.dial_address(host, grpc_cfg["port"]), f"http://{http_cfg['host']}:{http_cfg.get('port', 8000)}"


def auth_token(app_args: dict[str, Any]) -> str | None:
    """The bearer token the application's gateway will require (the variable its config names, in this process's
    environment, which the local cluster's processes inherit): `spyglass serve`'s own requests send it."""
    return env_token((app_args.get("gateway") or {}).get("auth_token_env", AUTH_TOKEN_ENV))


def wait_ready(
    address: str, timeout_s: float = 300.0, tls: bool | bytes = False, token: str | None = None
) -> dict[str, Any]:
    t0 = time.monotonic()
    with Client(address, timeout=30, tls=tls, token=token) as c:
        while True:
            try:
                return c.model_info()
            except SpyglassError:
                if time.monotonic() - t0 > timeout_s:
                    raise
                time.sleep(1.0)


UNCACHED_MARK = "(Second request: the same task again.)\n"
FIRST_MARK = "(First request.)\n"
# The warm-up check's method: one with no memory across requests (suffix drafting reuses earlier outputs, which
# would make a repeat faster for a reason that is not a cold start).
WARM_CHECK_METHOD = "ngram"
# The trained draft the demo also shows, colocated with the target in the verifier replica (if served).
LEARNED_DEMO_METHOD = "longspec-span"


def first_vs_repeat(first: dict[str, Any], repeat: dict[str, Any]) -> dict[str, float]:
    """TTFT and decode rate of a first request next to a repeat's (ratios first/repeat: 1.0 = no cold start)."""
    out = {
        "first_ttft_s": float(first.get("ttft_s") or 0.0),
        "repeat_ttft_s": float(repeat.get("ttft_s") or 0.0),
        "first_tokens_per_s": float(first.get("tokens_per_s") or 0.0),
        "repeat_tokens_per_s": float(repeat.get("tokens_per_s") or 0.0),
    }
    out["ttft_ratio"] = out["first_ttft_s"] / out["repeat_ttft_s"] if out["repeat_ttft_s"] else float("nan")
    rate = out["repeat_tokens_per_s"]
    out["decode_ratio"] = out["first_tokens_per_s"] / rate if rate else float("nan")
    return out


def run_demo(
    address: str,
    max_new_tokens: int = 64,
    out=sys.stdout,
    repeat: bool = True,
    tls: bool | bytes = False,
    warm_method: str = WARM_CHECK_METHOD,
    learned_method: str = "",
    token: str | None = None,
) -> dict[str, Any]:
    """The long-context code-editing demo through the SDK: stream the text, then print the stats.
    `warm_method`: the warm-up check's method ("" = the server's default, when it does not serve ngram);
    `learned_method`: a trained draft to run the demo through once more ("" = none)."""
    task = code_edit_task()
    warm = None
    if repeat:
        # Warm-up check, sent first so that its first request is the replica's first: the same task under two
        # different first lines is the same work with no cached block in common (the cache keys chain the whole
        # prefix, so the demo below is not cached either), so the first request's TTFT and decode rate can be
        # compared with a repeat that pays no one-time cost.
        print(
            f"[spyglass] warm-up check: the demo task twice via {warm_method or 'the default method'}, uncached",
            file=sys.stderr,
        )
        with Client(address, tls=tls, token=token) as c:
            kw = dict(max_new_tokens=max_new_tokens, context_id=task.name, method=warm_method)
            first = c.generate_text(FIRST_MARK + task.prompt, **kw)
            fresh = c.generate_text(UNCACHED_MARK + task.prompt, **kw)
        warm = first_vs_repeat(first.stats, fresh.stats)
    print(f"[spyglass] demo {task.name}: streaming from {address}", file=sys.stderr)
    stats: dict[str, Any] = {}
    token_ids: list[int] = []
    with Client(address, tls=tls, token=token) as c:
        for chunk in c.generate(task.prompt, max_new_tokens=max_new_tokens, context_id=task.name):
            out.write(chunk.text)
            out.flush()
            token_ids += chunk.token_ids
            if chunk.final:
                stats = dict(chunk.stats or {}, finish_reason=chunk.finish_reason)
    print(file=out)
    print(
        f"[spyglass] {stats.get('generated_tokens')} tokens from a {stats.get('prompt_tokens')}-token prompt "
        f"via {stats.get('method')} on {stats.get('replica')}: tau {stats.get('tau', 0):.2f}, "
        f"decode {stats.get('tokens_per_s', 0):.1f} tok/s, TTFT {stats.get('ttft_s', 0):.2f} s, "
        f"cached prefix {stats.get('cached_prefix_tokens')} tokens, mean batch {stats.get('mean_batch_size', 0):.2f}, "
        f"latency {stats.get('latency_s', 0):.2f} s, finish={stats.get('finish_reason')}",
        file=sys.stderr,
    )
    acc = stats.get("acceptance_by_depth") or []
    print("[spyglass] acceptance by depth: " + " ".join(f"{a:.2f}" for a in acc[:8]), file=sys.stderr)
    if warm is not None:
        stats["warm_check"] = warm
        print(
            f"[spyglass] first vs repeated request on an uncached prompt ({fresh.stats['cached_prefix_tokens']} "
            f"cached tokens, {first.stats.get('method')}): TTFT {warm['first_ttft_s']:.2f} s vs "
            f"{warm['repeat_ttft_s']:.2f} s ({warm['ttft_ratio']:.2f}x), decode {warm['first_tokens_per_s']:.1f} vs "
            f"{warm['repeat_tokens_per_s']:.1f} tok/s ({warm['decode_ratio']:.2f}x)",
            file=sys.stderr,
        )
        # The same context again: its prefix K/V now come from the slot the demo request left (kept in memory until
        # another prompt needs it), else from the Redis context cache.
        with Client(address, tls=tls, token=token) as c:
            t0 = time.perf_counter()
            again = c.generate_text(task.prompt, max_new_tokens=8, context_id=task.name)
        print(
            f"[spyglass] repeated request: {again.stats['cached_prefix_tokens']} of {again.stats['prompt_tokens']} "
            f"prompt tokens reused (a released KV slot, else the context cache), TTFT {again.stats['ttft_s']:.2f} s "
            f"(first: {stats.get('ttft_s', 0):.2f} s), total {time.perf_counter() - t0:.2f} s",
            file=sys.stderr,
        )
    if learned_method:
        via = demo_via(address, task.prompt, learned_method, token_ids, max_new_tokens, task.name, tls, token)
        stats["learned_check"] = via
        print(
            f"[spyglass] the demo via {learned_method} (its trained draft runs in the verifier, reading the target's "
            f"KV cache): tau {via.get('tau', 0):.2f}, decode {via.get('tokens_per_s', 0):.1f} tok/s, "
            f"tokens identical to {stats.get('method')}'s: {via['identical']}",
            file=sys.stderr,
        )
    return stats


def demo_via(
    address: str,
    prompt: str,
    method: str,
    reference: list[int],
    max_new_tokens: int,
    context_id: str,
    tls: bool | bytes = False,
    token: str | None = None,
) -> dict[str, Any]:
    """The demo request through another drafting method: its stats, and whether its tokens are the reference's
    (greedy: every method gives plain decoding's tokens)."""
    with Client(address, tls=tls, token=token) as c:
        done = c.generate_text(prompt, max_new_tokens=max_new_tokens, context_id=context_id, method=method)
    return dict(done.stats, identical=done.token_ids == reference)


def serve_main(
    config: str | None = None,
    once: bool = False,
    port: int | None = None,
    http_port: int | None = None,
    demo_tokens: int = 64,
    no_demo: bool = False,
    grpc_host: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
) -> int:
    """`spyglass serve`: bring the stack up, run the demo, keep serving until Ctrl-C or SIGTERM (or exit with
    --once). SIGTERM (what Kubernetes and systemd send) shuts down like Ctrl-C: Serve drains its replicas
    (`graceful_shutdown_timeout_s`), Ray stops, the local redis-server stops, and any process this command
    started that is still alive after a grace period is killed, so nothing is left behind.

    The gRPC port listens on `grpc_host` (default 127.0.0.1), with TLS when `tls_cert`/`tls_key` are given
    (services/grpc_bind.py); this command's own requests then trust that certificate file. `device` overrides the
    verifiers' `device` ("cpu" also asks Ray for no GPU per replica)."""
    terminated = []

    def on_term(signum, frame):
        terminated.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    doc = load_config(config)
    grpc_host, tls_cert, tls_key = grpc_bind.settings(grpc_host, tls_cert, tls_key)
    grpc_bind.controller_env(grpc_host, tls_cert, tls_key)  # bad TLS files or host: fail before starting anything
    tls = Path(tls_cert).read_bytes() if tls_cert else False
    app_args = doc["applications"][0].setdefault("args", {})
    if device is not None:
        app_args.setdefault("verifier", {})["device"] = device
        if device == "cpu":
            app_args["verifier_num_gpus"] = 0
    if dtype is not None:  # --dtype overrides the config's verifier dtype
        app_args["verifier"] = {**(app_args.get("verifier") or {}), "dtype": dtype}
    token = auth_token(app_args)
    redis = None
    if not redis_url(app_args):
        if shutil.which("redis-server"):
            redis = LocalRedis()
            app_args["redis_url"] = redis.url
            print(f"[spyglass] started redis-server at {redis.url}", file=sys.stderr)
        else:
            print("[spyglass] no redis-server: the context cache is off", file=sys.stderr)
    address = None
    try:
        start_local_ray()
        # ray.init installs its own fatal-signal handler for SIGTERM (it dumps a stack and aborts, leaving the
        # cluster's agents behind): ours again, so SIGTERM shuts down cleanly
        signal.signal(signal.SIGTERM, on_term)
        address, http = deploy(doc, port, http_port, grpc_host=grpc_host, tls_cert=tls_cert, tls_key=tls_key)
        info = wait_ready(address, tls=tls, token=token)
        listen = grpc_bind.bind_address(address.rsplit(":", 1)[1], grpc_host)
        print(
            f"[spyglass] serving {info['model']} on gRPC {listen}{' (TLS)' if tls else ''} "
            f"and {http}/v1 (OpenAI: completions, chat/completions, models) "
            f"({info['num_verifiers']} verifier(s), "
            f"methods {', '.join(info['methods'])}, context {info['context_length']})",
            file=sys.stderr,
        )
        if not no_demo:
            warm_method = WARM_CHECK_METHOD if WARM_CHECK_METHOD in info["methods"] else ""
            learned = LEARNED_DEMO_METHOD if LEARNED_DEMO_METHOD in info["methods"] else ""
            run_demo(address, demo_tokens, tls=tls, warm_method=warm_method, learned_method=learned, token=token)
        if not once:
            print("[spyglass] serving; Ctrl-C to stop", file=sys.stderr)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("[spyglass] stopping" + (": draining requests" if terminated else ""), file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        if terminated and address is not None:
            left = drain(address, DRAIN_TIMEOUT_S, tls=tls, token=token)
            print(
                f"[spyglass] drained ({left} request(s) still running)" if left else "[spyglass] drained",
                file=sys.stderr,
            )
        started = descendants(os.getpid())
        try:
            serve.shutdown()
        except Exception as e:  # noqa: BLE001 - shutting down: report and go on stopping the rest
            print(f"[spyglass] serve shutdown: {e}", file=sys.stderr)
        finally:
            ray.shutdown()
            if redis is not None:
                redis.stop()
            reap(started)
            signal.signal(signal.SIGTERM, previous)
    return 0


DRAIN_TIMEOUT_S = 30.0  # SIGTERM: how long requests in flight may still run (Kubernetes' default grace is 30 s)


def drain(address: str, timeout_s: float = DRAIN_TIMEOUT_S, tls: bool | bytes = False, token: str | None = None) -> int:
    """Wait until the gateway has no request in flight or queued, at most `timeout_s`; returns how many are left
    (-1 if the gateway does not answer)."""
    deadline = time.monotonic() + timeout_s
    left = -1
    with Client(address, timeout=5, retries=0, tls=tls, token=token) as c:
        while True:
            try:
                h = c.health()
            except SpyglassError:
                return -1
            left = int(h.get("in_flight", 0)) + int(h.get("queue_depth", 0))
            if left == 0 or time.monotonic() >= deadline:
                return left
            time.sleep(0.5)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def reap(pids: list[int], grace_s: float = 10.0) -> list[int]:
    """SIGTERM, then after `grace_s` SIGKILL, the given processes (ones this command started) still alive."""

    def alive(p: int) -> bool:
        try:
            os.kill(p, 0)
            stat = Path(f"/proc/{p}/stat").read_text()
            return stat.rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    left = [p for p in pids if alive(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if alive(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    if left:
        print(f"[spyglass] killed {len(left)} process(es) that ignored SIGTERM", file=sys.stderr)
    return left


__all__ = ["LocalRedis", "build_app", "redis_url", "deploy", "load_config", "run_demo", "serve_main", "start_local_ray"]
