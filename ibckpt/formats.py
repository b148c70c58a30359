"""The formats a checkpoint is written in, and which of them this release reads.

Whether a checkpoint restores under another ibckpt release depends on these, not on the release's
version string: a release that reads every format a checkpoint was written in restores it
(docs/upgrade.md, "Checkpoints taken before"). A change to any of them that an older reader would
misread gets a new number here; a reader that still understands the old one keeps it in READS.

- `manifest`: the store's manifest schema (ibckpt/store/manifest.py SCHEMA_VERSION, SUPPORTED_SCHEMAS);
- `chunks`: a stored chunk's header, codec and cipher framing (ibckpt/store/codec.py FORMAT_VERSION);
- `restore`: the restore record an agent stages for CRIU: the session's image tree, each tree's
  `ibckpt-tree.json` (the ranks to rebuild), and the files written beside CRIU's images;
- `shimProtocol`: the control protocol the restored processes' shim speaks to the node
  (native/include/ibckpt.h IBCKPT_PROTO_VERSION): their memory holds the old shim's side of it.

Pure constants: the operator's machines import this, so it imports nothing of the store or the shim
(tests/api/test_formats.py checks that the numbers match theirs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

MANIFEST = "manifest"
CHUNKS = "chunks"
RESTORE = "restore"
SHIM_PROTOCOL = "shimProtocol"

# What a checkpoint taken by this release is written in (the manifest: the newest schema it may write).
WRITES: Mapping[str, int] = {MANIFEST: 4, CHUNKS: 1, RESTORE: 1, SHIM_PROTOCOL: 1}
# What this release reads.
READS: Mapping[str, Sequence[int]] = {
    MANIFEST: (1, 2, 3, 4),
    CHUNKS: (1,),
    RESTORE: (1,),
    SHIM_PROTOCOL: (1,),
}
# A checkpoint recorded before its formats were: every release until then wrote these.
BEFORE_RECORDED: Mapping[str, int] = {MANIFEST: 2, CHUNKS: 1, RESTORE: 1, SHIM_PROTOCOL: 1}

WHAT = {
    MANIFEST: "store manifest schema",
    CHUNKS: "chunk format",
    RESTORE: "restore record format",
    SHIM_PROTOCOL: "shim control protocol",
}


def written_by(nodes: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """The formats of a checkpoint whose nodes' agents wrote these: the newest of each (the nodes of
    one job run one release but during an upgrade; a reader must then read the newest)."""
    merged: dict[str, int] = {}
    for formats in nodes:
        for name, version in formats.items():
            merged[name] = max(version, merged.get(name, version))
    return merged


def unreadable(written: Mapping[str, int] | None, reads: Mapping[str, Sequence[int]]) -> list[str]:
    """Why a reader of `reads` cannot restore a checkpoint written in `written` (None: from before
    formats were recorded); empty: it can."""
    problems = []
    for name, version in sorted((written if written is not None else BEFORE_RECORDED).items()):
        what = WHAT.get(name, f"{name} format")
        known = sorted(reads.get(name) or ())
        if version not in known:
            reads_text = ", ".join(map(str, known)) if known else "none"
            problems.append(f"the checkpoint's {what} is {version}, its agent reads {reads_text}")
    return problems
