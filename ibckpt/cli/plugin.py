"""`kubectl ibckpt`: checkpoints as a user sees them, through their own kubeconfig.

    kubectl ibckpt checkpoint (KIND/NAME | -l SELECTOR) [--mode Stop] [--storage S] [--name N] [--no-wait]
    kubectl ibckpt restore (CHECKPOINT | --latest SCHEDULE) [--avoid-source-nodes] [--name N] [--no-wait]
        both: [--phase-seconds PHASE=SECONDS ...] (the job's spec.timeouts, e.g. admit=300)
    kubectl ibckpt list [-A]
    kubectl ibckpt describe CHECKPOINT
    kubectl ibckpt logs JOB [--agent-namespace NS]
    kubectl ibckpt import [--storage S] [--timeout SECONDS]
    kubectl ibckpt grant-storage STORAGE [--operator-namespace NS]   (plugin_grants.py)
    kubectl ibckpt uninstall [--yes] [--delete-images]   (plugin_uninstall.py)

`checkpoint` and `restore` create the CheckpointJob or RestoreJob a user would write as YAML and follow
it to its end, one line per phase. Exit codes: 0 done, 1 failed or refused, 2 still running when
--timeout ran out (the job goes on; `kubectl get` follows it)."""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from ibckpt.api import (
    API_VERSION,
    CHECKPOINT,
    CHECKPOINT_JOB,
    CHECKPOINT_SCHEDULE,
    CHECKPOINT_STORAGE,
    RESTORE_JOB,
    ApiModel,
    JobTimeouts,
    KindInfo,
    RestoreTimeouts,
)
from ibckpt.cli import plugin_grants, plugin_uninstall
from ibckpt.cli.kubeapi import Body, KubeApi, PluginError
from ibckpt.store.units import format_size

# kubectl's names for the workloads that own RDMA pods: (apiVersion, Kind)
WORKLOADS = {
    "job": ("batch/v1", "Job"),
    "statefulset": ("apps/v1", "StatefulSet"),
    "sts": ("apps/v1", "StatefulSet"),
    "deployment": ("apps/v1", "Deployment"),
    "deploy": ("apps/v1", "Deployment"),
    "replicaset": ("apps/v1", "ReplicaSet"),
    "rs": ("apps/v1", "ReplicaSet"),
    "jobset": (None, "JobSet"),
    "mpijob": (None, "MPIJob"),
}


# -- checkpoint ------------------------------------------------------------------------------------------


def _target(api: KubeApi, target: str | None, selector: str | None) -> tuple[str, Body]:
    """The CheckpointJob's pods, as (a short name for the job, the spec fields that select them)."""
    if (target is None) == (selector is None):
        raise PluginError("give a target (pod/NAME, job/NAME, statefulset/NAME, ...) or -l SELECTOR")
    if selector is not None:
        labels = _labels(selector)
        return "-".join(labels.values())[:40] or "pods", {"selector": {"matchLabels": labels}}
    assert target is not None
    kind, _, name = target.rpartition("/")
    kind = kind.lower().rstrip("s") if kind.lower() not in ("sts", "rs") else kind.lower()
    if kind in ("", "pod", "po"):
        return name, {"workloadRef": _owner_of_pod(api, name)}
    if kind in WORKLOADS:
        api_version, kind_name = WORKLOADS[kind]
    else:
        api_version, kind_name = None, target.rpartition("/")[0]
    ref = {"kind": kind_name, "name": name}
    if api_version:
        ref["apiVersion"] = api_version
    return name, {"workloadRef": ref}


def _owner_of_pod(api: KubeApi, name: str) -> Body:
    """The workload a pod belongs to: its controller, or that one's controller (a Deployment's
    ReplicaSet). A bare pod has no workload to name, so the user gives its job's labels instead."""
    pod = api.pod(name)
    owner = _controller(pod)
    if owner is None:
        raise PluginError(
            f"pod {name} belongs to no workload: name its job's pods with -l (e.g. -l app=...), "
            "so every rank of the job is checkpointed at one cut"
        )
    above = api.owner(owner["apiVersion"], owner["kind"], owner["name"])
    if above is not None and (top := _controller(above)) is not None:
        owner = top
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["name"]}


