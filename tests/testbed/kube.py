"""A real Kubernetes control plane for tests: etcd + kube-apiserver (+ controller-manager).

Built from Debian's source package by build-kube.sh (v1.20). Everything listens on
127.0.0.1 only. The apiserver has its own CA and serving cert, a static admin token,
RBAC authorization and a service-account signing key. There is no kubelet: tests play
the kubelet by patching pod and node status, as envtest does.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from testbed.guest import cache_dir
from testbed.ports import free_port


def kube_bin(name: str) -> Path:
    path = cache_dir() / "kube" / name
    if not path.exists():
        raise RuntimeError(f"{path} missing: run tests/testbed/build-kube.sh (make kube)")
    return path


@dataclass
class ControlPlane:
    url: str
    token: str
    ca_file: Path
    kubeconfig: Path
    workdir: Path
    pids: list[int] = field(default_factory=list)

    def stop(self) -> None:
        for pid in reversed(self.pids):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.pids.clear()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_pki(pki: Path) -> None:
    pki.mkdir(parents=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "7", "-subj", "/CN=ibckpt-test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=pki)  # fmt: skip
    (pki / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver",
             "-keyout", "apiserver.key", "-out", "apiserver.csr", cwd=pki)  # fmt: skip
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "7", "-extfile", "san.cnf", "-out", "apiserver.crt", cwd=pki)  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    for key in pki.glob("*.key"):
        key.chmod(0o600)


def write_kubeconfig(path: Path, url: str, ca_file: Path, token: str, user: str = "admin") -> None:
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: ibckpt-test
  cluster: {{server: "{url}", certificate-authority: "{ca_file}"}}
users:
- name: {user}
  user: {{token: "{token}"}}
contexts:
- name: ibckpt-test
  context: {{cluster: ibckpt-test, user: {user}}}
current-context: ibckpt-test
"""
    )
    path.chmod(0o600)


def _spawn(args: Sequence[str], log: Path) -> int:
    with open(log, "wb") as out:
        proc = subprocess.Popen(list(args), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc.pid


def _wait_ready(url: str, ca_file: Path, token: str, timeout: float, log: Path) -> None:
    ctx = ssl.create_default_context(cafile=str(ca_file))
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        req = urllib.request.Request(f"{url}/readyz", headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    raise RuntimeError(f"kube-apiserver not ready at {url} within {timeout}s ({last})\n{tail}")


def start_control_plane(workdir: Path | None = None, controller_manager: bool = True) -> ControlPlane:
    root = Path(workdir or tempfile.mkdtemp(prefix="ibckpt-kube-"))
    pki = root / "pki"
    _make_pki(pki)
    token = secrets.token_hex(16)
    tokens = root / "tokens.csv"
    tokens.write_text(f'{token},admin,admin-uid,"system:masters"\n')
    tokens.chmod(0o600)

    etcd_client, etcd_peer, api_port = free_port(), free_port(), free_port()
    plane = ControlPlane(f"https://127.0.0.1:{api_port}", token, pki / "ca.crt", root / "kubeconfig", root)
    try:
        plane.pids.append(
            _spawn(
                [
                    str(kube_bin("etcd")),
                    f"--data-dir={root / 'etcd'}",
                    f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                    "--unsafe-no-fsync",
                ],
                root / "etcd.log",
            )
        )
        api_log = root / "apiserver.log"
        plane.pids.append(
            _spawn(
                [
                    str(kube_bin("kube-apiserver")),
                    f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    f"--secure-port={api_port}",
                    "--insecure-port=0",
                    f"--tls-cert-file={pki / 'apiserver.crt'}",
                    f"--tls-private-key-file={pki / 'apiserver.key'}",
                    f"--client-ca-file={pki / 'ca.crt'}",
                    f"--token-auth-file={tokens}",
                    "--authorization-mode=RBAC",
                    # Real clusters allow privileged pods (the node agent is one).
                    "--allow-privileged=true",
                    f"--service-account-key-file={pki / 'sa.pub'}",
                    f"--service-account-signing-key-file={pki / 'sa.key'}",
                    "--service-account-issuer=https://kubernetes.default.svc",
                    "--api-audiences=https://kubernetes.default.svc",
                    # Service IPs are only allocated, never routed: there is no kube-proxy.
                    "--service-cluster-ip-range=10.96.0.0/16",
                    "--endpoint-reconciler-type=none",
                    "--disable-admission-plugins=ServiceAccount",
                    f"--cert-dir={root / 'certs'}",
                ],
                api_log,
            )
        )
        _wait_ready(plane.url, plane.ca_file, token, 60.0, api_log)
        write_kubeconfig(plane.kubeconfig, plane.url, plane.ca_file, token)
        if controller_manager:
            plane.pids.append(
                _spawn(
                    [
                        str(kube_bin("kube-controller-manager")),
                        f"--kubeconfig={plane.kubeconfig}",
                        "--controllers=garbagecollector,namespace,serviceaccount-token",
                        f"--service-account-private-key-file={pki / 'sa.key'}",
                        f"--root-ca-file={pki / 'ca.crt'}",
                        "--leader-elect=false",
                        "--port=0",
                        "--secure-port=0",
                    ],
                    root / "controller-manager.log",
                )
            )
    except BaseException:
        plane.stop()
        raise
    return plane
