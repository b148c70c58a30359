"""Prerequisite decisions and the label and Event bodies the agent writes to its Node."""

from __future__ import annotations

from datetime import UTC, datetime

from ibckpt_node.nodesetup import nodeobjects, prereqs


def test_criu_versions() -> None:
    assert prereqs.criu(0, "Version: 3.17.1\n").ok
    assert prereqs.criu(0, "Version: 3.19\nGitID: v3.19\n").detail == "version 3.19.0"
    old = prereqs.criu(0, "Version: 3.16.1\n")
    assert not old.ok and old.detail == "version 3.16.1 is older than 3.17.0"
    assert "not found on the node's PATH" in prereqs.criu(None, "nsenter: failed to execute criu").detail
    assert "failed (status 1)" in prereqs.criu(1, "criu: error").detail
    assert not prereqs.criu(0, "something else").ok


def test_node_python() -> None:
    assert prereqs.python("/usr/bin/python3", 0, "3 11\n").detail == "/usr/bin/python3 (Python 3.11)"
    assert "older than 3.9" in prereqs.python("/usr/bin/python3", 0, "3 6\n").detail
    assert not prereqs.python("/usr/bin/python3", None, "").ok
    assert not prereqs.python("/usr/bin/python3", 1, "Traceback").ok


def test_executables_and_kernel() -> None:
    assert prereqs.executable("next runtime", "/usr/sbin/runc", True, True).ok
    assert "does not exist" in prereqs.executable("next runtime", "/x", False, False).detail
    assert "not executable" in prereqs.executable("next runtime", "/x", True, False).detail
    found = prereqs.kernel({path: path != "/proc/sys/kernel/ns_last_pid" for path in prereqs.KERNEL_PATHS})
    assert [f.name for f in prereqs.missing(found)] == [
        "kernel: CONFIG_CHECKPOINT_RESTORE (CRIU sets pids through ns_last_pid)"
    ]


def test_the_summary_names_every_missing_one() -> None:
    findings = [
        prereqs.criu(0, "Version: 3.16\n"),
        prereqs.executable("next runtime", "/usr/bin/nvidia-container-runtime", False, False),
        prereqs.python("/usr/bin/python3", 0, "3 11"),
    ]
    assert prereqs.summary("node-1", findings) == (
        "node node-1 lacks what the ibckpt agent needs: criu: version 3.16.0 is older than 3.17.0; "
        "next runtime: /usr/bin/nvidia-container-runtime does not exist on the node"
    )
    assert prereqs.summary("node-1", findings[2:]) == "node node-1 has every prerequisite of the ibckpt agent"


def test_label_patches() -> None:
    assert nodeobjects.label_patch(True) == {"metadata": {"labels": {"ibckpt.io/runtime-ready": "true"}}}
    assert nodeobjects.label_patch(False) == {"metadata": {"labels": {"ibckpt.io/runtime-ready": None}}}
    assert nodeobjects.is_labelled({"metadata": {"labels": {"ibckpt.io/runtime-ready": "true"}}})
    assert not nodeobjects.is_labelled({"metadata": {}})


def test_event_body() -> None:
    now = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC)
    body = nodeobjects.event_body("node-1", "uid-1", nodeobjects.REASON_MISSING, "criu: missing" * 200, now)
    assert body["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "node-1", "uid": "uid-1"}
    assert body["reason"] == "NodePrerequisiteMissing" and body["type"] == "Warning"
    assert body["metadata"]["namespace"] == "default"
    assert body["metadata"]["name"].startswith("node-1.ibckpt.nodeprerequisitemissing.")
    assert len(body["message"]) == nodeobjects.MAX_MESSAGE
    assert body["firstTimestamp"] == "2026-12-01T10:00:00Z"
    again = nodeobjects.event_body("node-1", "uid-1", nodeobjects.REASON_MISSING, "criu: missing" * 200, now)
    assert again["metadata"]["name"] == body["metadata"]["name"]  # a restarted agent: the same Event
    other = nodeobjects.event_body("node-1", "uid-1", nodeobjects.REASON_MISSING, "runc: missing", now)
    assert other["metadata"]["name"] != body["metadata"]["name"]
    assert (
        nodeobjects.event_body("n", "u", nodeobjects.REASON_READY, "ok", now, warning=False)["type"]
        == "Normal"
    )
