"""The agent's node lifecycle: prerequisites, the runtime handler and the Node's label.

At start (and every RECHECK_S until it is done): check the prerequisites; any missing keeps the agent not
Ready (readiness is `NodeLifecycle.ready`), is logged and posted as an Event on the Node. All present:
install the handler (when the agent manages it), restart containerd if the files changed, then label
the Node. At SIGTERM the agent asks for its DaemonSet: gone or being deleted means an uninstall (the
chart's pre-delete hook deletes it first), so the handler, the label and the node files go; any other
stop (an upgrade, a restart) leaves them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ibckpt_node.nodesetup import containerd, host, nodeobjects, prereqs
from ibckpt_node.nodesetup.kube import KubeError, NodeApi

log = logging.getLogger("ibckpt_node.nodesetup")

RECHECK_S = 60.0


@dataclass
class NodeLifecycle:
    node: str
    setup: host.NodeSetup
    api: NodeApi | None
    namespace: str = ""  # the agent's DaemonSet, read at SIGTERM
    daemonset: str = ""
    ready: bool = False
    reason: str = "the node's prerequisites were not checked yet"
    _posted: set[tuple[str, str]] = field(default_factory=set)
    now: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))

    def _event(self, reason: str, message: str, warning: bool = True) -> None:
        if self.api is None or (reason, message) in self._posted:
            return
        try:
            uid = str(self.api.node(self.node).get("metadata", {}).get("uid", ""))
            self.api.post_event(nodeobjects.event_body(self.node, uid, reason, message, self.now(), warning))
            self._posted.add((reason, message))
        except KubeError as exc:
            log.warning("could not post the event %s on node %s: %s", reason, self.node, exc)

    def _label(self, ready: bool) -> None:
        if self.api is None:
            return
        self.api.patch_node(self.node, nodeobjects.label_patch(ready))

    def _not_ready(self, reason: str, event: str) -> bool:
        self.ready, self.reason = False, reason
        log.error("%s", reason)
        self._event(event, reason)
        return False

    def prepare(self) -> bool:
        """One pass: whether the node is ready for pods of the class (then labelled)."""
        findings = host.check(self.setup)
        if prereqs.missing(findings):
            with_label = self._unlabel()
            return self._not_ready(
                prereqs.summary(self.node, findings) + with_label, nodeobjects.REASON_MISSING
            )
        if self.setup.manage:
            try:
                edit = host.install_handler(self.setup)
            except (containerd.ConfigRefused, OSError) as exc:
                return self._not_ready(f"node {self.node}: {exc}", nodeobjects.REASON_FAILED)
            log.info("containerd config %s: %s", self.setup.config, edit.note)
            if not host.containerd_loaded(self.setup):
                why = host.restart_containerd(self.setup)
                if why:
                    return self._not_ready(f"node {self.node}: {why}", nodeobjects.REASON_FAILED)
        try:
            self._label(True)
        except KubeError as exc:
            return self._not_ready(f"node {self.node}: could not label it: {exc}", nodeobjects.REASON_FAILED)
        self.ready, self.reason = True, ""
        label = nodeobjects.RUNTIME_READY_LABEL
        message = f"the ibckpt runtime handler works on node {self.node}; labelled {label}"
        log.info("%s", message)
        self._event(nodeobjects.REASON_READY, message, warning=False)
        return True

    def _unlabel(self) -> str:
        try:
            self._label(False)
            return ""
        except KubeError as exc:
            return f" (and its label could not be removed: {exc})"

    def uninstalling(self) -> bool:
        """Whether this stop is an uninstall: the agent's DaemonSet is gone or being deleted."""
        if self.api is None or not self.daemonset:
            return False
        try:
            found = self.api.daemonset(self.namespace, self.daemonset)
        except KubeError as exc:
            log.warning("cannot tell an uninstall from a restart (%s): leaving the node as it is", exc)
            return False
        return found is None or bool(found.get("metadata", {}).get("deletionTimestamp"))

    def uninstall(self) -> list[str]:
        """Undo what the agent did on the node; what was done, one line each."""
        done = []
        try:
            self._label(False)
            done.append(f"label {nodeobjects.RUNTIME_READY_LABEL} removed")
        except KubeError as exc:
            done.append(f"label not removed: {exc}")
        if self.setup.manage:
            try:
                edit = host.remove_handler(self.setup)
                done.append(edit.note)
                if edit.changed:
                    done.append(host.restart_containerd(self.setup) or "containerd restarted")
            except (containerd.ConfigRefused, OSError) as exc:
                done.append(f"handler not removed: {exc}")
        done += host.remove_files(self.setup)
        for line in done:
            log.info("uninstall on node %s: %s", self.node, line)
        self._event(nodeobjects.REASON_REMOVED, "; ".join(done), warning=False)
        return done