def _controller(obj: Body) -> Body | None:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def _labels(text: str) -> dict[str, str]:
    labels = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key or "!" in key:
            raise PluginError(f"selector {text!r}: only key=value terms, separated by commas")
        labels[key.strip()] = value.lstrip("=").strip()
    if not labels:
        raise PluginError("the selector is empty: it would match every pod")
    return labels


def _storage(api: KubeApi, name: str | None) -> str:
    if name is not None:
        api.must_get(CHECKPOINT_STORAGE, name)
        return name
    found = [s["metadata"]["name"] for s in api.list(CHECKPOINT_STORAGE)]
    if len(found) == 1:
        return str(found[0])
    if not found:
        raise PluginError(
            f"no CheckpointStorage in namespace {api.namespace}: create one (docs/crds.md) or pass --storage"
        )
    raise PluginError(
        f"namespace {api.namespace} has several CheckpointStorages ({', '.join(found)}): pass --storage"
    )


def checkpoint(api: KubeApi, args: argparse.Namespace) -> int:
    short, pods = _target(api, args.target, args.selector)
    spec: Body = {**pods, "mode": args.mode, "storageRef": {"name": _storage(api, args.storage)}}
    spec.update(_timeouts(JobTimeouts, args.phase_seconds))
    meta: Body = {"name": args.name} if args.name else {"generateName": f"{short[:50]}-"}
    final = _run_job(api, CHECKPOINT_JOB, _object(CHECKPOINT_JOB, meta, spec), args)
    if isinstance(final, int):
        return final
    status = final["status"]
    size = format_size(status["bytes"]) if status.get("bytes") is not None else "? bytes"
    print(f"checkpoint/{status.get('checkpointName')} committed: {status.get('podCount', '?')} pods, {size}")
    return 0


# -- restore ---------------------------------------------------------------------------------------------


def restore(api: KubeApi, args: argparse.Namespace) -> int:
    """A RestoreJob of a named Checkpoint, or of a schedule's latest restorable one: the operator chooses
    that one (spec.latestOf) and writes its name into the job's spec."""
    if (args.checkpoint is None) == (args.latest is None):
        raise PluginError("give a Checkpoint's name or --latest SCHEDULE")
    spec: Body = {
        "avoidSourceNodes": args.avoid_source_nodes,
        **_timeouts(RestoreTimeouts, args.phase_seconds),
    }
    if args.latest:
        api.must_get(CHECKPOINT_SCHEDULE, args.latest)
        spec["latestOf"] = {"schedule": args.latest}
        short = f"{args.latest[:50]}-latest"
    else:
        api.must_get(CHECKPOINT, args.checkpoint)
        spec["checkpointName"], short = args.checkpoint, args.checkpoint[:50]
    meta: Body = {"name": args.name} if args.name else {"generateName": f"{short}-restore-"}
    final = _run_job(api, RESTORE_JOB, _object(RESTORE_JOB, meta, spec), args)
    if isinstance(final, int):
        return final
    name_of = final["spec"].get("checkpointName")
    if args.latest:
        print(f"latest checkpoint of {args.latest}: {name_of}")
    placed = ", ".join(f"{p['name']} on {p.get('node')}" for p in final["status"].get("pods") or [])
    print(f"restored from checkpoint/{name_of}: {placed}")
    return 0


def _timeouts(model: type[ApiModel], terms: Sequence[str]) -> Body:
    """`--phase-seconds admit=300 ...` as the job's `timeouts` (none given: the operator's defaults)."""
    phases = {
        name.removesuffix("_seconds"): field.alias or name for name, field in model.model_fields.items()
    }
    chosen: Body = {}
    for term in terms:
        phase, _, value = term.partition("=")
        if phase not in phases:
            raise PluginError(f"--phase-seconds {term}: the phases are {', '.join(phases)}")
        if not value.isdigit() or int(value) < 1:
            raise PluginError(f"--phase-seconds {term}: give a whole number of seconds, at least 1")
        chosen[phases[phase]] = int(value)
    return {"timeouts": chosen} if chosen else {}


# -- following a job -------------------------------------------------------------------------------------


def _object(kind: KindInfo, meta: Body, spec: Body) -> Body:
    return {"apiVersion": API_VERSION, "kind": kind.kind, "metadata": meta, "spec": spec}


