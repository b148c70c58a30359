"""Pure logic only: chunk spans, the chunk codec, the manifest schema, retention selection, configuration."""

from __future__ import annotations

import base64
import hashlib
import itertools
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from store.conftest import sample_manifest

from ibckpt.store import codec
from ibckpt.store.chunking import Span, TreeError, check_relative, spans, walk
from ibckpt.store.config import config_from_env, credentials_from_secret
from ibckpt.store.errors import ConfigError, ManifestError, StoreError
from ibckpt.store.layout import CheckpointRef, Layout, new_checkpoint_id, parse_checkpoint_ref
from ibckpt.store.manifest import ChunkRef, FileRecord, Manifest, parse_manifest
from ibckpt.store.retention import CheckpointFacts, RetentionPolicy, decide
from ibckpt.store.units import format_size, parse_duration, parse_size

# -- chunking -----------------------------------------------------------------------------------------


def test_spans_cover_the_file_exactly() -> None:
    assert spans(0, 10) == []
    assert spans(10, 10) == [Span(0, 0, 10)]
    assert spans(25, 10) == [Span(0, 0, 10), Span(1, 10, 10), Span(2, 20, 5)]
    for size in (1, 9, 10, 11, 99, 100, 101):
        parts = spans(size, 10)
        assert sum(part.length for part in parts) == size
        assert all(a.offset + a.length == b.offset for a, b in itertools.pairwise(parts))


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../x", "a//b", "", "./a", "a/", "a/./b", "."])
def test_unsafe_paths_are_refused(path: str) -> None:
    with pytest.raises(TreeError):
        check_relative(path)


