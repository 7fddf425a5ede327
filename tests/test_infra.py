"""infra/ checked offline: the KubeRay manifests, their schemas, the container images and the Serve config.

- Built-in kinds (PersistentVolumeClaim, ConfigMap, Deployment, Service, and the pod templates and Service
  embedded in the Ray resources) are validated with kubernetes-validate in strict mode (unknown fields fail).
- RayService and RayJob are validated against the project's JSON schemas of the fields used
  (infra/k8s/schemas/), and the embedded Serve config against Ray's own Serve schema.
- Consistency: every import path, servicer function, deployment name and CLI command named in the manifests
  exists; ports, names, selectors, volumes and sizes agree across the files; the embedded serveConfigV2 equals
  infra/serve_config.yaml apart from the overrides in SERVE_OVERRIDES (documented in infra/README.md and at the
  top of infra/k8s/rayservice.yaml).

Each check returns its problems as strings; each has a test that a broken copy is rejected.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
K8S = INFRA / "k8s"
SCHEMAS = K8S / "schemas"
DOCKER = INFRA / "docker"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests target
IMAGE_ROOT = "/app"  # where the images put the repository (WORKDIR)
SPYGLASS = Path(sys.executable).with_name("spyglass")

ADDED = object()  # an override that adds a key absent from infra/serve_config.yaml
# serveConfigV2 (infra/k8s/rayservice.yaml) = infra/serve_config.yaml with exactly these changes; why, in
# infra/README.md ("How the Serve config maps to the code").
SERVE_OVERRIDES: dict[str, Any] = {
    "proxy_location": "EveryNode",
    "http_options.host": "0.0.0.0",
    "applications.0.args.verifier_num_cpus": 4,
    "applications.0.args.verifier_num_gpus": 1,
    "applications.0.args.verifier.model": "/models/target",
    "applications.0.args.verifier.threads": None,
    "applications.0.deployments": ADDED,
}


# --- loading ---------------------------------------------------------------------------------------------------
def load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def manifests() -> dict[str, list[dict[str, Any]]]:
    return {p.name: load(p.name) for p in sorted(K8S.glob("*.yaml"))}


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def cluster_spec(cr: dict[str, Any]) -> dict[str, Any]:
    return cr["spec"].get("rayClusterConfig") or cr["spec"]["rayClusterSpec"]


def pod_templates(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod template) for every pod a document creates."""
    if doc["kind"] == "Deployment":
        return [(f"Deployment/{doc['metadata']['name']}", doc["spec"]["template"])]
    if doc["apiVersion"].startswith("ray.io/"):
        spec = cluster_spec(doc)
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        out = [(f"{name}/head", spec["headGroupSpec"]["template"])]
        out += [(f"{name}/{g['groupName']}", g["template"]) for g in spec.get("workerGroupSpecs", [])]
        return out
    return []


def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def local_serve_config() -> dict[str, Any]:
    return yaml.safe_load((INFRA / "serve_config.yaml").read_text())


def get_path(doc: Any, path: str) -> tuple[bool, Any]:
    node = doc
    for part in path.split("."):
        key: Any = int(part) if isinstance(node, list) else part
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, node


def set_path(doc: Any, path: str, value: Any, delete: bool = False) -> None:
    *parents, last = path.split(".")
    node = doc
    for part in parents:
        node = node[int(part) if isinstance(node, list) else part]
    key: Any = int(last) if isinstance(node, list) else last
    if delete:
        node.pop(key, None)
    else:
        node[key] = value


def quantity(q: Any) -> float:
    """A Kubernetes quantity ("500m", "8", "32Gi", 4) as a number of cores or bytes."""
    m = re.fullmatch(r"([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?", str(q))
    assert m, f"bad quantity {q!r}"
    scale = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    scale.update({"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40})
    return float(m.group(1)) * scale[m.group(2)]


def redis_bytes(value: str) -> int:
    """A redis.conf memory value: 1k = 1000, 1kb = 1024, ... (case-insensitive), or plain bytes."""
    m = re.fullmatch(r"(\d+)(k|kb|m|mb|g|gb)?", value.lower())
    assert m, f"bad redis memory value {value!r}"
    unit = {None: 1, "k": 10**3, "kb": 2**10, "m": 10**6, "mb": 2**20, "g": 10**9, "gb": 2**30}
    return int(m.group(1)) * unit[m.group(2)]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


# --- built-in kinds: kubernetes-validate -------------------------------------------------------------------------
def builtin_objects(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Every built-in object of a file, the ones embedded in Ray resources included (as PodTemplate / Service)."""
    out = []
    for doc in docs:
        if not doc["apiVersion"].startswith("ray.io/"):
            out.append((f"{doc['kind']}/{doc['metadata']['name']}", doc))
            continue
        for where, template in pod_templates(doc):
            name = where.replace("/", "-").lower()
            out.append(
                (where, {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template})
            )
        if "serveService" in doc["spec"]:
            out.append(("serveService", {"apiVersion": "v1", "kind": "Service", **doc["spec"]["serveService"]}))
    return out


def builtin_problems(docs: list[dict[str, Any]]) -> list[str]:
    problems = []
    for where, obj in builtin_objects(docs):
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            problems.append(f"{where}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{where}: {e.message}")
    return problems


# --- Ray resources: the project's JSON schemas ---------------------------------------------------------------------
def schema_registry() -> Registry:
    resources = []
    for path in SCHEMAS.glob("*.schema.json"):
        schema = json.loads(path.read_text())
        resources.append((schema["$id"], Resource.from_contents(schema)))
    return Registry().with_resources(resources)


def cr_problems(doc: dict[str, Any]) -> list[str]:
    schema = json.loads((SCHEMAS / f"{doc['kind'].lower()}.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema, registry=schema_registry())
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


# --- the embedded Serve config -------------------------------------------------------------------------------------
def serve_schema_problems(cfg: dict[str, Any]) -> list[str]:
    """Ray's ServeDeploySchema, plus unknown keys (Ray's schema lets extra keys through silently)."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import (
        DeploymentSchema,
        HTTPOptionsSchema,
        RayActorOptionsSchema,
        ServeApplicationSchema,
        ServeDeploySchema,
        gRPCOptionsSchema,
    )

    problems = []
    try:
        ServeDeploySchema.model_validate(cfg)
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError; report it as a problem
        problems.append(f"ServeDeploySchema: {e}")

    def unknown(where: str, d: Any, model) -> None:
        extra = set(d or {}) - set(model.model_fields)
        if extra:
            problems.append(f"{where}: unknown keys {sorted(extra)}")

    unknown("serveConfigV2", cfg, ServeDeploySchema)
    unknown("http_options", cfg.get("http_options"), HTTPOptionsSchema)
    unknown("grpc_options", cfg.get("grpc_options"), gRPCOptionsSchema)
    for app in cfg.get("applications", []):
        unknown(f"application {app.get('name')}", app, ServeApplicationSchema)
        for dep in app.get("deployments", []):
            unknown(f"deployment {dep.get('name')}", dep, DeploymentSchema)
            unknown(
                f"deployment {dep.get('name')} ray_actor_options", dep.get("ray_actor_options"), RayActorOptionsSchema
            )
            unknown(
                f"deployment {dep.get('name')} autoscaling_config", dep.get("autoscaling_config"), AutoscalingConfig
            )
    return problems


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            p = f"{path}.{k}" if path else str(k)
            if k not in a or k not in b:
                out.append(f"{p}: only in {'serveConfigV2' if k in a else 'infra/serve_config.yaml'}")
            else:
                out += diff(a[k], b[k], p)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in diff(x, y, f"{path}.{i}")]
    return [] if a == b else [f"{path}: {a!r} (serveConfigV2) != {b!r} (infra/serve_config.yaml)"]


