"""Where the gRPC proxy listens, and TLS on it (services/grpc_bind.py), on a real stack: the session's local Ray
cluster, Serve with the gateway and one verifier (SmolLM2, `ar` only, no warm-up), real gRPC through the SDK.

Two stacks, one after the other (a class each, so the first is shut down before the second starts): plaintext
on the default host, then TLS with a self-signed certificate made here. "Not reachable from outside" is
checked on this machine's own non-loopback addresses (a dummy interface is created when there is none and
this runs as root), next to a control listener on every interface that is reachable there.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import socket
import subprocess
import sys

import grpc
import pytest

from services import grpc_bind
from spyglass.client import Client, SpyglassError

PROMPT = "List the days of the week, one per line."
DUMMY_IF, DUMMY_ADDR = "spyglass-t0", "10.123.0.1"


# --- pure parts (no cluster) --------------------------------------------------------------------------------
def test_addresses_and_settings():
    assert grpc_bind.bind_address(9000) == "127.0.0.1:9000"
    assert grpc_bind.bind_address(9000, "::1") == "[::1]:9000" == grpc_bind.bind_address(9000, "[::1]")
    assert grpc_bind.dial_address("0.0.0.0", 9000) == "127.0.0.1:9000"
    assert grpc_bind.dial_address("::", 9000) == "127.0.0.1:9000"
    assert grpc_bind.dial_address("10.1.2.3", 9000) == "10.1.2.3:9000"
    assert grpc_bind.controller_env("127.0.0.1") == {grpc_bind.HOST_ENV: "127.0.0.1"}


def test_bad_settings_fail_before_anything_starts(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    with pytest.raises(ValueError, match="both a certificate and its key"):
        grpc_bind.controller_env("127.0.0.1", str(cert), None)
    with pytest.raises(ValueError, match="cannot read"):
        grpc_bind.controller_env("127.0.0.1", str(cert), str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="gRPC host"):
        grpc_bind.controller_env("no-such-host.invalid")
    with pytest.raises(ValueError, match="not a PEM certificate and its private key"):
        grpc_bind.controller_env("127.0.0.1", str(cert), str(cert))
    (cert_a, key_a, _), (_, key_b, _) = self_signed(tmp_path, "a"), self_signed(tmp_path, "b")
    with pytest.raises(ValueError, match="not a PEM certificate and its private key"):
        grpc_bind.controller_env("127.0.0.1", cert_a, key_b)  # a key that is not the certificate's
    env = grpc_bind.controller_env("127.0.0.1", cert_a, key_a)
    assert env[grpc_bind.TLS_CERT_ENV] == cert_a and env[grpc_bind.TLS_KEY_ENV] == key_a


def test_hook_patches_serve_only_when_serve_is_imported():
    """In a fresh process, as in a Ray worker: `install` imports nothing of Serve; Serve's import is patched."""
    code = (
        "import sys; from services import grpc_bind; grpc_bind.install(); "
        "assert grpc_bind._TARGET not in sys.modules, 'Serve imported by the hook'; "
        "from ray.serve._private import grpc_util; from ray.serve._private.default_impl import add_grpc_address; "
        "assert add_grpc_address is grpc_bind._add_grpc_address, add_grpc_address; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# --- helpers ----------------------------------------------------------------------------------------------------
def outside_addresses() -> list[str]:
    """This machine's global-scope addresses (not loopback)."""
    out = subprocess.run(["ip", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True)
    addrs = []
    for line in out.stdout.splitlines():
        fields = line.split()
        for kind in ("inet", "inet6"):
            if kind in fields:
                addr = fields[fields.index(kind) + 1].split("/")[0]
                if not ipaddress.ip_address(addr).is_loopback:
                    addrs.append(addr)
    return addrs


@pytest.fixture(scope="module")
def outside():
    """Non-loopback addresses of this machine, each shown reachable by a listener on every interface."""
    created = False
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command to list this machine's addresses")
    if not outside_addresses() and os.geteuid() == 0:
        for cmd in (
            ["ip", "link", "add", DUMMY_IF, "type", "dummy"],
            ["ip", "addr", "add", f"{DUMMY_ADDR}/24", "dev", DUMMY_IF],
            ["ip", "link", "set", DUMMY_IF, "up"],
        ):
            subprocess.run(cmd, check=True, capture_output=True)
        created = True
    addrs = outside_addresses()
    if not addrs:
        pytest.skip("this machine has no non-loopback address and cannot create one (not root)")
    try:
        with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as control:
            port = control.getsockname()[1]
            for addr in addrs:  # the control: a socket on every interface is reachable at each address
                socket.create_connection((addr, port), timeout=5).close()
        yield addrs
    finally:
        if created:
            subprocess.run(["ip", "link", "del", DUMMY_IF], capture_output=True)


def assert_not_reachable(addrs: list[str], port: int) -> None:
    for addr in addrs:
        with pytest.raises(OSError):  # refused: nothing listens there
            socket.create_connection((addr, port), timeout=5).close()
        target = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
        with Client(target, timeout=10, retries=0) as c, pytest.raises(SpyglassError) as e:
            c.health()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


def self_signed(tmp_path, name: str) -> tuple[str, str, bytes]:
    """A self-signed certificate for 127.0.0.1 and localhost: (cert path, key path, cert PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    cert_path, key_path = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_path.write_bytes(pem)
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path), pem


def start_stack(tls_cert: str | None = None, tls_key: str | None = None, tls: bool | bytes = False):
    """Deploy the app (default gRPC host) and wait for it; yields (dial address, port). Shut down after."""
    from ray import serve

    from services.app import deploy, wait_ready
    from services.local_redis import free_port

    args = {
        "num_verifiers": 1,
        "verifier": {"methods": ["ar"], "max_batch": 1, "max_context": 512, "threads": 1, "warmup_prompt_tokens": 0},
    }
    doc = {"applications": [{"name": "spyglass", "route_prefix": "/", "args": args}]}
    port = free_port()
    try:  # a failed start must not leave Serve (and its proxy's port) behind for the next test
        address, _ = deploy(doc, grpc_port=port, http_port=free_port(), tls_cert=tls_cert, tls_key=tls_key)
        wait_ready(address, timeout_s=300, tls=tls)
        yield address, port
    finally:
        serve.shutdown()


# --- the default host, plaintext -----------------------------------------------------------------------------
class TestLoopback:
    @pytest.fixture(scope="class")
    def stack(self, ray_cluster):
        yield from start_stack()

    def test_request_through_loopback(self, stack):
        address, port = stack
        assert address == f"127.0.0.1:{port}"
        with Client(address, timeout=120) as c:
            out = c.generate_text(PROMPT, max_new_tokens=4, method="ar")
        assert len(out.token_ids) == 4 and out.text

    def test_port_not_reachable_from_outside(self, stack, outside):
        assert_not_reachable(outside, stack[1])

    def test_cluster_nodes_on_loopback(self, stack, ray_cluster):
        # Ray reads the loopback switch when imported; set later, the node registered on eth0.
        assert {n["NodeManagerAddress"] for n in ray_cluster.nodes() if n["Alive"]} == {"127.0.0.1"}


# --- TLS -------------------------------------------------------------------------------------------------------
class TestTLS:
    @pytest.fixture(scope="class")
    def certs(self, tmp_path_factory):
        tmp = tmp_path_factory.mktemp("tls")
        return self_signed(tmp, "spyglass-test"), self_signed(tmp, "someone-else")

    @pytest.fixture(scope="class")
    def stack(self, ray_cluster, certs):
        (cert, key, pem), _ = certs
        yield from start_stack(cert, key, tls=pem)

    def test_tls_client_trusting_the_certificate_succeeds(self, stack, certs):
        (_, _, pem), _ = certs
        with Client(stack[0], timeout=120, tls=pem) as c:
            out = c.generate_text(PROMPT, max_new_tokens=4, method="ar")
            assert c.health()["status"] == "ok"
        assert len(out.token_ids) == 4 and out.text

    def test_plaintext_and_untrusting_clients_fail(self, stack, certs):
        _, (_, _, other_pem) = certs
        for tls in (False, other_pem):
            with Client(stack[0], timeout=10, retries=0, tls=tls) as c, pytest.raises(SpyglassError) as e:
                c.health()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE, (tls, e.value)

    def test_tls_port_not_reachable_from_outside(self, stack, outside):
        assert_not_reachable(outside, stack[1])
