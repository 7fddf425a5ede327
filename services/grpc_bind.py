"""Where Ray Serve's gRPC proxy listens, and TLS on it.

Why this exists: Ray Serve 2.60 has no option for either. `ray.serve._private.grpc_util.start_grpc_server`
always calls `ray.serve._private.default_impl.add_grpc_address(server, "[::]:<port>")`, which adds a plaintext
port on every interface. `install` replaces that function, inside the worker process, with one that binds
$SPYGLASS_GRPC_HOST (default 127.0.0.1) and, when $SPYGLASS_TLS_CERT and $SPYGLASS_TLS_KEY name PEM files,
serves TLS there instead of plaintext.

How it reaches the proxy: `install` is a Ray `worker_process_setup_hook` (`runtime_env()`, given to ray.init),
so every worker process of the job runs it first, the Serve controller and the proxy actors the controller
creates included (actors inherit the job's runtime_env). It patches Serve's module when the worker imports it,
so workers that never use Serve do not import it. The settings travel as env vars of the controller's
runtime_env (`controller_env()`, serve.start's `controller_options`), which the proxies inherit; they are read
when the port is added, so each serve.start may use its own. The deploy side is services/app.py `deploy`.

It fails loudly: if Ray's internals no longer look as described, `check()` raises in the driver before Serve
starts, and the patch raises inside the worker's import of Serve (the proxy then fails to start and
serve.start raises), rather than leaving the proxy on every interface without saying so. A host that cannot
be bound fails serve.start the same way. On KubeRay the Serve controller is started by Ray itself, not by
`spyglass serve`, so none of this applies there: Serve's own [::] binding (needed in a pod) stays.
"""

from __future__ import annotations

import importlib.abc
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HOST_ENV = "SPYGLASS_GRPC_HOST"
TLS_CERT_ENV = "SPYGLASS_TLS_CERT"
TLS_KEY_ENV = "SPYGLASS_TLS_KEY"
DEFAULT_HOST = "127.0.0.1"
HOOK = f"{__name__}.install"
_MARK = "_spyglass_grpc_bind"
_TARGET = "ray.serve._private.default_impl"


def check() -> None:
    """Raise RuntimeError unless Serve still adds its gRPC port through `default_impl.add_grpc_address`."""
    from ray.serve._private import default_impl, grpc_util  # Serve's internals: only where the hook is checked

    start = getattr(grpc_util, "start_grpc_server", None)
    code = getattr(start, "__code__", None)
    if not callable(getattr(default_impl, "add_grpc_address", None)) or code is None:
        raise RuntimeError(
            "spyglass cannot set the gRPC proxy's host or TLS: ray.serve._private.default_impl.add_grpc_address "
            "or grpc_util.start_grpc_server is gone in this Ray version (written for Ray Serve 2.60)"
        )
    if "add_grpc_address" not in code.co_varnames + code.co_names:
        raise RuntimeError(
            "spyglass cannot set the gRPC proxy's host or TLS: Serve's start_grpc_server no longer adds its port "
            "through default_impl.add_grpc_address (written for Ray Serve 2.60)"
        )


def bind_address(port: int | str, host: str | None = None) -> str:
    """host:port as gRPC wants it (IPv6 hosts in brackets)."""
    host = (host or DEFAULT_HOST).strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def server_credentials(cert: str | None, key: str | None):
    """grpc server credentials from PEM cert + key files, or None when neither is given."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError(f"TLS needs both a certificate and its key ({TLS_CERT_ENV} and {TLS_KEY_ENV})")
    import grpc  # every Ray worker imports this module (the setup hook): grpc only where TLS is configured

    try:
        pair = (Path(key).read_bytes(), Path(cert).read_bytes())
    except OSError as e:
        raise ValueError(f"cannot read the TLS certificate or key: {e}") from e
    return grpc.ssl_server_credentials([pair])


def _add_grpc_address(grpc_server, server_address: str) -> int:
    port = server_address.rsplit(":", 1)[1]
    address = bind_address(port, os.environ.get(HOST_ENV))
    creds = server_credentials(os.environ.get(TLS_CERT_ENV), os.environ.get(TLS_KEY_ENV))
    bound = grpc_server.add_secure_port(address, creds) if creds else grpc_server.add_insecure_port(address)
    if not bound:
        raise RuntimeError(f"gRPC proxy: cannot bind {address}")
    return bound


def _patch(default_impl) -> None:
    check()
    if not getattr(default_impl.add_grpc_address, _MARK, False):
        setattr(_add_grpc_address, _MARK, True)
        default_impl.add_grpc_address = _add_grpc_address


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches Ray's default_impl right after it is first imported (found by the other finders as usual)."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """The worker_process_setup_hook: route Serve's gRPC port through `_add_grpc_address`.

    Serve is imported only by the processes that use it (the controller, proxies, replicas), so the patch is
    applied when that import happens: other workers of the job (extraction, training) do not pay for it."""
    if _TARGET in sys.modules:
        _patch(sys.modules[_TARGET])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def runtime_env() -> dict:
    """The job runtime_env for ray.init that installs the hook in every worker."""
    return {"worker_process_setup_hook": HOOK}


def hook_installed() -> bool:
    """Whether the connected Ray job's workers run `install` (ray.init was given `runtime_env()`)."""
    import ray  # Ray: this module is a Ray worker's setup hook, imported before Ray is set up
    from ray._private import ray_constants

    if not ray.is_initialized():  # get_runtime_context() would start a cluster
        return False
    env = ray.get_runtime_context().runtime_env or {}
    return (env.get("env_vars") or {}).get(ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR) == HOOK


def settings(host: str | None = None, tls_cert: str | None = None, tls_key: str | None = None):
    """(host, cert, key): the arguments, else $SPYGLASS_GRPC_HOST / $SPYGLASS_TLS_CERT / $SPYGLASS_TLS_KEY."""
    return (
        host or os.environ.get(HOST_ENV) or DEFAULT_HOST,
        tls_cert or os.environ.get(TLS_CERT_ENV) or None,
        tls_key or os.environ.get(TLS_KEY_ENV) or None,
    )


def controller_env(host: str, tls_cert: str | None = None, tls_key: str | None = None) -> dict[str, str]:
    """Validated settings as env vars for the Serve controller's runtime_env (the proxies inherit them): a bad
    host, a missing file or half a pair is a clear ValueError here rather than a proxy that cannot start."""
    try:
        socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"gRPC host {host!r}: {e}") from e
    creds = server_credentials(tls_cert, tls_key)
    if creds is not None:  # grpc checks the PEM and that the key matches only when a port is added
        import grpc  # as in server_credentials: only where TLS is configured

        probe = grpc.server(ThreadPoolExecutor(1))
        try:
            probe.add_secure_port("127.0.0.1:0", creds)
        except RuntimeError as e:
            raise ValueError(f"TLS: {tls_cert} and {tls_key} are not a PEM certificate and its private key") from e
        finally:
            probe.stop(None)
    env = {HOST_ENV: host}
    if tls_cert and tls_key:
        env[TLS_CERT_ENV] = str(Path(tls_cert).resolve())
        env[TLS_KEY_ENV] = str(Path(tls_key).resolve())
    return env


def dial_address(host: str, port: int) -> str:
    """The address a client on this machine dials: loopback when the proxy listens on every interface."""
    return bind_address(port, "127.0.0.1" if host.strip("[]") in ("0.0.0.0", "::") else host)