def _run_job(api: KubeApi, kind: KindInfo, body: Body, args: argparse.Namespace) -> Body | int:
    """Create the job and follow it: its final body when it succeeded, else the exit code (0 with
    --no-wait, 1 failed, 2 still running at --timeout)."""
    name = api.create(kind, body)["metadata"]["name"]
    print(f"{kind.singular}/{name} created")
    if args.no_wait:
        return 0
    final = _follow(api, kind, name, args.timeout)
    if final is None:
        return 2
    status: Body = final.get("status") or {}
    if status.get("phase") != "Succeeded":
        return _failed(kind, name, status)
    return final


def _follow(api: KubeApi, kind: KindInfo, name: str, timeout: float) -> Body | None:
    """Print each phase the job enters, with the seconds since the command started; the last body, or
    None when `timeout` ran out first."""
    started = time.monotonic()
    seen: str | None = None
    phase: str | None = None
    for body in api.watch(kind, name, timeout):
        status = body.get("status") or {}
        phase = status.get("phase")
        if phase and phase != seen:
            note = f"  ({status['reason']})" if status.get("reason") else ""
            print(f"  {phase:<12} {time.monotonic() - started:7.1f}s{note}", flush=True)
            seen = phase
        if phase in ("Succeeded", "Failed"):
            return body
    print(
        f"{kind.singular}/{name} is still {phase or 'starting'} after {timeout:.0f}s; it goes on: "
        f"kubectl get {kind.singular} {name} -w",
        file=sys.stderr,
    )
    return None


def _failed(kind: KindInfo, name: str, status: Body) -> int:
    print(f"{kind.singular}/{name} failed: {status.get('reason')}: {status.get('message')}", file=sys.stderr)
    return 1


# -- list and describe -----------------------------------------------------------------------------------


