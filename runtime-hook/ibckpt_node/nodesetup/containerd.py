"""The `ibckpt` runtime handler in containerd's configuration: pure edits of the files' text.

containerd 1.6/1.7 (config `version = 2`): the handler goes into the main file itself, as one block
between marker comments appended at its end; every other byte stays. A drop-in would not do there:
containerd 1.x merges an imported file by replacing each plugin's whole section
(`mergeConfig`: `to.Plugins[k] = v`), so a drop-in naming the CRI plugin would drop the node's own
CRI settings (sandbox image, CNI, the runc handler).

containerd 2.x (`version = 3`): a drop-in of its own (containerd 2 merges imported plugin sections
key by key), and the main file's `imports` names it, unless a glob there already matches it.

Removal takes out exactly what install put in: the marked block, or the drop-in and the one
`imports` entry (the key too when install had added it).
"""

from __future__ import annotations

import fnmatch
import os
import tomllib
from dataclasses import dataclass
from typing import Any

import tomlkit

CRI_V2 = "io.containerd.grpc.v1.cri"
CRI_V3 = "io.containerd.cri.v1.runtime"
BEGIN = "# BEGIN ibckpt runtime handler: written by the ibckpt node agent, removed on uninstall\n"
END = "# END ibckpt runtime handler\n"
NOEOL = "# (the line before had no newline: removal takes out the one added)\n"
DROPIN_HEAD = "# The ibckpt runtime handler: written by the ibckpt node agent, removed on uninstall.\n"


class ConfigRefused(Exception):
    """This configuration cannot take the handler; the message says why and what to do."""


@dataclass(frozen=True)
class Handler:
    name: str = "ibckpt"
    binary: str = "/usr/local/bin/ibckpt-runc"
    pod_annotations: tuple[str, ...] = ("ibckpt.io/*",)


@dataclass(frozen=True)
class Edit:
    """What install or remove writes: the main file's new text, and the drop-in's (None: no drop-in;
    "" on remove: delete it). `changed`: containerd must be restarted to see it."""

    main: str
    dropin: str | None
    changed: bool
    note: str


