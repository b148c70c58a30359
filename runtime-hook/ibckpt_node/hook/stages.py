"""What `ibckpt-hook` does for a container that may be ours (main.py filters the others out).

    createRuntime (or prestart): for a container that goes under the shim (an RDMA device or the
        opt-in annotation; see oci.wants_shim), record it in STATE_DIR/containers/ID/registration.json
        and register it with the node agent's registry.
    poststop: deregister it and remove STATE_DIR/containers/ID.

The hook never fails a container: an agent
that is down or slow (bounded by registry_timeout_s) gets a warning in STATE_DIR/hook.log and on
stderr, and the agent finds the registration file when it starts (registry.rediscover).
"""

from __future__ import annotations

import json
import os
import sys
import time

from ibckpt_node.hook import client, oci

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def warn(config: oci.NodeConfig, message: str) -> None:
    line = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} ibckpt-hook: {message}"
    print(line, file=sys.stderr)
    try:
        fd = os.open(
            os.path.join(config.state_dir, "hook.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600
        )
        with os.fdopen(fd, "a") as f:
            f.write(line + "\n")
    except OSError:
        pass


def read_spec(state: dict[str, Any]) -> dict[str, Any]:
    with open(os.path.join(str(state.get("bundle", "")), "config.json"), encoding="utf-8") as f:
        spec = json.load(f)
    if not isinstance(spec, dict):
        raise ValueError("config.json is not an object")
    return spec


def make_entry(
    config: oci.NodeConfig, container_id: str, pid: int, spec: dict[str, Any], reason: str
) -> dict[str, Any]:
    who = oci.identity(spec)
    env = (spec.get("process") or {}).get("env") or []
    preload = next((e[len("LD_PRELOAD=") :] for e in env if e.startswith("LD_PRELOAD=")), "")
    shim = oci.IN_SHIM in preload.replace(" ", ":").split(":")
    control_dir = os.path.join(config.container_dir(container_id), "ctl")
    entry: dict[str, Any] = who.as_dict()
    entry.update(
        container_id=container_id,
        pid=pid,
        pid_start=client.process_start(pid),
        control_dir=control_dir if shim else "",
        control_socket=os.path.join(control_dir, f"{client.inner_pid(pid)}.sock") if shim else "",
        shim=shim,
        reason=reason,
        registered_at=time.time(),
    )
    # the shim build its processes map (the wrapper mounted a content-addressed one): a checkpoint records it
    build = oci.build_of(oci.shim_source(spec) or "") if shim else None
    if build is not None:
        entry["shim_build"] = build
    return entry


def on_create(config: oci.NodeConfig, state: dict[str, Any]) -> int:
    spec = read_spec(state)
    reason = oci.wants_shim(spec)
    if reason is None:
        return 0
    container_id = oci.checked_id(str(state.get("id", "")))
    pid = int(state.get("pid") or 0)
    if pid <= 0:
        warn(config, f"{container_id}: no pid in the state, not registered")
        return 0
    entry = make_entry(config, container_id, pid, spec, reason)
    cdir = config.container_dir(container_id)
    os.makedirs(cdir, mode=0o700, exist_ok=True)
    client.write_json_atomic(os.path.join(cdir, "registration.json"), entry)
    if not entry["shim"]:
        warn(
            config,
            f"{container_id} ({reason}) runs without the shim: start it through ibckpt-runc "
            "to make it checkpointable",
        )
    try:
        client.register(config.registry_socket, entry, config.registry_timeout_s)
    except client.RegistryError as exc:
        warn(config, f"{container_id}: not registered now ({exc}); the agent reads {cdir} when it starts")
    return 0


def on_stop(config: oci.NodeConfig, state: dict[str, Any]) -> int:
    container_id = oci.checked_id(str(state.get("id", "")))
    cdir = config.container_dir(container_id)
    if not os.path.isdir(cdir):
        return 0  # never registered: the common case costs one stat
    import shutil  # only here: it costs more than the rest of this path

    shutil.rmtree(cdir, ignore_errors=True)
    try:
        client.deregister(config.registry_socket, container_id, config.registry_timeout_s)
    except client.RegistryError as exc:
        warn(config, f"{container_id}: not deregistered ({exc}); the agent drops it when it starts")
    return 0


def run(stage: str, raw_state: str) -> int:
    try:
        config = oci.load_config()
    except ValueError as exc:
        print(f"ibckpt-hook: {exc}", file=sys.stderr)
        return 0
    try:
        state = json.loads(raw_state)
        if not stage:
            stage = "poststop" if state.get("status") == "stopped" else "createRuntime"
        if stage in ("createRuntime", "prestart"):
            return on_create(config, state)
        if stage == "poststop":
            return on_stop(config, state)
        warn(config, f"unknown stage {stage!r}, nothing done")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # never fail the container for the hook's sake
        warn(config, f"{stage}: {type(exc).__name__}: {exc}")
    return 0