def _age(stamp: str | None, now: datetime) -> str:
    if not stamp:
        return "-"
    seconds = int((now - datetime.fromisoformat(stamp.replace("Z", "+00:00"))).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _yes_no(value: object, unknown: str) -> str:
    return unknown if value is None else ("yes" if value else "no")


def _size(spec: Body) -> str:
    size = spec.get("size") or {}
    return format_size(size["bytes"]) if size.get("bytes") is not None else "-"


def list_checkpoints(api: KubeApi, args: argparse.Namespace) -> int:
    items = api.list(CHECKPOINT, all_namespaces=args.all_namespaces)
    now = datetime.now(UTC)
    rows = []
    for c in sorted(items, key=lambda c: (c["metadata"]["namespace"], c["metadata"]["creationTimestamp"])):
        spec, status = c["spec"], c.get("status") or {}
        job = (spec.get("checkpointJobRef") or {}).get("name") or "-"
        ready = _yes_no(status.get("readyToRestore"), "-")
        row = [
            c["metadata"]["name"],
            job,
            spec.get("mode") or "-",
            str(len(spec.get("pods") or [])),
            _size(spec),
        ]
        row += [ready, _age(spec.get("committedTime") or c["metadata"]["creationTimestamp"], now)]
        rows.append(([c["metadata"]["namespace"]] if args.all_namespaces else []) + row)
    if not rows:
        where = "any namespace" if args.all_namespaces else f"namespace {api.namespace}"
        print(f"No Checkpoints in {where}.")
        return 0
    header = ["NAME", "JOB", "MODE", "PODS", "SIZE", "READY", "AGE"]
    _table((["NAMESPACE"] if args.all_namespaces else []) + header, rows)
    return 0


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def describe(api: KubeApi, args: argparse.Namespace) -> int:
    c = api.must_get(CHECKPOINT, args.checkpoint)
    spec, status = c["spec"], c.get("status") or {}
    source = spec.get("source") or {}
    size = spec.get("size") or {}
    stored = size.get("storedBytes")
    lines = [
        ("Name", c["metadata"]["name"]),
        ("Namespace", c["metadata"]["namespace"]),
        ("CheckpointJob", (spec.get("checkpointJobRef") or {}).get("name") or "-"),
        ("Source", f"{source.get('kind')}/{source.get('name')}" if source else "pods by selector"),
        ("Mode", spec.get("mode") or "-"),
        ("Committed", spec.get("committedTime") or "-"),
        ("Ranks", str(spec.get("rankCount") if spec.get("rankCount") is not None else "-")),
        ("Size", _size(spec) + (f" ({format_size(stored)} new in the bucket)" if stored is not None else "")),
        ("Ready to restore", _yes_no(status.get("readyToRestore"), "not checked yet")),
        ("Tiers", ", ".join(status.get("tiers") or ["S3"])),
        (
            "Memory copies",
            ", ".join(f"{c['part']} on {c['node']}" for c in status.get("memoryCopies") or []) or "-",
        ),
        ("Manifest", spec.get("manifestKey") or "-"),
    ]
    if status.get("message"):
        lines.append(("Message", status["message"]))
    width = max(len(k) for k, _ in lines) + 1
    for key, value in lines:
        print(f"{key + ':':<{width}} {value}")
    pods = spec.get("pods") or []
    print("Pods:")
    _table(
        ["  NAME", "NODE", "RANKS", "BYTES"],
        [
            [
                "  " + p["name"],
                p.get("node") or "-",
                str(len(p.get("ranks") or [])),
                format_size(p["bytes"]) if p.get("bytes") is not None else "-",
            ]
            for p in pods
        ],
    )
    timings = {k: v for k, v in (spec.get("timings") or {}).items() if v is not None}
    print("Timings:" + ("" if timings else " not recorded"))
    for key, value in timings.items():
        print(f"  {key.removesuffix('Seconds'):<10} {value:.2f}s")
    requires = spec.get("requires") or {}
    if requires:
        print("Requires:  " + requires_text(requires))
    return 0


def requires_text(requires: dict[str, Any]) -> str:
    """spec.requires for people: the formats as name=number, the shim's digest shortened."""
    parts = []
    for key, value in sorted(requires.items()):
        if key == "formats" and isinstance(value, dict):
            value = "(" + ", ".join(f"{k}={v}" for k, v in sorted(value.items())) + ")"
        elif key == "shim":
            value = str(value)[:12]
        parts.append(f"{key} {value}")
    return ", ".join(parts)


# -- logs ------------------------------------------------------------------------------------------------

AGENT_SELECTOR = "app.kubernetes.io/component=agent"
# The agent's log lines start with their time (ibckpt_node.agent.main's format, UTC in the container).
LOG_TIME = re.compile(r"^(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}),\d{3} ")
SLACK = timedelta(seconds=5)


def lines_between(text: str, start: datetime, end: datetime) -> list[str]:
    """The log's lines from `start` to `end` (with a few seconds' slack); an untimed line (a traceback's)
    goes with the line before it."""
    kept, keeping = [], False
    for line in text.splitlines():
        stamp = LOG_TIME.match(line)
        if stamp:
            when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
            keeping = start - SLACK <= when <= end + SLACK
        if keeping:
            kept.append(line)
    return kept


def _time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def logs(api: KubeApi, args: argparse.Namespace) -> int:
    job = api.get(CHECKPOINT_JOB, args.job) or api.get(RESTORE_JOB, args.job)
    if job is None:
        raise PluginError(f"no CheckpointJob or RestoreJob {args.job} in namespace {api.namespace}")
    status = job.get("status") or {}
    if not status.get("startTime"):
        raise PluginError(f"{job['kind']} {args.job} has not started")
    now = datetime.now(UTC)
    start = _time(status["startTime"])
    end = _time(status["completionTime"]) if status.get("completionTime") else now
    nodes = {row.get("node") for row in status.get("pods") or () if row.get("node")}
    agents = [p for p in api.pods(args.agent_namespace, AGENT_SELECTOR) if p["spec"].get("nodeName") in nodes]
    if not agents:
        raise PluginError(
            f"no ibckpt agent in namespace {args.agent_namespace} on {', '.join(sorted(nodes))}"
        )
    since = int((now - start + SLACK).total_seconds()) + 1
    for agent in sorted(agents, key=lambda p: str(p["spec"]["nodeName"])):
        node = agent["spec"]["nodeName"]
        for line in lines_between(
            api.pod_log(args.agent_namespace, agent["metadata"]["name"], since), start, end
        ):
            print(f"{node} | {line}")
    return 0


# -- import ----------------------------------------------------------------------------------------------

IMPORT_ANNOTATION = "ibckpt.io/import"  # the operator's cluster/imports.py answers it in status.lastImport


def import_checkpoints(api: KubeApi, args: argparse.Namespace) -> int:
    """Ask the operator to make the Checkpoint objects of the namespace's checkpoints in a storage's
    bucket that have none (after a disaster, or in a new cluster with the same image keys)."""
    name = _storage(api, args.storage)
    asked = datetime.now(UTC).isoformat()
    api.annotate(CHECKPOINT_STORAGE, name, {IMPORT_ANNOTATION: asked})
    print(f"checkpointstorage/{name}: import asked")
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        answer = ((api.must_get(CHECKPOINT_STORAGE, name).get("status") or {}).get("lastImport")) or {}
        if answer.get("requested") == asked:
            if answer.get("message"):
                raise PluginError(f"checkpointstorage/{name}: {answer['message']}")
            for imported in answer.get("imported") or ():
                print(f"checkpoint/{imported} imported")
            for skipped in answer.get("skipped") or ():
                print(f"skipped {skipped}", file=sys.stderr)
            print(f"{len(answer.get('imported') or ())} imported, {len(answer.get('skipped') or ())} skipped")
            return 0
        time.sleep(1)
    print(
        f"checkpointstorage/{name}: no answer after {args.timeout:.0f}s (is the operator running?)",
        file=sys.stderr,
    )
    return 2


# -- the command line ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubectl ibckpt", description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", help="the kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    parser.add_argument("--context", help="the kubeconfig context")
    parser.add_argument("-n", "--namespace", help="default: the context's namespace")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    c = commands.add_parser("checkpoint", help="checkpoint a workload's pods and follow the job")
    c.add_argument("target", nargs="?", help="pod/NAME (its workload), job/NAME, statefulset/NAME, KIND/NAME")
    c.add_argument("-l", "--selector", help="the job's pods by label (key=value,...), in place of a target")
    c.add_argument("--mode", choices=["LeaveRunning", "Stop"], default="LeaveRunning")
    c.add_argument("--storage", help="a CheckpointStorage (default: the namespace's only one)")
    c.add_argument("--name", help="the CheckpointJob's name (default: generated from the target)")
    c.set_defaults(run=checkpoint)

    r = commands.add_parser("restore", help="restore a Checkpoint and follow the job")
    r.add_argument("checkpoint", nargs="?", help="a Checkpoint's name")
    r.add_argument("--latest", metavar="SCHEDULE", help="the newest restorable Checkpoint of a schedule")
    r.add_argument("--avoid-source-nodes", action="store_true", help="place no pod on a node it left")
    r.add_argument("--name", help="the RestoreJob's name (default: generated from the checkpoint)")
    r.set_defaults(run=restore)

    for sub in (c, r):
        sub.add_argument("--no-wait", action="store_true", help="create the job and return")
        sub.add_argument("--timeout", type=float, default=3600.0, help="seconds to follow the job")
        sub.add_argument(
            "--phase-seconds", action="append", default=[], metavar="PHASE=SECONDS",
            help="a phase's bound (spec.timeouts), e.g. admit=300 on a slow cluster; repeatable",
        )  # fmt: skip

    ls = commands.add_parser("list", help="the Checkpoints of the namespace")
    ls.add_argument("-A", "--all-namespaces", action="store_true")
    ls.set_defaults(run=list_checkpoints)

    d = commands.add_parser("describe", help="one Checkpoint: pods, nodes, bytes, timings")
    d.add_argument("checkpoint")
    d.set_defaults(run=describe)

    lg = commands.add_parser("logs", help="the agents' log lines for a CheckpointJob or RestoreJob")
    lg.add_argument("job")
    lg.add_argument("--agent-namespace", default="ibckpt-system", help="where the chart runs the agents")
    lg.set_defaults(run=logs)

    im = commands.add_parser("import", help="make Checkpoints again from a storage's bucket")
    im.add_argument("--storage", help="a CheckpointStorage (default: the namespace's only one)")
    im.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the operator")
    im.set_defaults(run=import_checkpoints)

    plugin_grants.add_parser(commands)
    plugin_uninstall.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[KubeApi, argparse.Namespace], int] = args.run
    try:
        api = KubeApi.connect(args.kubeconfig, args.context, args.namespace)
        return run(api, args)
    except PluginError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    sys.exit(main())