def parse(text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigRefused(f"containerd's config is not valid TOML ({exc}); not editing it") from None


DEFAULT_SOCKET = "/run/containerd/containerd.sock"


def socket_path(text: str) -> str:
    """Where containerd serves its API, as its config says ([grpc] address), or its default."""
    try:
        grpc = parse(text).get("grpc", {})
    except ConfigRefused:
        return DEFAULT_SOCKET
    address = grpc.get("address") if isinstance(grpc, dict) else None
    return address.removeprefix("unix://") if isinstance(address, str) and address else DEFAULT_SOCKET


def version(data: dict[str, Any]) -> int:
    found = data.get("version", 1)
    if found == 2 or found == 3:
        return int(found)
    raise ConfigRefused(
        f"containerd's config has version {found!r}: only version 2 (containerd 1.6/1.7) and 3 "
        "(containerd 2.x) are handled; migrate it with `containerd config migrate`"
    )


def _runtimes(data: dict[str, Any], plugin: str) -> dict[str, Any]:
    node: Any = data.get("plugins", {}).get(plugin, {}).get("containerd", {}).get("runtimes", {})
    return node if isinstance(node, dict) else {}


def _systemd_cgroup(data: dict[str, Any], plugin: str) -> bool | None:
    """The node's default runc handler's SystemdCgroup: ours must use the kubelet's cgroup driver too."""
    cri = data.get("plugins", {}).get(plugin, {}).get("containerd", {})
    default = cri.get("default_runtime_name", "runc") if isinstance(cri, dict) else "runc"
    options = _runtimes(data, plugin).get(default, {}).get("options", {})
    value = options.get("SystemdCgroup") if isinstance(options, dict) else None
    return value if isinstance(value, bool) else None


def _toml_str(value: str) -> str:
    return tomlkit.string(value).as_string()


def handler_tables(plugin: str, handler: Handler, systemd_cgroup: bool | None) -> str:
    base = f'plugins."{plugin}".containerd.runtimes.{handler.name}'
    annotations = ", ".join(_toml_str(a) for a in handler.pod_annotations)
    lines = [
        f"[{base}]",
        '  runtime_type = "io.containerd.runc.v2"',
        f"  pod_annotations = [{annotations}]",
        f"  [{base}.options]",
        f"    BinaryName = {_toml_str(handler.binary)}",
    ]
    if systemd_cgroup is not None:
        lines.append(f"    SystemdCgroup = {str(systemd_cgroup).lower()}")
    return "\n".join(lines) + "\n"


def strip_block(text: str) -> str:
    """The main file without the marked block (and the one newline install added before it)."""
    start = text.find(BEGIN)
    if start < 0:
        return text
    end = text.find(END, start)
    if end < 0:
        raise ConfigRefused(f"containerd's config has {BEGIN.strip()!r} but no end marker; fix it by hand")
    end += len(END)
    added = text.startswith(NOEOL, start + len(BEGIN))
    if start > 0 and text[start - 1] == "\n" and (start == 1 or text[start - 2] == "\n"):
        start -= 1  # the blank line install put before the block
    if added and start > 0 and text[start - 1] == "\n":
        start -= 1
    return text[:start] + text[end:]


def _check_foreign(data: dict[str, Any], plugin: str, handler: Handler) -> str | None:
    """A handler of our name that the agent did not write: fine if it runs our wrapper (the note
    says it is left alone), refused otherwise."""
    found = _runtimes(data, plugin).get(handler.name)
    if found is None:
        return None
    binary = found.get("options", {}).get("BinaryName") if isinstance(found, dict) else None
    if binary == handler.binary:
        return f"the config already has the runtime handler {handler.name!r} (not the agent's): left as is"
    raise ConfigRefused(
        f"containerd's config already has a runtime handler {handler.name!r} whose BinaryName is {binary!r}, "
        f"not {handler.binary!r}: remove it, or set agent.manageRuntime=false and configure it yourself"
    )


def install_inline(text: str, handler: Handler) -> Edit:
    """Version 2: the handler as a marked block at the end of the main file (replaced if there)."""
    base = strip_block(text)
    data = parse(base)
    if version(data) != 2:
        raise ConfigRefused("install_inline is for containerd config version 2")
    foreign = _check_foreign(data, CRI_V2, handler)
    if foreign:
        return Edit(text, None, False, foreign)
    noeol = bool(base) and not base.endswith("\n")
    tables = handler_tables(CRI_V2, handler, _systemd_cgroup(data, CRI_V2))
    block = BEGIN + (NOEOL if noeol else "") + tables + END
    new = base + ("\n" if noeol else "") + ("\n" if base else "") + block
    parse(new)  # what containerd will read must still be TOML
    changed = new != text
    return Edit(
        new, None, changed, "handler written into the main config" if changed else "handler up to date"
    )


def _imported(path: str, imports: list[str], config_path: str) -> bool:
    here = os.path.dirname(config_path)
    for entry in imports:
        full = os.path.normpath(entry if os.path.isabs(entry) else os.path.join(here, entry))
        if full == path or ("*" in full and fnmatch.fnmatchcase(path, full)):
            return True
    return False


def dropin_text(handler: Handler, systemd_cgroup: bool | None) -> str:
    return DROPIN_HEAD + "version = 3\n\n" + handler_tables(CRI_V3, handler, systemd_cgroup)


def install_dropin(text: str, handler: Handler, config_path: str, dropin_path: str) -> Edit:
    """Version 3: the drop-in, and an `imports` entry for it in the main file when none matches it."""
    data = parse(text)
    if version(data) != 3:
        raise ConfigRefused("install_dropin is for containerd config version 3")
    foreign = _check_foreign(data, CRI_V3, handler)
    if foreign:
        return Edit(text, None, False, foreign)
    dropin = dropin_text(handler, _systemd_cgroup(data, CRI_V3))
    imports = data.get("imports", [])
    if not isinstance(imports, list):
        raise ConfigRefused("containerd's config has an `imports` that is not a list; not editing it")
    if _imported(dropin_path, [str(i) for i in imports], config_path):
        return Edit(text, dropin, False, f"drop-in {dropin_path} (already imported)")
    doc = tomlkit.parse(text)
    if "imports" in doc:
        array = doc["imports"]
        array.append(dropin_path)
        new = tomlkit.dumps(doc)
    else:  # first key of the file: top-level keys must come before any table
        new = f"imports = [{_toml_str(dropin_path)}]  # added by the ibckpt node agent\n" + text
    parse(new)
    return Edit(new, dropin, True, f"drop-in {dropin_path}, imported from the main config")


def remove_inline(text: str) -> Edit:
    new = strip_block(text)
    return Edit(
        new, None, new != text, "handler removed from the main config" if new != text else "no handler"
    )


def remove_dropin(text: str, dropin_path: str) -> Edit:
    """The imports entry install added (the key too if it was install's line), and the drop-in ("")."""
    ours = f"imports = [{_toml_str(dropin_path)}]  # added by the ibckpt node agent\n"
    if text.startswith(ours):
        return Edit(text[len(ours) :], "", True, "imports line and drop-in removed")
    doc = tomlkit.parse(text)
    imports = doc.get("imports")
    if imports is None or dropin_path not in [str(i) for i in imports]:
        return Edit(text, "", False, "drop-in removed (the main config did not name it)")
    index = [str(i) for i in imports].index(dropin_path)
    del imports[index]
    return Edit(tomlkit.dumps(doc), "", True, "imports entry and drop-in removed")


def install(text: str, handler: Handler, config_path: str, dropin_path: str) -> Edit:
    data = parse(strip_block(text))
    if version(data) == 2:
        return install_inline(text, handler)
    return install_dropin(text, handler, config_path, dropin_path)


def remove(text: str, dropin_path: str) -> Edit:
    """Undo install, whichever layout it used (a v2 file has no drop-in of ours; a v3 no block)."""
    if BEGIN in text:
        return remove_inline(text)
    if version(parse(text)) == 3:
        return remove_dropin(text, dropin_path)
    return Edit(text, None, False, "no handler of the agent's in the config")


def has_handler(text: str, handler: Handler, dropin: str | None = None) -> bool:
    """Whether the files (main, and our drop-in if any) configure the handler with our binary."""
    for part in (text, dropin or ""):
        if not part:
            continue
        data = parse(part)
        plugin = CRI_V2 if data.get("version") == 2 else CRI_V3
        found = _runtimes(data, plugin).get(handler.name, {})
        if isinstance(found, dict) and found.get("options", {}).get("BinaryName") == handler.binary:
            return True
    return False
