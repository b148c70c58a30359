"""The stored form of one chunk: a small self-describing header, then raw or zstd bytes, optionally sealed
with AES-256-GCM. Readers need no object metadata, so any S3 server (and any copy tool) keeps chunks intact.

    magic "IBCK" | format u8 | codec u8 | cipher u8 | reserved u8 | plain size u64 (big endian)
    [nonce 12 bytes, if cipher = AES-256-GCM]
    payload (AES-GCM also appends its 16-byte tag; the header and the chunk id are its associated data)

A chunk's id is the sha256 of its plain bytes, or, with client-side encryption, an HMAC of that hash keyed
from the encryption key (so the bucket does not reveal which plaintexts are equal to someone without it).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
from dataclasses import dataclass
from enum import IntEnum

import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"IBCK"
FORMAT_VERSION = 1
_HEADER = struct.Struct(">4sBBBBQ")
HEADER_SIZE = _HEADER.size
NONCE_SIZE = 12
TAG_SIZE = 16
# Compress a sample first; a chunk whose sample does not shrink by this much is stored raw without
# spending a full compression on it (numerical data usually does not compress).
PROBE_SIZE = 64 * 1024
PROBE_MIN_SAVING = 0.03
# Keep the compressed form only if it saves at least this fraction of the chunk.
MIN_SAVING = 0.05


class Codec(IntEnum):
    RAW = 0
    ZSTD = 1


class Cipher(IntEnum):
    NONE = 0
    AES_256_GCM = 1


class CodecError(ValueError):
    """The stored bytes are not a valid chunk (truncated, flipped, or wrong key)."""


@dataclass(frozen=True)
class ChunkKeys:
    """Keys derived from the client-side encryption key: one seals chunks, one names them."""

    seal: bytes
    naming: bytes
    fingerprint: str

    @classmethod
    def derive(cls, master: bytes) -> ChunkKeys:
        def expand(info: bytes) -> bytes:
            return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(master)

        return cls(
            seal=expand(b"ibckpt chunk seal v1"),
            naming=expand(b"ibckpt chunk naming v1"),
            fingerprint=expand(b"ibckpt key fingerprint v1").hex()[:16],
        )


def chunk_id(sha256_digest: bytes, keys: ChunkKeys | None) -> str:
    if keys is None:
        return sha256_digest.hex()
    return hmac.new(keys.naming, sha256_digest, hashlib.sha256).hexdigest()


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # ZstdCompressor objects are not safe to share between threads; keep one per thread and level.
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    found: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if found is None:
        found = zstandard.ZstdDecompressor()
        _local.decompressor = found
    return found


def worth_compressing(plain: bytes | memoryview, level: int) -> bool:
    """Cheap guess from a sample in the middle of the chunk."""
    if len(plain) <= PROBE_SIZE:
        return True
    start = (len(plain) - PROBE_SIZE) // 2
    sample = bytes(plain[start : start + PROBE_SIZE])
    return len(_compressor(min(level, 1)).compress(sample)) <= PROBE_SIZE * (1 - PROBE_MIN_SAVING)


def compress(plain: bytes | memoryview, level: int) -> tuple[bytes | memoryview, Codec]:
    """zstd at `level` if it pays, else the bytes unchanged. Level 0 never compresses."""
    if level <= 0 or not plain or not worth_compressing(plain, level):
        return plain, Codec.RAW
    packed = _compressor(level).compress(plain)
    if len(packed) > len(plain) * (1 - MIN_SAVING):
        return plain, Codec.RAW
    return packed, Codec.ZSTD


def seal(
    payload: bytes | memoryview, codec: Codec, plain_size: int, cid: str, keys: ChunkKeys | None
) -> bytes:
    """Header + payload, encrypted when keys are given."""
    cipher = Cipher.NONE if keys is None else Cipher.AES_256_GCM
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, codec, cipher, 0, plain_size)
    if keys is None:
        return header + payload
    nonce = os.urandom(NONCE_SIZE)
    return header + nonce + AESGCM(keys.seal).encrypt(nonce, payload, header + cid.encode())


def framed_buffer(plain_size: int) -> bytearray:
    """Room for a chunk's header followed by its `plain_size` plain bytes, for `seal_framed`: the caller
    reads the plain bytes straight into buffer[HEADER_SIZE:]."""
    return bytearray(HEADER_SIZE + plain_size)


def seal_framed(
    buffer: bytearray, payload: bytes | memoryview, codec: Codec, cid: str, keys: ChunkKeys | None
) -> bytearray:
    """The stored chunk of the plain bytes at buffer[HEADER_SIZE:], byte for byte what seal() gives;
    `payload` and `codec` are what compress() gave for them. Raw and unencrypted (memory pages that do
    not compress, most of a dump), the header is written in place and `buffer` is the result: no copy of
    the chunk. Otherwise the payload is copied (or encrypted) once, straight into the result."""
    plain_size = len(buffer) - HEADER_SIZE
    cipher = Cipher.NONE if keys is None else Cipher.AES_256_GCM
    if keys is None and codec is Codec.RAW:
        _HEADER.pack_into(buffer, 0, MAGIC, FORMAT_VERSION, codec, cipher, 0, plain_size)
        return buffer
    extra = 0 if keys is None else NONCE_SIZE + TAG_SIZE
    stored = bytearray(HEADER_SIZE + extra + len(payload))
    _HEADER.pack_into(stored, 0, MAGIC, FORMAT_VERSION, codec, cipher, 0, plain_size)
    if keys is None:
        stored[HEADER_SIZE:] = payload
        return stored
    nonce = os.urandom(NONCE_SIZE)
    stored[HEADER_SIZE : HEADER_SIZE + NONCE_SIZE] = nonce
    associated = bytes(stored[:HEADER_SIZE]) + cid.encode()
    ciphertext = memoryview(stored)[HEADER_SIZE + NONCE_SIZE :]
    AESGCM(keys.seal).encrypt_into(nonce, payload, associated, ciphertext)
    return stored


def open_chunk(stored: bytes | bytearray, cid: str, keys: ChunkKeys | None) -> bytes | memoryview:
    """Stored bytes -> plain bytes, checking the header, the GCM tag and the size (not the hash). A raw,
    unencrypted chunk's plain bytes are a view of `stored`, not a copy."""
    if len(stored) < HEADER_SIZE:
        raise CodecError(f"truncated: {len(stored)} bytes, shorter than the header")
    magic, version, codec_value, cipher_value, _reserved, plain_size = _HEADER.unpack_from(stored)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CodecError("bad header (not an ibckpt chunk, or damaged)")
    try:
        codec, cipher = Codec(codec_value), Cipher(cipher_value)
    except ValueError:
        raise CodecError(f"unknown codec {codec_value} or cipher {cipher_value}") from None
    # A view: slicing bytes would copy the whole chunk once more.
    header, body = bytes(stored[:HEADER_SIZE]), memoryview(stored)[HEADER_SIZE:]
    plain: bytes | memoryview
    if cipher is Cipher.AES_256_GCM:
        if keys is None:
            raise CodecError("the chunk is encrypted and no client-side key is configured")
        if len(body) < NONCE_SIZE + TAG_SIZE:
            raise CodecError("truncated encrypted chunk")
        try:
            body = memoryview(
                AESGCM(keys.seal).decrypt(body[:NONCE_SIZE], body[NONCE_SIZE:], header + cid.encode())
            )
        except InvalidTag:
            raise CodecError("authentication failed (damaged, or sealed with another key)") from None
    if codec is Codec.ZSTD:
        try:
            plain = _decompressor().decompress(body, max_output_size=plain_size)
        except zstandard.ZstdError as error:
            raise CodecError(f"zstd: {error}") from None
    else:
        plain = body
    if len(plain) != plain_size:
        raise CodecError(f"decoded to {len(plain)} bytes, the header says {plain_size}")
    return plain
