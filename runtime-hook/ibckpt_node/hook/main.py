"""`ibckpt-hook [STAGE]`: the OCI runtime hook. The runtime gives the container's state on stdin.

Without STAGE (one hooks.d entry serves both stages) the state's status tells: `stopped` is
poststop, anything else is a create. stages.py does the work.

With hooks.d's `always` the hook runs for every container on the node, so it first looks at the
bundle's config.json as bytes: a container that neither gets a path under /dev/infiniband nor
carries an ibckpt.io/ annotation cannot be ours, and the hook exits before it imports json or
reads its own configuration. Anything it cannot decide that way takes the full path.
"""

from __future__ import annotations

import os
import sys

# Every spec wants_shim() accepts (or a registered container's, at poststop) holds one of these.
MARKERS = (b"/dev/infiniband", b"ibckpt.io/")


def string_field(raw: str, key: str) -> str | None:
    """The value of a top-level string field of the state, or None when it is not plain
    (escapes or odd spacing): the caller then parses the JSON properly."""
    at = raw.find(f'"{key}"')
    if at < 0 or raw.find(f'"{key}"', at + 1) >= 0:
        return None  # absent, or also an annotation's name: let json tell them apart
    rest = raw[at + len(key) + 2 :].lstrip()
    if not rest.startswith(":"):
        return None
    rest = rest[1:].lstrip()
    end = rest.find('"', 1)
    if not rest.startswith('"') or end < 0:
        return None
    value = rest[1:end]
    return None if "\\" in value else value


def not_ours(raw_state: str) -> bool:
    bundle = string_field(raw_state, "bundle")
    return plain_bundle(bundle) if bundle else False


def plain_bundle(bundle: str) -> bool:
    """Whether the bundle's config.json bytes show the container cannot be ours (no marker in them)."""
    try:
        with open(os.path.join(bundle, "config.json"), "rb") as f:
            spec = f.read()
    except OSError:
        return False
    # a JSON writer may escape "/" as "\/": then the markers could hide
    return b"\\/" not in spec and not any(m in spec for m in MARKERS)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    raw_state = sys.stdin.read()
    if not_ours(raw_state):
        return 0
    from ibckpt_node.hook import stages

    return stages.run(args[0] if args else "", raw_state)


if __name__ == "__main__":
    sys.exit(main())
