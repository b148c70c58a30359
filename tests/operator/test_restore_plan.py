"""The restore's pure decisions: pod templates, destination pods, placement, versions and devices."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ibckpt.api import CheckpointPod, PodTemplate, RequiredVersions
from ibckpt_operator.machine.podtemplate import RESTORE_FROM, RESTORED_BY, destination_pod, sanitize
from ibckpt_operator.machine.restoreplan import (
    HOSTNAME_LABEL,
    AddressConflict,
    AddressMove,
    NodeFacts,
    NoNode,
    SourcePod,
    address_map,
    device_problems,
    incompatibilities,
    newest,
    place_pods,
    rank_parts,
    release,
    unchecked,
)

TOKEN_MOUNT = {"name": "kube-api-access-x7k2p", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
               "readOnly": True}  # fmt: skip


def live_pod(**spec: Any) -> dict[str, Any]:
    """A pod as the apiserver returns it once admission, the scheduler and the kubelet had their say."""
    return {
        "metadata": {
            "name": "ring-0",
            "namespace": "hpc",
            "uid": "3f1c",
            "resourceVersion": "812",
            "creationTimestamp": "2026-11-25T01:00:00Z",
            "labels": {"app": "ring"},
            "annotations": {"team": "solver", RESTORE_FROM: "hpc/older", RESTORED_BY: "u/r"},
            "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": "ring", "uid": "9a", "controller": True}
            ],
            "managedFields": [{"manager": "kube-controller-manager"}],
        },
        "spec": {
            "hostname": "ring-0",
            "subdomain": "ring",
            "nodeName": "node-1",
            "serviceAccountName": "solver",
            "serviceAccount": "solver",
            "runtimeClassName": "ibckpt",
            "priority": 0,
            "overhead": {"memory": "16Mi"},
            "restartPolicy": "Never",
            "nodeSelector": {"rdma": "rxe"},
            "tolerations": [{"key": "rdma", "operator": "Exists"}],
            "securityContext": {"runAsUser": 1000},
            "containers": [
                {
                    "name": "main",
                    "image": "ring:1",
                    "env": [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "db", "key": "pw"}}}],
                    "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}, TOKEN_MOUNT],
                }
            ],
            "volumes": [
                {"name": "scratch", "emptyDir": {}},
                {
                    "name": "kube-api-access-x7k2p",
                    "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]},
                },
            ],
            **spec,
        },
        "status": {"phase": "Running", "podIP": "10.1.0.4", "hostIP": "10.77.0.1"},
    }


def test_a_template_keeps_the_pod_and_drops_this_incarnation() -> None:
    pod = live_pod()
    before = copy.deepcopy(pod)
    template = sanitize(pod)
    assert pod == before  # the body read from the apiserver is not changed
    assert template.labels == {"app": "ring"}
    assert template.annotations == {"team": "solver"}  # no restore marker carried into a checkpoint
    assert template.controller is not None and (template.controller.kind, template.controller.name) == (
        "Job",
        "ring",
    )
    spec = template.spec
    for dropped in ("nodeName", "serviceAccount", "priority", "overhead"):
        assert dropped not in spec, dropped
    for kept in ("hostname", "subdomain", "serviceAccountName", "runtimeClassName", "restartPolicy",
                 "nodeSelector", "tolerations", "securityContext"):  # fmt: skip
        assert spec[kept] == before["spec"][kept], kept
    # The admission controller's token volume goes (a new pod gets its own), the user's volume stays.
    assert spec["volumes"] == [{"name": "scratch", "emptyDir": {}}]
    assert spec["containers"][0]["volumeMounts"] == [{"name": "scratch", "mountPath": "/scratch"}]
    # A Secret stays a reference: nothing is resolved into the template.
    assert spec["containers"][0]["env"] == before["spec"]["containers"][0]["env"]
    wire = CheckpointPod(name="ring-0", template=template).to_wire()
    for incarnation in ("3f1c", "812", "managedFields", "10.1.0.4", "node-1", "kube-api-access"):
        assert incarnation not in str(wire), incarnation


def test_a_legacy_token_secret_volume_goes_but_a_users_secret_volume_stays() -> None:
    legacy = {"name": "solver-token-abcde", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}
    pod = live_pod(
        volumes=[{"name": "solver-token-abcde", "secret": {"secretName": "solver-token-abcde"}},
                 {"name": "certs", "secret": {"secretName": "certs"}}],
        containers=[{"name": "main", "image": "ring:1",
                     "volumeMounts": [legacy, {"name": "certs", "mountPath": "/certs"}]}],
    )  # fmt: skip
    spec = sanitize(pod).spec
    assert spec["volumes"] == [{"name": "certs", "secret": {"secretName": "certs"}}]
    assert spec["containers"][0]["volumeMounts"] == [{"name": "certs", "mountPath": "/certs"}]


def test_a_pod_without_a_controller_or_token_keeps_everything_else() -> None:
    pod = live_pod(volumes=[], containers=[{"name": "main", "image": "ring:1"}])
    del pod["metadata"]["ownerReferences"]
    template = sanitize(pod)
    assert template.controller is None and template.spec["volumes"] == []


OWNER = {
    "apiVersion": "ibckpt.io/v1alpha1",
    "kind": "RestoreJob",
    "name": "back",
    "uid": "rj1",
    "controller": True,
}


def test_the_destination_pod_has_the_same_identity_on_the_chosen_node() -> None:
    template = sanitize(live_pod())
    pod = destination_pod(template, name="ring-0", namespace="hpc", node="node-2", checkpoint="hpc/ring-c1",
                          restored_by="rj1/abcd", owner=OWNER)  # fmt: skip
    meta, spec = pod["metadata"], pod["spec"]
    assert (meta["name"], meta["namespace"], spec["hostname"], spec["subdomain"]) == (
        "ring-0",
        "hpc",
        "ring-0",
        "ring",
    )
    assert spec["nodeName"] == "node-2" and spec["runtimeClassName"] == "ibckpt"
    assert meta["annotations"] == {"team": "solver", RESTORE_FROM: "hpc/ring-c1", RESTORED_BY: "rj1/abcd"}
    assert meta["labels"] == {"app": "ring"}
    # The source had a controller (a Job): the restored pod is not made the RestoreJob's.
    assert "ownerReferences" not in meta
    assert "nodeName" not in template.spec  # the template itself is unchanged


def test_a_bare_source_pod_is_owned_by_the_restore() -> None:
    template = PodTemplate(spec={"containers": [{"name": "main", "image": "ring:1"}]})
    pod = destination_pod(template, name="solo", namespace="hpc", node="node-1", checkpoint="hpc/c",
                          restored_by="rj1/abcd", owner=OWNER)  # fmt: skip
    assert pod["metadata"]["ownerReferences"] == [OWNER] and "labels" not in pod["metadata"]


def test_placement_keeps_the_source_node_or_spreads_by_load() -> None:
    pods = [SourcePod("ring-0", "node-1"), SourcePod("ring-1", "node-2"), SourcePod("ring-2", "node-9")]
    three = {"node-1": {}, "node-2": {}, "node-3": {}}
    assert place_pods(pods, three, avoid_source_nodes=False) == {
        "ring-0": "node-1",
        "ring-1": "node-2",
        "ring-2": "node-3",  # its node is gone: the least loaded
    }
    swapped = place_pods(pods[:2], {"node-1": {}, "node-2": {}}, avoid_source_nodes=True)
    assert swapped == {"ring-0": "node-2", "ring-1": "node-1"}
    with pytest.raises(NoNode, match="can take pod ring-0"):
        place_pods(pods[:1], {"node-1": {}}, avoid_source_nodes=True)
    with pytest.raises(NoNode):
        place_pods(pods[:1], {}, avoid_source_nodes=False)


def test_placement_honours_the_pods_own_node_selector_but_not_its_hostname_pin() -> None:
    labels = {"node-1": {"rdma": "rxe", HOSTNAME_LABEL: "node-1"}, "node-2": {HOSTNAME_LABEL: "node-2"},
              "node-3": {"rdma": "rxe", HOSTNAME_LABEL: "node-3"}}  # fmt: skip
    pinned = SourcePod("ring-0", "node-1", {"rdma": "rxe", HOSTNAME_LABEL: "node-1"})
    assert place_pods([pinned], labels, avoid_source_nodes=True) == {"ring-0": "node-3"}  # not node-2
    with pytest.raises(NoNode, match="no Ready node with rdma=rxe"):
        place_pods(
            [pinned], {"node-1": labels["node-1"], "node-2": labels["node-2"]}, avoid_source_nodes=True
        )
    template = PodTemplate(spec={"nodeSelector": {HOSTNAME_LABEL: "node-1"}, "containers": []})
    pod = destination_pod(template, name="ring-0", namespace="hpc", node="node-3", checkpoint="hpc/c",
                          restored_by="u/r", owner=None)  # fmt: skip
    assert "nodeSelector" not in pod["spec"] and pod["spec"]["nodeName"] == "node-3"


# An agent that reports no formats (a release before them) is judged by its version.
@pytest.mark.parametrize(
    ("required", "facts", "problems"),
    [
        (RequiredVersions(ibckpt="0.1.0", kernel="6.1.0-13-amd64"), NodeFacts("0.1.2", "6.1.0-21-amd64"), []),
        (RequiredVersions(ibckpt="0.1.0"), NodeFacts("0.2.0"), ["its ibckpt agent is 0.2.0"]),
        (RequiredVersions(ibckpt="0.1.3"), NodeFacts("0.1.2"), ["checkpoint was taken with ibckpt 0.1.3"]),
        (RequiredVersions(ibckpt="1.2.0"), NodeFacts("1.4.1"), []),
        (RequiredVersions(ibckpt="1.2.0"), NodeFacts("2.0.0"), ["its ibckpt agent is 2.0.0"]),
        (RequiredVersions(kernel="6.1.0"), NodeFacts(kernel="5.10.0-28-amd64"), ["its kernel is 5.10.0-28"]),
        (RequiredVersions(kernel="6.1.0"), NodeFacts(kernel="6.6.3"), []),
        (RequiredVersions(ibckpt="dev"), NodeFacts("test"), ["its ibckpt agent is test"]),
        (RequiredVersions(ibckpt="test"), NodeFacts("test"), []),
        (RequiredVersions(ibckpt="0.1.0", kernel="6.1"), NodeFacts(), []),  # nothing reported: not refused
        (None, NodeFacts("9.9", "1.0"), []),
    ],
)
def test_compatibility(required: RequiredVersions | None, facts: NodeFacts, problems: list[str]) -> None:
    found = incompatibilities(required, facts)
    assert len(found) == len(problems), found
    for problem, text in zip(problems, found, strict=True):
        assert problem in text


READS = {"manifest": [1, 2], "chunks": [1], "restore": [1], "shimProtocol": [1]}
WRITTEN = {"manifest": 2, "chunks": 1, "restore": 1, "shimProtocol": 1}


@pytest.mark.parametrize(
    ("required", "facts", "problems"),
    [
        # a newer minor release that reads the checkpoint's formats restores it: the version is not compared
        (RequiredVersions(ibckpt="0.1.0", formats=WRITTEN), NodeFacts("0.2.0", reads=READS), []),
        (RequiredVersions(ibckpt="0.1.0", formats=WRITTEN), NodeFacts("1.0.0", reads=READS), []),
        # recorded before formats were: what every release until then wrote
        (RequiredVersions(ibckpt="0.1.0"), NodeFacts("0.2.0", reads=READS), []),
        (RequiredVersions(ibckpt="0.1.0"), NodeFacts("0.3.0", reads={**READS, "restore": [2]}),
         ["the checkpoint's restore record format is 1, its agent reads 2 (ibckpt 0.3.0)"]),
        # a format the node's agent does not read, or does not know at all
        (RequiredVersions(ibckpt="0.3.0", formats={**WRITTEN, "restore": 2}), NodeFacts("0.3.1", reads=READS),
         ["the checkpoint's restore record format is 2, its agent reads 1 (ibckpt 0.3.1)"]),
        (RequiredVersions(formats={**WRITTEN, "manifest": 3, "shimProtocol": 2}),
         NodeFacts("0.2.0", reads=READS),
         ["the checkpoint's store manifest schema is 3, its agent reads 1, 2",
          "the checkpoint's shim control protocol is 2, its agent reads 1"]),
        (RequiredVersions(formats={**WRITTEN, "gpu": 1}), NodeFacts("0.2.0", reads=READS),
         ["the checkpoint's gpu format is 1, its agent reads none"]),
        (RequiredVersions(formats=WRITTEN, kernel="6.1"), NodeFacts("0.2.0", "5.10", READS),
         ["its kernel is 5.10"]),
        # the shim build: an agent before builds were kept has one, the same build restores, another not
        (RequiredVersions(formats=WRITTEN, shim="a" * 64), NodeFacts("0.2.0", reads=READS, shim="a" * 64),
         []),
        (RequiredVersions(formats=WRITTEN, shim="a" * 64), NodeFacts("0.2.0", reads=READS, shim="b" * 64),
         ["it does not keep shim build aaaaaaaaaaaa, which the checkpoint's processes mapped "
          "(it keeps bbbbbbbbbbbb"]),
        # a node that keeps the checkpoint's build beside a newer current one restores; one without refuses
        (RequiredVersions(formats=WRITTEN, shim="a" * 64),
         NodeFacts("0.2.0", reads=READS, shim="b" * 64, shim_builds=["a" * 64, "b" * 64]), []),
        (RequiredVersions(formats=WRITTEN, shim="a" * 64),
         NodeFacts("0.2.0", reads=READS, shim="b" * 64, shim_builds=["b" * 64, "c" * 64]),
         ["it does not keep shim build aaaaaaaaaaaa, which the checkpoint's processes mapped "
          "(it keeps bbbbbbbbbbbb, cccccccccccc"]),
        (RequiredVersions(formats=WRITTEN, shim="a" * 64), NodeFacts("0.2.0", reads=READS), []),
    ],
)  # fmt: skip
def test_compatibility_by_formats(required: RequiredVersions, facts: NodeFacts, problems: list[str]) -> None:
    found = incompatibilities(required, facts)
    assert len(found) == len(problems), found
    assert all(problem in text for problem, text in zip(problems, found, strict=True)), found


def test_versions_parse_and_the_newest_wins() -> None:
    assert release("6.1.0-13-amd64") == (6, 1, 0) and release("v1.20.15") == (1, 20, 15)
    assert release("test") is None
    assert newest(["6.1.0-13-amd64", None, "6.10.2", "6.9"]) == "6.10.2"
    assert newest([None, None]) is None
    assert unchecked(RequiredVersions(criu="4.1", kernel="6.1")) == ["criu"]


def test_rank_keys_have_four_parts() -> None:
    assert rank_parts("ring/ring-0/main/7") == ("ring", "ring-0", "main", "7")
    with pytest.raises(ValueError, match="not job/pod/container/process"):
        rank_parts("hpc/ring/ring-0/main/7")  # a namespaced job name cannot be told apart


def test_hostnetwork_pods_drained_onto_one_node_map_their_old_address_to_it() -> None:
    # ring-0 leaves node-1 for node-2, ring-1 stays on node-2: only node-1's address changes
    moves = [AddressMove("ring-0", "10.77.0.1", "10.77.0.2"), AddressMove("ring-1", "10.77.0.2", "10.77.0.2")]
    assert address_map(moves) == {"10.77.0.1": "10.77.0.2"}


def test_swapped_hostnetwork_pods_swap_addresses_and_unknown_addresses_are_left_out() -> None:
    moves = [
        AddressMove("a", "10.77.0.1", "10.77.0.2"),
        AddressMove("b", "10.77.0.2", "10.77.0.1"),
        AddressMove("c", "", "10.77.0.1"),  # recorded before the Checkpoint kept node addresses
    ]
    assert address_map(moves) == {"10.77.0.1": "10.77.0.2", "10.77.0.2": "10.77.0.1"}
    assert address_map([]) == {}


def test_hostnetwork_pods_of_one_node_split_over_two_is_refused_naming_both() -> None:
    moves = [
        AddressMove("launcher", "10.77.0.1", "10.77.0.2"),
        AddressMove("worker", "10.77.0.1", "10.77.0.3"),
    ]
    with pytest.raises(AddressConflict, match=r"launcher and worker both ran on address 10\.77\.0\.1"):
        address_map(moves)


def test_a_pods_devices_are_checked_per_container_against_what_the_node_reports() -> None:
    used = {"ring-0.main": ["mlx5_0", "mlx5_1"], "ring-0.side": ["mlx5_0"]}
    assert device_problems(used, NodeFacts(rdma_devices=["rxe0", "rxe1"]), None) == []
    assert device_problems(used, NodeFacts(rdma_devices=["rxe0"]), None) == [
        "container ring-0.main: its ranks used 2 RDMA devices (mlx5_0, mlx5_1), the node has 1 (rxe0)"
    ]
    assert device_problems(used, NodeFacts(rdma_devices=["rxe0", "rxe1"]), {"mlx5_0": "mlx5_0"}) == [
        "container ring-0.main: the deviceMap names mlx5_0, not among the node's rxe0, rxe1",
        "container ring-0.side: the deviceMap names mlx5_0, not among the node's rxe0, rxe1",
    ]
    assert device_problems(used, NodeFacts(), None) == []  # an agent that does not report its devices