def test_walk_orders_parents_first_and_refuses_special_files(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.img").write_bytes(b"12")
    (tmp_path / "a.img").write_bytes(b"1")
    os.symlink("a.img", tmp_path / "c")
    assert [(entry.path, entry.kind, entry.size) for entry in walk(tmp_path)] == [
        ("a.img", "file", 1),
        ("b", "dir", 0),
        ("b/z.img", "file", 2),
        ("c", "symlink", 0),
    ]
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(TreeError, match="fifo"):
        list(walk(tmp_path))


# -- codec ----------------------------------------------------------------------------------------------


def encode(plain: bytes, level: int, keys: codec.ChunkKeys | None = None) -> tuple[str, bytes, codec.Codec]:
    cid = codec.chunk_id(hashlib.sha256(plain).digest(), keys)
    payload, chosen = codec.compress(plain, level)
    return cid, codec.seal(payload, chosen, len(plain), cid, keys), chosen


def test_compressible_chunks_are_compressed_and_random_ones_are_not() -> None:
    text = b"residual 0.0001 converged false\n" * 10_000
    cid, stored, chosen = encode(text, 3)
    assert chosen is codec.Codec.ZSTD and len(stored) < len(text) / 20
    assert codec.open_chunk(stored, cid, None) == text
    noise = os.urandom(300_000)
    cid, stored, chosen = encode(noise, 3)
    assert chosen is codec.Codec.RAW and len(stored) == len(noise) + codec.HEADER_SIZE
    assert codec.open_chunk(stored, cid, None) == noise
    assert encode(text, 0)[2] is codec.Codec.RAW


def framed(plain: bytes, level: int, keys: codec.ChunkKeys | None = None) -> tuple[str, bytearray, bytearray]:
    """(id, the buffer the upload reads into, what seal_framed made of it) for `plain`."""
    buffer = codec.framed_buffer(len(plain))
    buffer[codec.HEADER_SIZE :] = plain
    cid = codec.chunk_id(hashlib.sha256(plain).digest(), keys)
    payload, chosen = codec.compress(memoryview(buffer)[codec.HEADER_SIZE :], level)
    return cid, buffer, codec.seal_framed(buffer, payload, chosen, cid, keys)


def test_an_incompressible_chunk_is_framed_in_its_own_buffer_and_reads_back() -> None:
    noise = os.urandom(300_000)
    cid, buffer, stored = framed(noise, 3)
    assert stored is buffer  # the header written in place: the chunk's bytes are not copied
    assert bytes(stored) == encode(noise, 3)[1]  # the format is seal()'s, byte for byte
    plain = codec.open_chunk(bytes(stored), cid, None)
    assert isinstance(plain, memoryview) and bytes(plain) == noise  # read back as a view, not a copy


def test_a_compressible_chunk_is_still_compressed_when_framed() -> None:
    text = b"rank 3 step 1000 residual 1.0e-06 converged false\n" * 20_000
    cid, buffer, stored = framed(text, 3)
    assert stored is not buffer and len(stored) < len(text) / 20
    assert bytes(stored) == encode(text, 3)[1]
    assert codec.open_chunk(bytes(stored), cid, None) == text
    assert bytes(framed(text, 0)[2]) == encode(text, 0)[1]  # level 0: raw


def test_framed_encrypted_chunks_open_with_the_key_only() -> None:
    keys = codec.ChunkKeys.derive(os.urandom(32))
    for plain in (os.urandom(200_000), b"secret pages " * 20_000):
        cid, buffer, stored = framed(plain, 3, keys)
        assert (
            stored is not buffer
            and bytes(stored[: codec.HEADER_SIZE]) == encode(plain, 3, keys)[1][: codec.HEADER_SIZE]
        )
        assert len(stored) == len(encode(plain, 3, keys)[1])
        assert codec.open_chunk(bytes(stored), cid, keys) == plain
        with pytest.raises(codec.CodecError, match="authentication failed"):
            codec.open_chunk(bytes(stored), cid, codec.ChunkKeys.derive(os.urandom(32)))


def test_damaged_chunks_fail_to_open() -> None:
    text = b"abc" * 50_000
    cid, stored, _ = encode(text, 3)
    with pytest.raises(codec.CodecError, match="truncated"):
        codec.open_chunk(stored[:5], cid, None)
    with pytest.raises(codec.CodecError, match="bad header"):
        codec.open_chunk(b"XXXX" + stored[4:], cid, None)
    with pytest.raises(codec.CodecError):
        codec.open_chunk(stored[:-3], cid, None)


def test_encrypted_chunks_are_bound_to_key_and_id() -> None:
    keys = codec.ChunkKeys.derive(os.urandom(32))
    plain = b"secret pages " * 1000
    cid, stored, _ = encode(plain, 3, keys)
    assert cid != hashlib.sha256(plain).hexdigest()
    assert codec.open_chunk(stored, cid, keys) == plain
    with pytest.raises(codec.CodecError, match="authentication failed"):
        codec.open_chunk(stored, cid, codec.ChunkKeys.derive(os.urandom(32)))
    with pytest.raises(codec.CodecError, match="authentication failed"):
        codec.open_chunk(stored, "0" * 64, keys)  # served under another chunk's name
    with pytest.raises(codec.CodecError, match="no client-side key"):
        codec.open_chunk(stored, cid, None)
    assert codec.ChunkKeys.derive(b"k" * 32).fingerprint == codec.ChunkKeys.derive(b"k" * 32).fingerprint


# -- manifest -------------------------------------------------------------------------------------------


def test_manifest_round_trips_through_json() -> None:
    manifest = sample_manifest()
    assert parse_manifest(manifest.to_json(), "here") == manifest
    assert manifest.chunk_sizes() == {"ab" * 32: 30}
    assert manifest.ref == CheckpointRef("ns/solver", "c1")


def test_manifest_refuses_unknown_schema_and_inconsistency() -> None:
    newer = sample_manifest().to_json().replace(b'"schema_version": 2', b'"schema_version": 5')
    with pytest.raises(ManifestError, match=r"schema_version 5; this ibckpt reads \[1, 2, 3, 4\]"):
        parse_manifest(newer, "x")
    with pytest.raises(ManifestError, match="not JSON"):
        parse_manifest(b"{", "x")
    with pytest.raises(ValueError, match="do not add up"):
        FileRecord(
            path="f",
            kind="file",
            mode=0o644,
            size=11,
            chunks=[ChunkRef(id="ab" * 32, size=10, stored_size=1)],
        )
    with pytest.raises(ValueError, match="unsafe path"):
        FileRecord(path="../escape", kind="dir", mode=0o755)
    with pytest.raises(ValueError, match="duplicate"):
        sample_manifest(files=[FileRecord(path="d", kind="dir", mode=0o755)] * 2)


# -- retention --------------------------------------------------------------------------------------------

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def facts(job: str, name: str, hours_ago: float, chunks: dict[str, int] | None = None) -> CheckpointFacts:
    return CheckpointFacts(CheckpointRef(job, name), NOW - timedelta(hours=hours_ago), chunks or {})


def kept(decisions: list) -> set[str]:  # type: ignore[type-arg]
    return {decision.ref.checkpoint_id for decision in decisions if decision.keep}


def test_keep_last_applies_per_job() -> None:
    all_facts = [facts("a", f"a{i}", hours_ago=10 - i) for i in range(5)] + [facts("b", "b0", 100)]
    assert kept(decide(all_facts, RetentionPolicy(keep_last=2), NOW)) == {"a3", "a4", "b0"}
    assert kept(decide(all_facts, RetentionPolicy(), NOW)) == {f"a{i}" for i in range(5)} | {"b0"}


def test_max_age_and_min_keep() -> None:
    all_facts = [facts("a", "old", 50), facts("a", "mid", 30), facts("a", "new", 1)]
    assert kept(decide(all_facts, RetentionPolicy(max_age=timedelta(hours=40)), NOW)) == {"mid", "new"}
    assert kept(decide(all_facts, RetentionPolicy(max_age=timedelta(minutes=1)), NOW)) == {"new"}
    assert kept(decide(all_facts, RetentionPolicy(max_age=timedelta(minutes=1), min_keep=0), NOW)) == set()
    assert kept(decide(all_facts, RetentionPolicy(keep_last=1, min_keep=2), NOW)) == {"mid", "new"}


def test_max_bytes_counts_shared_chunks_once() -> None:
    shared = {"s": 100}
    all_facts = [
        facts("a", "c1", 3, shared | {"x1": 10}),
        facts("a", "c2", 2, shared | {"x2": 10}),
        facts("a", "c3", 1, shared | {"x3": 10}),
    ]
    assert kept(decide(all_facts, RetentionPolicy(max_bytes=125), NOW)) == {"c3", "c2"}
    assert kept(decide(all_facts, RetentionPolicy(max_bytes=130), NOW)) == {"c1", "c2", "c3"}
    assert kept(decide(all_facts, RetentionPolicy(max_bytes=10, min_keep=0), NOW)) == set()


def test_every_rule_must_keep() -> None:
    all_facts = [facts("a", f"c{i}", hours_ago=10 - i, chunks={f"x{i}": 10}) for i in range(6)]
    policy = RetentionPolicy(keep_last=4, max_age=timedelta(hours=8.5), max_bytes=25)
    assert kept(decide(all_facts, policy, NOW)) == {"c5", "c4"}


# -- configuration, names, units --------------------------------------------------------------------------


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_credentials_from_secret_data() -> None:
    creds = credentials_from_secret(
        {"AWS_ACCESS_KEY_ID": b64("AKIA1"), "AWS_SECRET_ACCESS_KEY": b64("s3cr3t\n")}
    )
    assert creds.access_key_id.get_secret_value() == "AKIA1"
    assert creds.secret_access_key.get_secret_value() == "s3cr3t"
    assert "s3cr3t" not in repr(creds) and "s3cr3t" not in str(creds.model_dump())
    short = credentials_from_secret({"accessKey": "id", "secretKey": "key"}, encoded=False, name="minio")
    assert short.source == "Secret minio"


def test_secret_errors_name_keys_not_values() -> None:
    with pytest.raises(ConfigError, match=r"it has keys \['password', 'user'\]") as info:
        credentials_from_secret({"user": b64("me"), "password": b64("hunter2hunter2")})
    assert "hunter2" not in str(info.value)
    with pytest.raises(ConfigError, match="not valid base64") as info:
        credentials_from_secret({"AWS_ACCESS_KEY_ID": b64("AKIA"), "AWS_SECRET_ACCESS_KEY": "not base64 !!"})
    assert "not base64 !!" not in str(info.value)


def test_config_from_env() -> None:
    env = {
        "IBCKPT_S3_BUCKET": "ckpts",
        "IBCKPT_S3_ENDPOINT": "https://s3.example.test",
        "IBCKPT_S3_PREFIX": "/team/",
        "IBCKPT_S3_ADDRESSING": "virtual",
        "IBCKPT_CHUNK_SIZE": "16MiB",
        "IBCKPT_S3_READ_TIMEOUT": "2m",
        "IBCKPT_ENCRYPTION": "client",
        "IBCKPT_ENCRYPTION_KEY": base64.b64encode(b"k" * 32).decode(),
    }
    config = config_from_env(env)
    assert (config.bucket, config.prefix, config.addressing_style) == ("ckpts", "team", "virtual")
    assert config.chunk_size == 16 * 1024 * 1024 and config.read_timeout == 120
    assert config.where() == "endpoint https://s3.example.test, bucket 'ckpts'"
    assert config_from_env(env, bucket="other").bucket == "other"
    with pytest.raises(ConfigError, match="bucket"):
        config_from_env({})
    with pytest.raises(ConfigError, match="needs a key"):
        config_from_env({"IBCKPT_S3_BUCKET": "b", "IBCKPT_ENCRYPTION": "client"})
    with pytest.raises(ConfigError, match="chunk_size") as info:
        config_from_env({"IBCKPT_S3_BUCKET": "b", "IBCKPT_CHUNK_SIZE": "1KiB"})
    assert "1024" not in str(info.value)


def test_a_jobs_compression_keeps_the_configured_level_or_turns_it_off() -> None:
    config = config_from_env({"IBCKPT_S3_BUCKET": "b", "IBCKPT_COMPRESSION_LEVEL": "9"})
    assert config.for_codec("zstd").compression_level == 9
    off = config.for_codec("none")
    assert off.compression_level == 0 and off.model_copy(update={"compression_level": 9}) == config


def test_names_and_units() -> None:
    assert parse_checkpoint_ref("ns/job/c1") == ("ns/job", "c1")
    assert parse_checkpoint_ref("job/latest") == ("job", "latest")
    for bad in ("job", "/c1", "a/b/c/d", "job/../x"):
        with pytest.raises(ValueError):
            parse_checkpoint_ref(bad)
    layout = Layout("pre")
    ref = CheckpointRef("ns/job", new_checkpoint_id())
    assert layout.ref_from_manifest_key(layout.manifest_key(ref)) == ref
    assert layout.chunk_key("ab" * 32).startswith("pre/v1/chunks/ab/")
    assert parse_size("8MiB") == 8 * 1024 * 1024 and parse_size("2G") == 2_000_000_000
    assert parse_duration("1h30m") == 5400 and parse_duration("90") == 90
    with pytest.raises(ValueError):
        parse_duration("soon")


# -- merging the parts of a multi-node checkpoint ---------------------------------------------------------


def part(name: str, rank: int, paths: list[str]) -> Manifest:
    from ibckpt.store.manifest import PART_KIND, RankInfo

    records = [FileRecord(path=path, kind="dir", mode=0o755) for path in paths]
    return sample_manifest(kind=PART_KIND, files=records, ranks=[RankInfo(rank=rank, node=name)])


def test_merge_parts() -> None:
    from ibckpt.store.manifest import MANIFEST_KIND
    from ibckpt.store.parts import merge_parts

    merged = merge_parts({"b": part("b", 1, ["ranks", "ranks/1"]), "a": part("a", 0, ["ranks", "ranks/0"])})
    assert merged.kind == MANIFEST_KIND
    assert [rank.node for rank in merged.ranks] == ["a", "b"]
    assert sorted(record.path for record in merged.files) == ["ranks", "ranks/0", "ranks/1"]
    with pytest.raises(StoreError, match="same rank twice"):
        merge_parts({"a": part("a", 0, ["x"]), "b": part("b", 0, ["y"])})
    clash = sample_manifest(kind="ibckpt.dev/CheckpointPart")  # has the file d/pages.img, like the other
    with pytest.raises(StoreError, match=r"both contain 'd/pages\.img'"):
        merge_parts({"a": clash, "b": clash.model_copy(update={"ranks": []})})


def test_wrong_region_message_names_the_right_one() -> None:
    import botocore.exceptions
    from pydantic import SecretStr

    from ibckpt.store.config import Credentials, StoreConfig
    from ibckpt.store.s3 import connect, translate

    secret = "do-not-print-this-secret"
    creds = Credentials(access_key_id=SecretStr("AKIA"), secret_access_key=SecretStr(secret), source="env")
    connection = connect(StoreConfig(bucket="ckpts", region="us-east-1", credentials=creds))
    response: dict[str, object] = {
        "Error": {"Code": "PermanentRedirect", "Message": "moved"},
        "ResponseMetadata": {"HTTPStatusCode": 301, "HTTPHeaders": {"x-amz-bucket-region": "eu-west-1"}},
    }
    error = botocore.exceptions.ClientError(response, "HeadBucket")  # type: ignore[arg-type]
    message = str(translate(error, connection, "checking the bucket"))
    assert "bucket 'ckpts' is not in region us-east-1" in message and "it is in eu-west-1" in message
    assert "AWS S3 (us-east-1)" in message and secret not in message


def test_sizes_read_as_three_digits_never_in_exponent_form() -> None:
    got = [format_size(n) for n in (0, 999, 1024, 400_000, 1000 * 2**20, 1.5 * 2**30, 50 * 2**20)]
    assert got == ["0 B", "999 B", "1.00 KiB", "391 KiB", "1000 MiB", "1.50 GiB", "50.0 MiB"]
