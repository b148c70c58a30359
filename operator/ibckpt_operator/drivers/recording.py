"""What a CheckpointJob records for a restore, beside the images: each pod's sanitized template and
rank keys, and the versions its nodes ran (Checkpoint.spec.pods[].template/ranks, spec.requires), with
the shim build its containers mapped (reported per container by the agents).

The driver fills it as it goes (admission reads the pods and the agents, the agents' reports name the
ranks); what this process did not see (a restart after the upload) is read again at publish time: the
pods still exist until KillSources, and the agents keep their session reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ibckpt import formats
from ibckpt.agentapi import AgentInfo, SessionReport
from ibckpt.api import CheckpointPod, PodTemplate, RequiredVersions
from ibckpt_operator.cluster.agents import agents_by_node, each_agent
from ibckpt_operator.drivers.runtime import Runtime
from ibckpt_operator.machine import Member
from ibckpt_operator.machine.podtemplate import sanitize
from ibckpt_operator.machine.restoreplan import newest


@dataclass
class RestoreRecord:
    templates: dict[str, PodTemplate] = field(default_factory=dict)  # by pod UID
    rank_keys: dict[str, set[str]] = field(default_factory=dict)  # by pod UID
    agent_versions: dict[str, str] = field(default_factory=dict)  # by node
    agent_formats: dict[str, dict[str, int]] = field(default_factory=dict)  # by node: what it writes
    # by pod UID: the shim builds its containers map (None: started before builds were kept)
    shim_builds: dict[str, set[str | None]] = field(default_factory=dict)

    def saw_agent(self, node: str, info: AgentInfo) -> None:
        self.agent_versions.setdefault(node, info.version)
        if info.formats is not None:
            self.agent_formats[node] = dict(info.formats.writes)
        for c in info.containers:
            if c.shim:
                self.shim_builds.setdefault(c.pod_uid, set()).add(c.shim_build)

    host_ips: dict[str, str] = field(default_factory=dict)  # by pod UID: status.hostIP

    def saw(self, body: dict[str, Any]) -> None:
        """Record a member pod's template and node address from its body."""
        uid = body["metadata"]["uid"]
        self.templates[uid] = sanitize(body)
        host_ip = (body.get("status") or {}).get("hostIP")
        if host_ip:
            self.host_ips[uid] = str(host_ip)

    async def pods(
        self, rt: Runtime, namespace: str, members: tuple[Member, ...], session_id: str
    ) -> list[CheckpointPod]:
        missing_ranks = {m.pod.node for m in members if m.pod.uid not in self.rank_keys}
        if missing_ranks:
            agents = await agents_by_node(rt.kube)
            nodes = sorted(missing_ranks & set(agents))
            for report in await each_agent([rt.gateway.session(agents[node], session_id) for node in nodes]):
                if isinstance(report, SessionReport):  # an agent that does not answer adds no keys
                    for rank in report.ranks:
                        self.rank_keys.setdefault(rank.pod_uid, set()).add(rank.rank_key)
        pods = []
        for m in members:
            if m.pod.uid not in self.templates:
                body = await rt.kube.get_pod(namespace, m.pod.name)
                if body is not None and body["metadata"].get("uid") == m.pod.uid:
                    self.saw(body)
            keys = sorted(self.rank_keys.get(m.pod.uid, ()))
            pods.append(
                CheckpointPod(name=m.pod.name, uid=m.pod.uid, node=m.pod.node or None, bytes=m.bytes,
                              hostIP=self.host_ips.get(m.pod.uid), ranks=keys or None,
                              template=self.templates.get(m.pod.uid))
            )  # fmt: skip
        return pods

    async def requires(self, rt: Runtime, members: tuple[Member, ...]) -> RequiredVersions:
        """The newest agent version and kernel among the job's nodes, and the formats their agents wrote: a
        restore node must satisfy each. Formats are recorded only when every node's agent reported them
        (an agent before formats says nothing of what it wrote)."""
        nodes = {m.pod.node for m in members}
        kernels = [
            n.get("status", {}).get("nodeInfo", {}).get("kernelVersion")
            for n in await rt.kube.list_nodes()
            if n["metadata"]["name"] in nodes
        ]
        unseen = nodes - set(self.agent_formats)  # not admitted by this process (a restart)
        if unseen:
            agents = await agents_by_node(rt.kube)
            asked = sorted(unseen & set(agents))
            for node, info in zip(
                asked, await each_agent([rt.gateway.info(agents[n]) for n in asked]), strict=True
            ):
                if isinstance(info, AgentInfo):
                    self.saw_agent(node, info)
        versions = [self.agent_versions.get(node) for node in nodes]
        written = [self.agent_formats[node] for node in nodes if node in self.agent_formats]
        recorded = formats.written_by(written) if written and len(written) == len(nodes) else None
        return RequiredVersions(
            ibckpt=newest(versions), kernel=newest(kernels), formats=recorded, shim=self.mapped_shim(members)
        )

    def mapped_shim(self, members: tuple[Member, ...]) -> str | None:
        """The one shim build every member's containers map (a restore node must keep it), or None when
        they map several or one from before builds were kept: the restore's wrapper then finds out, per
        container, from the build its images recorded."""
        builds = {b for m in members for b in self.shim_builds.get(m.pod.uid, set())}
        build = builds.pop() if len(builds) == 1 else None
        return build