def serve_override_problems(k8s_cfg: dict[str, Any], local_cfg: dict[str, Any]) -> list[str]:
    """serveConfigV2 must equal infra/serve_config.yaml once the documented overrides are undone."""
    problems = []
    undone = copy.deepcopy(k8s_cfg)
    for path, expected in SERVE_OVERRIDES.items():
        present, value = get_path(undone, path)
        if not present:
            problems.append(f"override {path} is missing from serveConfigV2")
            continue
        if expected is not ADDED and value != expected:
            problems.append(f"override {path} is {value!r}, documented as {expected!r}")
        in_local, local_value = get_path(local_cfg, path)
        set_path(undone, path, local_value, delete=not in_local)
    return problems + diff(undone, local_cfg)


def serve_code_problems(cfg: dict[str, Any], gpus: bool = True) -> list[str]:
    """Import paths and servicer functions exist; args are accepted by the code; deployment options name the
    deployments build_app creates and agree with its args; with `gpus`, one GPU per verifier replica, which the
    verifier config asks to compute on (`device: auto`: the GPU Ray assigned)."""
    from services.app import build_app
    from services.gateway import GatewayConfig
    from services.verifier import VerifierConfig

    problems = []
    for fn in cfg.get("grpc_options", {}).get("grpc_servicer_functions", []):
        module, _, attr = fn.rpartition(".")
        try:
            if not callable(getattr(importlib.import_module(module), attr)):
                problems.append(f"servicer function {fn} is not callable")
        except (ImportError, AttributeError) as e:
            problems.append(f"servicer function {fn}: {e}")
    for app in cfg.get("applications", []):
        module, _, attr = app["import_path"].partition(":")
        try:
            builder = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            problems.append(f"import_path {app['import_path']}: {e}")
            continue
        if builder is not build_app:
            problems.append(f"import_path {app['import_path']} is not services.app:build_app")
            continue
        args = app.get("args") or {}
        for name, parse in (("gateway", GatewayConfig.from_dict), ("verifier", VerifierConfig.from_dict)):
            try:
                parse(args.get(name))
            except (TypeError, ValueError) as e:
                problems.append(f"args.{name}: {e}")
        built = build_app(args)
        gateway = built._bound_deployment
        bound = {gateway.name: gateway.ray_actor_options}
        bound.update({v._bound_deployment.name: v._bound_deployment.ray_actor_options for v in gateway.init_args[0]})
        options = {d["name"]: d for d in app.get("deployments", [])}
        for name in sorted(set(options) - set(bound)):
            problems.append(f"deployment options for {name}, which build_app does not create ({sorted(bound)})")
        device = (args.get("verifier") or {}).get("device")
        if gpus and device != "auto":
            problems.append(f"args.verifier.device is {device!r}: a GPU replica needs `device: auto` (its GPU)")
        for name in sorted(n for n in bound if n.startswith("Verifier") and gpus):
            actor = (options.get(name) or {}).get("ray_actor_options")
            if actor is None:
                problems.append(f"{name}: no ray_actor_options in deployments")
                continue
            if actor.get("num_gpus") != 1:
                problems.append(f"{name}: num_gpus {actor.get('num_gpus')!r}, want 1 per replica")
            for key in ("num_cpus", "num_gpus"):
                if float(actor.get(key, 0)) != float(bound[name].get(key, 0)):
                    problems.append(
                        f"{name}: {key} {actor.get(key)} in deployments but {bound[name].get(key)} from args"
                    )
        for name, opts in options.items():
            auto = opts.get("autoscaling_config")
            if auto is None:
                continue
            if "num_replicas" in opts:
                problems.append(f"{name}: num_replicas and autoscaling_config together")
            lo, hi = auto.get("min_replicas", 1), auto.get("max_replicas", 1)
            if not 1 <= lo <= auto.get("initial_replicas", lo) <= hi:
                problems.append(f"{name}: autoscaling bounds {auto} are not 1 <= min <= initial <= max")
    return problems


