"""The format numbers a checkpoint's compatibility is judged by (ibckpt/formats.py) are the ones the
store, the shim and its client actually use; merging the nodes' formats; the refusal's words."""

from __future__ import annotations

import re
from pathlib import Path

from ibckpt import formats
from ibckpt.agentapi import AgentFormats
from ibckpt.store import codec, manifest
from ibckpt_native import control

ROOT = Path(__file__).resolve().parents[2]


def test_the_numbers_are_the_store_and_shim_ones() -> None:
    assert formats.WRITES[formats.MANIFEST] == manifest.SCHEMA_VERSION
    assert set(formats.READS[formats.MANIFEST]) == set(manifest.SUPPORTED_SCHEMAS)
    assert formats.WRITES[formats.CHUNKS] == codec.FORMAT_VERSION
    assert formats.READS[formats.CHUNKS] == (codec.FORMAT_VERSION,)  # the codec reads only its own
    header = (ROOT / "native" / "include" / "ibckpt.h").read_text()
    proto = re.search(r"#define IBCKPT_PROTO_VERSION (\d+)", header)
    assert proto is not None
    assert formats.WRITES[formats.SHIM_PROTOCOL] == int(proto.group(1)) == control.PROTO_VERSION
    assert formats.READS[formats.SHIM_PROTOCOL] == (control.PROTO_VERSION,)


def test_a_release_reads_what_it_writes_and_what_it_wrote_before_recording() -> None:
    assert formats.unreadable(formats.WRITES, formats.READS) == []
    assert formats.unreadable(None, formats.READS) == []
    assert set(formats.WRITES) == set(formats.READS) == set(formats.BEFORE_RECORDED)
    reported = AgentFormats.this_release()
    assert AgentFormats.from_json(reported.to_json()) == reported  # on the wire as the operator reads it


def test_the_nodes_formats_merge_to_the_newest_of_each() -> None:
    merged = formats.written_by([{"manifest": 1, "restore": 1}, {"manifest": 2, "restore": 1, "chunks": 1}])
    assert merged == {"manifest": 2, "restore": 1, "chunks": 1}
    assert formats.written_by([]) == {}


def test_a_format_not_read_is_named_with_what_is_read() -> None:
    problems = formats.unreadable({"restore": 2, "manifest": 2}, {"restore": [1], "manifest": [1, 2]})
    assert problems == ["the checkpoint's restore record format is 2, its agent reads 1"]
    assert formats.unreadable({"restore": 1}, {}) == [
        "the checkpoint's restore record format is 1, its agent reads none"
    ]
