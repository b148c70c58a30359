"""Session fixtures for the real parts: S3 (SeaweedFS), kube-apiserver, the two-node cluster, guests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from testbed import pods
from testbed.cluster import Cluster, start_cluster
from testbed.coordinator import ThreadedCoordinator
from testbed.gate import Gate
from testbed.kube import ControlPlane, start_control_plane
from testbed.reaper import die_with_parent
from testbed.release import SESSION_RELEASE, Release, install, storage_secret
from testbed.ring import PRODUCT_NS
from testbed.s3 import S3Server, start_s3, stop_s3

pytest_plugins = ["testbed.pytest_guest", "testbed.budget"]

CLUSTER_SETUP_S = 1500


def _order(item: pytest.Item) -> tuple[int, int]:
    if item.get_closest_marker("cluster"):
        # The long stories last, so a late session skips them and nothing else; `first` ones lead them.
        budget = item.get_closest_marker("budget")
        return (3, 0 if budget is None else 1 if budget.kwargs.get("first") else 2)
    if item.get_closest_marker("guest"):
        return (1, 0)
    if item.get_closest_marker("images"):
        return (1, 1)  # once the background build (below) has had the guest run's time
    if item.get_closest_marker("twoguests"):
        return (2, 0)
    if item.get_closest_marker("guest_selftest"):
        return (0, 1)  # its one guest runs on the core the host's tests leave free, beside the `guest` run
    return (0, 0)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The host's own tests run first, while the one guest of the `guest` tests boots and runs them in
    the background (it uses about one of the machine's cores; their stand-ins then wait less); the
    plugin's own check, one small guest, closes them. Tests that boot two guests come after the `guest`
    run, and the cluster's tests run last: its two node guests live from its first test to the
    session's end, and would slow every other guest test down while they run."""
    items.sort(key=_order)  # stable: files keep their order within each group
    first_cluster = next((item for item in items if item.get_closest_marker("cluster")), None)
    if first_cluster is not None:
        # Its setup boots the guests (4-5 min) and installs the chart, which waits for the operator to
        # lead (16 min in all on a loaded day): that time on top of what the test itself may take.
        own = first_cluster.get_closest_marker("timeout")
        limit = float(own.args[0]) if own and own.args else float(first_cluster.config.getini("timeout"))
        first_cluster.add_marker(pytest.mark.timeout(limit + CLUSTER_SETUP_S))


_IMAGES_BUILD = pytest.StashKey[subprocess.Popen[bytes]]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> None:
    """The node images (tests/testbed/images.py, minutes of buildah on a fresh machine) are built in
    the background once the host's own tests are done, on the core they leave free while the `guest`
    tests finish in their guest. Whoever needs the images first (the cluster, a packaging test) waits
    on the build's lock, then takes them from the cache."""
    config = item.config
    if os.environ.get("IBCKPT_GUEST") == "1" or _IMAGES_BUILD in config.stash or _order(item)[0] < 1:
        return
    session = item.session
    if not any(i.get_closest_marker("cluster") or i.get_closest_marker("images") for i in session.items):
        return
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    log = base / "images-build.log"
    with open(log, "wb") as out:
        config.stash[_IMAGES_BUILD] = subprocess.Popen(
            [sys.executable, "-m", "testbed.images", "build"], cwd=Path(__file__).parent,
            stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
        )  # fmt: skip


def pytest_sessionfinish(session: pytest.Session) -> None:
    build = session.config.stash.get(_IMAGES_BUILD, None)
    if build is not None and build.poll() is None:
        build.kill()
        build.wait()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real SeaweedFS S3 gateway on 127.0.0.1 that enforces SigV4."""
    server = start_s3(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        stop_s3(server)


@pytest.fixture(scope="session")
def s3_gate(s3_server: S3Server) -> Iterator[Gate]:
    """The session's S3 through a relay on 127.0.0.1 that a test can cut (an S3 outage) and mend."""
    gate = Gate(int(s3_server.endpoint.rsplit(":", 1)[1]))
    try:
        yield gate
    finally:
        gate.close()


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A real etcd + kube-apiserver (v1.20, RBAC) + controller-manager on 127.0.0.1."""
    plane = start_control_plane(tmp_path_factory.mktemp("kube"))
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kube_api(kube: ControlPlane):  # type: ignore[no-untyped-def]
    """A kubernetes.client.ApiClient authenticated as cluster admin."""
    import kubernetes

    client = kubernetes.config.new_client_from_config(str(kube.kubeconfig))
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, s3_gate: Gate
) -> Iterator[Cluster]:
    """A real two-node cluster (kubelet + containerd + runc in each Soft-RoCE guest), shared by the session.

    Pods reach the session's S3 at 10.0.2.100:<its port>, and through the gate at 10.0.2.100:<gate port>.
    Tests leave no pods behind them.
    """
    s3_port = int(s3_server.endpoint.rsplit(":", 1)[1])
    cluster = start_cluster(tmp_path_factory.mktemp("cluster"), forward_ports=[s3_port, s3_gate.port])
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def installed(cluster: Cluster, s3_server: S3Server) -> Iterator[Release]:
    """The chart, installed once for the session into PRODUCT_NS, which holds the session's S3 keys under
    the storage Secret's name (the agents stage images with them). Returns once the agents are Ready;
    the operator may still be starting (tests/helm/test_chart.py waits for it). tests/cluster asks for it
    first, so the operator's start (minutes on the emulated nodes) overlaps with those tests."""
    pods.namespace(cluster, PRODUCT_NS)
    storage_secret(cluster, PRODUCT_NS, s3_server.access_key, s3_server.secret_key)
    # The operator stays on node-2: the drain tests drain node-1 (docs/drains.md: keep the operator off
    # the nodes it migrates; a drain of its own node restarts it elsewhere mid-migration, not tested).
    # Failpoints on: test_faults holds an agent between its ranks' quiesce and drain to hang it there.
    release = install(
        cluster, SESSION_RELEASE, PRODUCT_NS, log_level="debug", operator_node="node-2", failpoints=True
    )
    try:
        yield release
    finally:
        release.uninstall()


@pytest.fixture
def coordinator() -> Iterator[ThreadedCoordinator]:
    """A job coordinator on 127.0.0.1, run in its own thread, for the two-guest node tests."""
    coord = ThreadedCoordinator()
    coord.start()
    try:
        yield coord
    finally:
        coord.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failure's text at once, not only in the summary: a run killed at CI's time limit never prints
    the summary, and the cluster tests' failures (with their cluster diagnosis) would be lost."""
    report = yield
    terminal = item.config.pluginmanager.getplugin("terminalreporter")
    if report.failed and terminal is not None:
        text = report.longreprtext
        if len(text) > 12000:
            text = text[:2000] + "\n[...]\n" + text[-10000:]
        terminal.write_line(f"\n=== FAILED {item.nodeid} ({call.when}) ===\n{text}\n=== end of failure ===")
    return report