# --- ports, probes, resources of the RayService --------------------------------------------------------------------
def parse_cli(argv: list[str]):
    """The spyglass CLI's own parser on argv; None when it rejects it."""
    from cli.main import build_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return build_parser().parse_args(argv)
    except SystemExit:
        return None


def health_probe_problems(command: list[str], grpc_port: int) -> list[str]:
    if not command or command[0] != "spyglass":
        return [f"probe {command} does not run the spyglass CLI"]
    args = parse_cli(command[1:])
    if args is None:
        return [f"probe {command} is not a valid spyglass command line"]
    if args.command != "health":
        return [f"probe runs `spyglass {args.command}`, not `spyglass health`"]
    host, _, port = args.server.rpartition(":")
    problems = []
    if host not in ("127.0.0.1", "localhost"):
        problems.append(f"probe calls {args.server}: not this pod's own proxy")
    if int(port) != grpc_port:
        problems.append(f"probe calls port {port}, the gRPC proxy listens on {grpc_port}")
    return problems


def rayservice_problems(rs: dict[str, Any], pyproject: dict[str, Any]) -> list[str]:
    problems = []
    cfg = serve_config(rs)
    want = {"grpc": cfg["grpc_options"]["port"], "serve": cfg["http_options"]["port"]}
    svc_ports = {p["name"]: p for p in rs["spec"]["serveService"]["spec"]["ports"]}
    for name, port in want.items():
        if name not in svc_ports:
            problems.append(f"serveService has no {name} port")
        elif svc_ports[name]["port"] != port:
            problems.append(f"serveService {name} port {svc_ports[name]['port']} != Serve's {port}")
    spec = cluster_spec(rs)
    serving = [c for g in spec["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]]
    serving += (
        [] if rs["spec"].get("excludeHeadPodFromServeSvc") else spec["headGroupSpec"]["template"]["spec"]["containers"]
    )
    for c in serving:
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        for sp in svc_ports.values():
            target = sp.get("targetPort", sp["port"])
            number = ports.get(target) if isinstance(target, str) else target
            if number is None:
                problems.append(f"container {c['name']} has no port named {target} (serveService targetPort)")
            elif sp["name"] in want and number != want[sp["name"]]:
                problems.append(
                    f"container {c['name']}: {sp['name']} traffic goes to {number}, Serve listens on {want[sp['name']]}"
                )
        probe = c.get("readinessProbe", {}).get("exec", {}).get("command")
        if probe is None:
            problems.append(f"container {c['name']} serves traffic without a readiness probe on the Health RPC")
        else:
            problems += health_probe_problems(probe, want["grpc"])
    ray_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("ray["))
    if spec["rayVersion"] != ray_pin.split("==")[1]:
        problems.append(f"rayVersion {spec['rayVersion']} != the pinned {ray_pin}")
    if spec["headGroupSpec"]["rayStartParams"].get("num-cpus") != "0":
        problems.append("the head must advertise num-cpus 0 (no replicas on it)")
    # GPUs: every verifier replica needs one, on workers the group can grow to.
    app_args = cfg["applications"][0]["args"]
    gpus_needed = int(app_args["num_verifiers"]) * int(app_args["verifier_num_gpus"])
    gpus_max = 0
    for g in spec["workerGroupSpecs"]:
        if not g.get("minReplicas", 0) <= g.get("replicas", 0) <= g["maxReplicas"]:
            problems.append(f"group {g['groupName']}: replicas outside [minReplicas, maxReplicas]")
        for c in g["template"]["spec"]["containers"]:
            gpus_max += g["maxReplicas"] * int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
            cpu = quantity(c.get("resources", {}).get("limits", {}).get("cpu", 0))
            if cpu < float(app_args["verifier_num_cpus"]):
                problems.append(
                    f"group {g['groupName']}: {cpu} CPUs, a verifier replica asks {app_args['verifier_num_cpus']}"
                )
    if gpus_max < gpus_needed:
        problems.append(f"{gpus_needed} GPUs needed by the verifiers, the worker groups reach {gpus_max}")
    return problems


def resource_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Requests and limits on every container; GPUs requested as much as limited; one image per Ray cluster."""
    problems = []
    for doc in docs:
        images = set()
        for where, template in pod_templates(doc):
            for c in template["spec"]["containers"]:
                images.add(c["image"])
                res = c.get("resources", {})
                for kind in ("requests", "limits"):
                    for r in ("cpu", "memory"):
                        if r not in res.get(kind, {}):
                            problems.append(f"{where}/{c['name']}: no {kind}.{r}")
                gpu = {k: res.get(k, {}).get("nvidia.com/gpu") for k in ("requests", "limits")}
                if gpu["requests"] != gpu["limits"]:
                    problems.append(
                        f"{where}/{c['name']}: nvidia.com/gpu requests {gpu['requests']} != limits {gpu['limits']}"
                    )
                for r in ("cpu", "memory"):
                    if r in res.get("requests", {}) and r in res.get("limits", {}):
                        if quantity(res["requests"][r]) > quantity(res["limits"][r]):
                            problems.append(f"{where}/{c['name']}: {r} request above its limit")
        if doc["apiVersion"].startswith("ray.io/") and len(images) != 1:
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: head and workers run different images {images}")
    return problems


# --- volumes and names across the files -----------------------------------------------------------------------------
def volume_problems(files: dict[str, list[dict[str, Any]]]) -> list[str]:
    everything = [d for docs in files.values() for d in docs]
    claims = {d["metadata"]["name"] for d in everything if d["kind"] == "PersistentVolumeClaim"}
    configmaps = {d["metadata"]["name"]: d for d in everything if d["kind"] == "ConfigMap"}
    problems = []
    for doc in everything:
        for where, template in pod_templates(doc):
            volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
            for v in volumes.values():
                claim = v.get("persistentVolumeClaim", {}).get("claimName")
                if claim is not None and claim not in claims:
                    problems.append(f"{where}: volume {v['name']} claims {claim}, defined nowhere in infra/k8s")
                cm = v.get("configMap", {}).get("name")
                if cm is not None and cm not in configmaps:
                    problems.append(f"{where}: volume {v['name']} mounts ConfigMap {cm}, defined nowhere in infra/k8s")
            for c in template["spec"]["containers"]:
                for m in c.get("volumeMounts", []):
                    if m["name"] not in volumes:
                        problems.append(f"{where}/{c['name']}: mount {m['name']} has no volume")
    return problems


def redis_problems(files: dict[str, list[dict[str, Any]]], cache_max_bytes: int) -> list[str]:
    redis_docs = files["redis.yaml"]
    dep, svc = find(redis_docs, "Deployment"), find(redis_docs, "Service")
    problems = []
    labels = dep["spec"]["template"]["metadata"]["labels"]
    for what, selector in (
        ("Deployment", dep["spec"]["selector"]["matchLabels"]),
        ("Service", svc["spec"]["selector"]),
    ):
        if not selector.items() <= labels.items():
            problems.append(f"the {what} selector {selector} does not select the Redis pods {labels}")
    for docs in files.values():
        for doc in docs:
            for where, template in pod_templates(doc):
                if doc is not dep and svc["spec"]["selector"].items() <= template["metadata"].get("labels", {}).items():
                    problems.append(f"the Redis Service also selects {where}")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    svc_port = svc["spec"]["ports"][0]
    if ports.get(svc_port["targetPort"]) is None:
        problems.append(f"Service targetPort {svc_port['targetPort']} is not a Redis container port")
    args = container.get("command", []) + container.get("args", [])
    port_arg = args[args.index("--port") + 1] if "--port" in args else "6379"
    if int(port_arg) != ports.get(svc_port["targetPort"]):
        problems.append(
            f"redis-server listens on {port_arg}, the container port is {ports.get(svc_port['targetPort'])}"
        )
    if "--maxmemory" not in args or "--maxmemory-policy" not in args:
        return problems + ["redis-server runs without --maxmemory and --maxmemory-policy"]
    maxmemory = redis_bytes(args[args.index("--maxmemory") + 1])
    policy = args[args.index("--maxmemory-policy") + 1]
    if not policy.startswith("allkeys-"):
        problems.append(f"eviction policy {policy}: the cache's keys have no TTL, only allkeys-* policies evict them")
    limit = quantity(container["resources"]["limits"]["memory"])
    if not cache_max_bytes < maxmemory < limit:
        problems.append(f"want cache_max_bytes {cache_max_bytes} < maxmemory {maxmemory} < memory limit {limit:.0f}")
    # Every Ray pod reaches this Service through SPYGLASS_REDIS_URL.
    for name, docs in files.items():
        for doc in docs:
            if not doc["apiVersion"].startswith("ray.io/"):
                continue
            for where, template in pod_templates(doc):
                for c in template["spec"]["containers"]:
                    url = env_of(c).get("SPYGLASS_REDIS_URL")
                    if url is None:
                        problems.append(f"{name} {where}/{c['name']}: no SPYGLASS_REDIS_URL")
                        continue
                    u = urlparse(url)
                    if u.scheme != "redis" or u.hostname != svc["metadata"]["name"] or u.port != svc_port["port"]:
                        problems.append(
                            f"{name} {where}/{c['name']}: {url} is not the Service "
                            f"{svc['metadata']['name']}:{svc_port['port']}"
                        )
    return problems


# --- the training RayJob ----------------------------------------------------------------------------------------
def run_entrypoint(job: dict[str, Any], configmaps: dict[str, dict[str, Any]], tmp: Path) -> list[list[str]]:
    """Run the job's entrypoint script with `spyglass` replaced by a recorder: the argv of each call."""
    entry = shlex.split(job["spec"]["entrypoint"])
    assert entry[:1] == ["bash"] and len(entry) == 2, f"entrypoint {entry} is not `bash SCRIPT`"
    head = cluster_spec(job)["headGroupSpec"]["template"]
    container = head["spec"]["containers"][0]
    volumes = {v["name"]: v for v in head["spec"].get("volumes", [])}
    script, mount_dir = None, None
    for m in container.get("volumeMounts", []):
        cm = volumes[m["name"]].get("configMap")
        if cm and entry[1].startswith(m["mountPath"].rstrip("/") + "/"):
            files = configmaps[cm["name"]]["data"]
            script = files.get(entry[1][len(m["mountPath"].rstrip("/")) + 1 :])
            mount_dir = m["mountPath"].rstrip("/")
            local = tmp / "mount"
            local.mkdir()
            for key, text in files.items():
                (local / key).write_text(text)
    assert script is not None, f"{entry[1]} is not a file of a ConfigMap mounted on the head"
    local_script = tmp / "entrypoint.sh"
    local_script.write_text(script.replace(mount_dir + "/", str(tmp / "mount") + "/"))
    calls = tmp / "calls.jsonl"
    recorder = (
        'spyglass() { "$PYTHON" -c \'import json, sys; print(json.dumps(sys.argv[1:]))\' "$@" >> "$CALLS"; }; '
        'export -f spyglass; exec bash "$0"'
    )
    env = dict(os.environ, PYTHON=sys.executable, CALLS=str(calls), **env_of(container))
    proc = subprocess.run(
        ["bash", "-c", recorder, str(local_script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def rayjob_problems(job: dict[str, Any], calls: list[list[str]]) -> list[str]:
    from actors.common import load_config
    from actors.jobs import validate

    problems = []
    parsed = []
    for argv in calls:
        args = parse_cli(argv)
        if args is None:
            problems.append(f"`spyglass {shlex.join(argv[:2])} ...` is not a valid spyglass command line")
        else:
            parsed.append(args)
    if problems:
        return problems
    if [a.command for a in parsed] != ["extract", "train"]:
        return [f"the job runs {[a.command for a in parsed]}, want extract then train"]
    if len({a.config for a in parsed}) != 1 or len({a.workdir for a in parsed}) != 1:
        problems.append("extract and train use different configs or workdirs")
    spec = cluster_spec(job)
    gpus = sum(
        g["replicas"] * int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
        for g in spec["workerGroupSpecs"]
        for c in g["template"]["spec"]["containers"]
    )
    for args in parsed:
        if not args.config.startswith(IMAGE_ROOT + "/"):
            problems.append(f"config {args.config} is not inside the image's {IMAGE_ROOT}")
            continue
        config = REPO / args.config[len(IMAGE_ROOT) + 1 :]
        if not config.is_file():
            problems.append(f"config {args.config}: no {config.relative_to(REPO)} in the repository")
            continue
        try:
            cfg = load_config(config, args.set, args.workdir)
            validate(cfg)
        except (ValueError, TypeError) as e:
            problems.append(f"`spyglass {args.command}` config: {e}")
            continue
        if args.command == "train":
            ds = cfg["train"].get("deepspeed")
            if not ds:
                problems.append("training runs without a DeepSpeed config")
            else:
                stage = ds.get("config", {}).get("zero_optimization", {}).get("stage", ds.get("zero_stage", 2))
                if stage != ds.get("zero_stage", 2):
                    problems.append(f"DeepSpeed zero_stage {ds.get('zero_stage')} != zero_optimization.stage {stage}")
            if gpus < cfg["train"].get("workers", 2):
                problems.append(f"{cfg['train'].get('workers')} training workers, {gpus} GPUs in the worker groups")
        if args.command == "extract" and gpus < cfg["extract"].get("workers", 2):
            problems.append(f"{cfg['extract'].get('workers')} extraction workers, {gpus} GPUs in the worker groups")
    # The workdir is on a volume on every pod, its train/ subdirectory (checkpoints) on another.
    workdir = parsed[0].workdir
    for where, template in pod_templates(job):
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        for c in template["spec"]["containers"]:
            mounts = {m["mountPath"].rstrip("/"): volumes[m["name"]] for m in c.get("volumeMounts", [])}
            data = [p for p in mounts if workdir == p or workdir.startswith(p + "/")]
            ckpt = mounts.get(f"{workdir}/train")
            if not data or "persistentVolumeClaim" not in mounts[max(data, key=len)]:
                problems.append(f"{where}/{c['name']}: workdir {workdir} is not on a persistent volume")
            if ckpt is None or "persistentVolumeClaim" not in ckpt:
                problems.append(f"{where}/{c['name']}: {workdir}/train (checkpoints) is not its own persistent volume")
    if not job["spec"].get("shutdownAfterJobFinishes") or "ttlSecondsAfterFinished" not in job["spec"]:
        problems.append("the job's cluster must shut down after the job, with ttlSecondsAfterFinished")
    return problems


# --- images ---------------------------------------------------------------------------------------------------------
def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments and heredocs ignored."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def dockerfile_problems(path: Path, gpu: bool, pyproject: dict[str, Any]) -> list[str]:
    from spyglass.models.loader import DEFAULT_DISTRIBUTION, DEFAULT_DISTRIBUTION_VERSION

    ins = instructions(path)
    run = " ".join(a for i, a in ins if i == "RUN")
    problems = []
    base = [a for i, a in ins if i == "FROM"]
    if gpu and not (base and "nvidia/cuda" in base[-1] and "devel" in base[-1]):
        problems.append(f"GPU image base {base}: want a CUDA devel image (nvcc for flash-attn and DeepSpeed ops)")
    if gpu and not re.search(r"pip install --no-build-isolation flash-attn", run):
        problems.append("GPU image does not build flash-attn against its torch (--no-build-isolation)")
    if not gpu and "flash-attn" in run:
        problems.append("CPU image installs flash-attn")
    torch_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch=="))
    if torch_pin not in run:
        problems.append(f"{torch_pin} (pyproject) is not what the image installs")
    # torch from PyTorch's CUDA index in the GPU image, its CPU index in the CPU one (PyPI's Linux wheel is the CUDA
    # build), before the project, whose pin it then satisfies (pip keeps it)
    arg = dict(a.split("=", 1) for i, a in ins if i == "ARG" and "=" in a)
    m = re.search(r"pip install --index-url (\S+) " + re.escape(torch_pin), run)
    index = re.sub(r"\$\{(\w+)\}", lambda g: arg.get(g.group(1), ""), m.group(1)) if m else "PyPI"
    want = "/whl/cu" if gpu else "/whl/cpu"
    if want not in index:
        problems.append(f"torch comes from {index}: want PyTorch's {'CUDA' if gpu else 'CPU'} index ({want}...)")
    elif run.find('pip install -e ".') < run.find(m.group(0)):
        problems.append("torch is installed after the project: pip would have taken another build for the pin")
    if f"{DEFAULT_DISTRIBUTION}=={DEFAULT_DISTRIBUTION_VERSION}" not in run:
        problems.append(
            f"the embedded default model {DEFAULT_DISTRIBUTION}=={DEFAULT_DISTRIBUTION_VERSION} is not installed"
        )
    if not re.search(r'pip install -e "\.\[train', run):
        problems.append("the project is not installed (editable, with the train extra)")
    if "wget" not in run:
        problems.append("no wget: KubeRay's default probes call it")
    if ("WORKDIR", IMAGE_ROOT) not in ins:
        problems.append(f"WORKDIR is not {IMAGE_ROOT}, where the manifests look for configs/")
    env = " ".join(a for i, a in ins if i == "ENV")
    if "PATH=/opt/venv/bin:" not in env or "venv /opt/venv" not in run:
        problems.append("the venv's bin is not on PATH: `spyglass` in probes and the job entrypoint would not resolve")
    copied = set()
    ignore = (path.parent / f"{path.name}.dockerignore").read_text().split()
    for i, a in ins:
        if i != "COPY" or a.startswith("--from"):
            continue
        *srcs, _dest = a.split()
        for src in srcs:
            if not (REPO / src).exists():
                problems.append(f"COPY {src}: not in the repository")
            if f"!{src}" not in ignore and f"!{src}/**" not in ignore:
                problems.append(f"COPY {src}: excluded by {path.name}.dockerignore")
            copied.add(src.rstrip("/"))
    wanted = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    for need in sorted(wanted | {"configs", "pyproject.toml"}):
        if need not in copied:
            problems.append(f"{need} is not copied into the image")
    if ("USER", "root") in ins or not any(i == "USER" for i, _ in ins):
        problems.append("the image runs as root")
    return problems


# --- fixtures ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files():
    return manifests()


@pytest.fixture(scope="module")
def pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_manifest_files_present(files):
    assert set(files) == {"rayservice.yaml", "redis.yaml", "rayjob-train.yaml"}
    kinds = {d["kind"] for docs in files.values() for d in docs}
    assert kinds == {"RayService", "RayJob", "Deployment", "Service", "PersistentVolumeClaim", "ConfigMap"}


# --- built-in kinds ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["rayservice.yaml", "redis.yaml", "rayjob-train.yaml"])
def test_builtin_kinds_validate(files, name):
    assert builtin_problems(files[name]) == []


def _typo_in_redis_container(files):
    docs = copy.deepcopy(files["redis.yaml"])
    docs[0]["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "IfNotPresent"
    return docs


def _bad_probe_in_worker(files):
    docs = copy.deepcopy(files["rayservice.yaml"])
    probe = cluster_spec(docs[1])["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["periodSeconds"] = "10s"
    return docs


def _service_port_as_string(files):
    docs = copy.deepcopy(files["redis.yaml"])
    docs[1]["spec"]["ports"][0]["port"] = "6379"
    return docs


@pytest.mark.parametrize("mutate", [_typo_in_redis_container, _bad_probe_in_worker, _service_port_as_string])
def test_builtin_validation_rejects_broken_copies(files, mutate):
    assert builtin_problems(mutate(files))


# --- Ray resources -----------------------------------------------------------------------------------------------
def test_schemas_are_valid_json_schemas():
    for path in SCHEMAS.glob("*.schema.json"):
        jsonschema.Draft202012Validator.check_schema(json.loads(path.read_text()))


def test_ray_resources_match_the_schemas(files):
    assert cr_problems(find(files["rayservice.yaml"], "RayService")) == []
    assert cr_problems(find(files["rayjob-train.yaml"], "RayJob")) == []


@pytest.mark.parametrize(
    "name,kind,path,value",
    [
        ("rayservice.yaml", "RayService", "spec.rayClusterConfig.headGroupSpec.rayStartParams.num-cpus", 0),
        ("rayservice.yaml", "RayService", "spec.rayClusterConfig.workerGroupSpecs.0.maxReplica", 4),
        ("rayservice.yaml", "RayService", "spec.upgradeStrategy.type", "BlueGreen"),
        ("rayservice.yaml", "RayService", "metadata.name", "Spyglass"),
        ("rayjob-train.yaml", "RayJob", "spec.shutdownAfterJobFinishes", False),
        ("rayjob-train.yaml", "RayJob", "spec.ttlSecondsAfterFinished", -1),
        ("rayjob-train.yaml", "RayJob", "spec.submissionMode", "K8sMode"),
        ("rayjob-train.yaml", "RayJob", "spec.rayClusterSpec.rayVersion", "latest"),
    ],
)
def test_schemas_reject_broken_copies(files, name, kind, path, value):
    doc = copy.deepcopy(find(files[name], kind))
    set_path(doc, path, value)
    assert cr_problems(doc)


# --- the embedded Serve config -------------------------------------------------------------------------------------
def test_serve_config_is_valid_for_ray_serve(files):
    assert serve_schema_problems(serve_config(find(files["rayservice.yaml"], "RayService"))) == []
    assert serve_schema_problems(local_serve_config()) == []


def test_serve_schema_rejects_broken_copies(files):
    cfg = serve_config(find(files["rayservice.yaml"], "RayService"))
    typo = copy.deepcopy(cfg)
    typo["applications"][0]["deployments"][1]["max_ongoing_request"] = 32
    assert serve_schema_problems(typo)
    bad = copy.deepcopy(cfg)
    bad["proxy_location"] = "Everywhere"
    assert serve_schema_problems(bad)


def test_serve_config_equals_infra_serve_config_apart_from_overrides(files):
    cfg = serve_config(find(files["rayservice.yaml"], "RayService"))
    assert serve_override_problems(cfg, local_serve_config()) == []


@pytest.mark.parametrize(
    "path,value",
    [
        ("applications.0.args.verifier.max_batch", 8),  # an undocumented difference
        ("applications.0.args.gateway.max_queued", 32),
        ("grpc_options.port", 9001),
        ("http_options.host", "127.0.0.1"),  # an override that is no longer what the docs say
    ],
)
def test_serve_config_drift_is_caught(files, path, value):
    cfg = serve_config(find(files["rayservice.yaml"], "RayService"))
    set_path(cfg, path, value)
    assert serve_override_problems(cfg, local_serve_config())


def test_overrides_are_documented():
    readme = (INFRA / "README.md").read_text()
    header = (K8S / "rayservice.yaml").read_text().split("apiVersion:")[0]
    for path in SERVE_OVERRIDES:
        short = path.replace("applications.0.", "applications[0].")
        assert short in readme, f"infra/README.md does not document the override {short}"
        assert short in header, f"rayservice.yaml's header does not list the override {short}"


def test_serve_config_names_existing_code(files):
    assert serve_code_problems(serve_config(find(files["rayservice.yaml"], "RayService"))) == []
    assert serve_code_problems(local_serve_config(), gpus=False) == []


def test_qwen_serve_config_is_the_local_one_with_another_verifier():
    """infra/serve_config_qwen.yaml (Qwen2.5-Coder-0.5B at its 32K window) is valid and differs from
    infra/serve_config.yaml only in the verifier's model, methods and KV slots."""
    qwen = yaml.safe_load((INFRA / "serve_config_qwen.yaml").read_text())
    assert serve_schema_problems(qwen) == []
    assert serve_code_problems(qwen, gpus=False) == []
    verifier = "applications.0.args.verifier"
    differing = {d.split(":")[0] for d in diff(qwen, local_serve_config())}
    assert differing == {f"{verifier}.model", f"{verifier}.methods", f"{verifier}.max_batch"}
    assert get_path(qwen, f"{verifier}.model") == (True, "qwen2.5-coder-0.5b")
    assert get_path(qwen, f"{verifier}.max_context") == (True, None)  # the model's window


@pytest.mark.parametrize(
    "path,value",
    [
        ("applications.0.import_path", "services.app:build_application"),
        ("grpc_options.grpc_servicer_functions.0", "protos.spyglass_pb2_grpc.add_SpyglassServicer_to_servr"),
        ("applications.0.deployments.1.name", "Verifier1"),  # options for a deployment that is not built
        ("applications.0.deployments.1.ray_actor_options.num_gpus", 0),
        ("applications.0.args.verifier_num_cpus", 2),  # disagrees with the deployment's ray_actor_options
        ("applications.0.args.verifier.max_bach", 4),
        ("applications.0.args.verifier.device", "cpu"),  # a replica holding a GPU and computing on the CPU
        ("applications.0.deployments.0.autoscaling_config.min_replicas", 8),
    ],
)
def test_serve_code_checks_reject_broken_copies(files, path, value):
    cfg = serve_config(find(files["rayservice.yaml"], "RayService"))
    set_path(cfg, path, value)
    assert serve_code_problems(cfg)


# --- RayService: ports, probes, resources -----------------------------------------------------------------------------
def test_rayservice_ports_probes_and_resources_agree(files, pyproject):
    assert rayservice_problems(find(files["rayservice.yaml"], "RayService"), pyproject) == []
    assert resource_problems(files["rayservice.yaml"] + files["rayjob-train.yaml"] + files["redis.yaml"]) == []


def _set_in_serve_config(path, value):
    def mutate(rs):
        cfg = serve_config(rs)
        set_path(cfg, path, value)
        rs["spec"]["serveConfigV2"] = yaml.safe_dump(cfg)

    return mutate


def _worker(rs):
    return cluster_spec(rs)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    "mutate",
    [
        _set_in_serve_config("grpc_options.port", 9100),  # the Service and probe still say 9000
        lambda rs: _worker(rs)["ports"].__setitem__(1, {"name": "gprc", "containerPort": 9000}),
        lambda rs: _worker(rs)["readinessProbe"]["exec"].__setitem__("command", ["spyglass", "helth"]),
        lambda rs: _worker(rs)["readinessProbe"]["exec"]["command"].__setitem__(3, "127.0.0.1:9001"),
        lambda rs: _worker(rs).pop("readinessProbe"),
        lambda rs: cluster_spec(rs).__setitem__("rayVersion", "2.59.0"),
        lambda rs: cluster_spec(rs)["workerGroupSpecs"][0].__setitem__("maxReplicas", 0),
        _set_in_serve_config("applications.0.args.num_verifiers", 8),  # more GPUs than the group can have
    ],
)
def test_rayservice_checks_reject_broken_copies(files, pyproject, mutate):
    rs = copy.deepcopy(find(files["rayservice.yaml"], "RayService"))
    mutate(rs)
    assert rayservice_problems(rs, pyproject)


def test_resource_checks_reject_broken_copies(files):
    docs = copy.deepcopy(files["rayservice.yaml"])
    _worker(docs[1])["resources"]["requests"]["nvidia.com/gpu"] = "2"
    assert resource_problems(docs)
    docs = copy.deepcopy(files["redis.yaml"])
    docs[0]["spec"]["template"]["spec"]["containers"][0]["resources"].pop("limits")
    assert resource_problems(docs)


# --- volumes, Redis ---------------------------------------------------------------------------------------------------
def test_volumes_claims_and_configmaps_exist(files):
    assert volume_problems(files) == []


def test_volume_checks_reject_broken_copies(files):
    broken = copy.deepcopy(files)
    cluster_spec(broken["rayservice.yaml"][1])["workerGroupSpecs"][0]["template"]["spec"]["volumes"][0][
        "persistentVolumeClaim"
    ]["claimName"] = "spyglass-model"
    assert volume_problems(broken)
    broken = copy.deepcopy(files)
    broken["rayjob-train.yaml"] = [d for d in broken["rayjob-train.yaml"] if d["kind"] != "ConfigMap"]
    assert volume_problems(broken)


def test_redis_is_bounded_and_reachable(files):
    cache_max_bytes = local_serve_config()["applications"][0]["args"]["verifier"]["cache_max_bytes"]
    assert redis_problems(files, cache_max_bytes) == []


def _redis_container(files):
    return files["redis.yaml"][0]["spec"]["template"]["spec"]["containers"][0]


def _head_env(cr):
    return cluster_spec(cr)["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]


def _set_redis_arg(flag, value):
    def mutate(files):
        args = _redis_container(files)["args"]
        args[args.index(flag) + 1] = value

    return mutate


@pytest.mark.parametrize(
    "mutate",
    [
        _set_redis_arg("--maxmemory", "5gb"),  # above the memory limit
        _set_redis_arg("--maxmemory", "1gb"),  # below the cache's own bound
        _set_redis_arg("--maxmemory-policy", "volatile-lru"),
        _set_redis_arg("--port", "6380"),
        lambda f: f["redis.yaml"][1]["spec"]["selector"].__setitem__("app.kubernetes.io/component", "cache"),
        lambda f: f["redis.yaml"][1]["spec"]["selector"].pop("app.kubernetes.io/component"),  # selects Ray pods too
        lambda f: _head_env(f["rayjob-train.yaml"][3])[0].__setitem__("value", "redis://redis:6379/0"),
    ],
)
def test_redis_checks_reject_broken_copies(files, mutate):
    broken = copy.deepcopy(files)
    mutate(broken)
    assert redis_problems(broken, 2 << 30)


# --- the training RayJob ----------------------------------------------------------------------------------------------
def _configmaps(docs):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}


def test_rayjob_runs_extract_then_train_with_deepspeed(files, tmp_path):
    docs = files["rayjob-train.yaml"]
    job = find(docs, "RayJob")
    calls = run_entrypoint(job, _configmaps(docs), tmp_path)
    assert [c[0] for c in calls] == ["extract", "train"]
    assert calls[0][1] == "/app/configs/smollm2-135m-longspec/01-v2.yaml"
    assert rayjob_problems(job, calls) == []


def _script_edit(old, new):
    def mutate(docs):
        cm = find(docs, "ConfigMap", "spyglass-train")
        assert old in cm["data"]["train.sh"] or old in cm["data"]["deepspeed.json"]
        for key in ("train.sh", "deepspeed.json"):
            cm["data"][key] = cm["data"][key].replace(old, new)

    return mutate


def _job(docs):
    return find(docs, "RayJob")


@pytest.mark.parametrize(
    "mutate",
    [
        _script_edit("spyglass train", "spyglass trian"),
        _script_edit("--skip-extract", "--skip-extraction"),
        _script_edit("01-v2.yaml", "01-v9.yaml"),  # no such config
        _script_edit("spyglass extract", "spyglass train"),
        _script_edit('"stage": 2', '"stage": 3'),  # disagrees with zero_stage
        _script_edit(' --set "train.deepspeed=$(cat /etc/spyglass/deepspeed.json)"', ""),
        lambda docs: cluster_spec(_job(docs))["workerGroupSpecs"][0].__setitem__("replicas", 1),
        lambda docs: cluster_spec(_job(docs))["workerGroupSpecs"][0]["template"]["spec"]["containers"][0][
            "volumeMounts"
        ].pop(1),
        lambda docs: _job(docs)["spec"].pop("ttlSecondsAfterFinished"),
    ],
)
def test_rayjob_checks_reject_broken_copies(files, tmp_path, mutate):
    docs = copy.deepcopy(files["rayjob-train.yaml"])
    mutate(docs)
    calls = run_entrypoint(_job(docs), _configmaps(docs), tmp_path)
    assert rayjob_problems(_job(docs), calls)


# --- images -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,gpu", [("Dockerfile", True), ("Dockerfile.cpu", False)])
def test_dockerfiles(name, gpu, pyproject):
    assert dockerfile_problems(DOCKER / name, gpu, pyproject) == []


@pytest.mark.parametrize(
    "name,gpu,old,new",
    [
        ("Dockerfile", True, "pip install --no-build-isolation flash-attn", "pip install flash-attn"),
        ("Dockerfile", True, "cudnn-devel", "cudnn-runtime"),
        ("Dockerfile", True, "COPY configs ./configs", "COPY config ./configs"),
        ("Dockerfile.cpu", False, "torch==2.13.0", "torch==2.12.0"),
        ("Dockerfile", True, "TORCH_INDEX=https://download.pytorch.org/whl/cu128", "TORCH_INDEX=https://x.org/whl/cpu"),
        ("Dockerfile.cpu", False, "--index-url https://download.pytorch.org/whl/cpu ", ""),
        ("Dockerfile.cpu", False, "COPY actors ./actors\n", ""),
        ("Dockerfile.cpu", False, "USER ray", "USER root"),
        ("Dockerfile.cpu", False, "WORKDIR /app", "WORKDIR /srv"),
        ("Dockerfile.cpu", False, " wget", ""),
    ],
)
def test_dockerfile_checks_reject_broken_copies(tmp_path, pyproject, name, gpu, old, new):
    text = (DOCKER / name).read_text()
    assert old in text
    (tmp_path / name).write_text(text.replace(old, new))
    (tmp_path / f"{name}.dockerignore").write_text((DOCKER / f"{name}.dockerignore").read_text())
    assert dockerfile_problems(tmp_path / name, gpu, pyproject)


# --- the readiness probe against a real gRPC server -------------------------------------------------------------------
@pytest.fixture
def health_server():
    """A loopback gRPC server answering the Health RPC with whatever the test puts in `reply`."""
    from concurrent import futures

    import grpc

    from protos import spyglass_pb2 as pb
    from protos import spyglass_pb2_grpc as pb_grpc

    state: dict[str, Any] = {"reply": pb.HealthResponse(status="ok")}

    class Servicer(pb_grpc.SpyglassServicer):
        def Health(self, request, context):
            return state["reply"]

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_SpyglassServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    state["port"] = port
    yield state, pb
    server.stop(grace=None)


def _probe(files, port: int) -> subprocess.CompletedProcess:
    command = list(_worker(find(files["rayservice.yaml"], "RayService"))["readinessProbe"]["exec"]["command"])
    command[0] = str(SPYGLASS)
    command[command.index("--server") + 1] = f"127.0.0.1:{port}"
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_readiness_probe_follows_the_health_rpc(files, health_server):
    state, pb = health_server
    state["reply"] = pb.HealthResponse(
        status="degraded",
        replicas=[
            pb.ReplicaHealth(name="verifier-0", total_kv_slots=4, free_kv_slots=4),
            pb.ReplicaHealth(name="verifier-1"),
        ],
    )
    ready = _probe(files, state["port"])
    assert ready.returncode == 0, ready.stderr
    assert json.loads(ready.stdout)["replicas"][0]["name"] == "verifier-0"
    state["reply"] = pb.HealthResponse(status="degraded", replicas=[pb.ReplicaHealth(name="verifier-0")])
    not_ready = _probe(files, state["port"])
    assert not_ready.returncode == 1 and "no verifier replica is serving" in not_ready.stderr


def test_readiness_probe_fails_without_a_server(files):
    from services.local_redis import free_port

    down = _probe(files, free_port())
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
