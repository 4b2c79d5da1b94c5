"""Page records: the self-checking form of a page on disk (and, later, in the remote tier).

A record is a 72-byte header followed by the payload. Header, little-endian:

    magic "KVPR" | version u16 | codec u8 | flags u8 (0) | namespace 16B | key 16B |
    raw_length u64 | payload_length u64 | payload xxh3_64 u64 | header xxh3_64 u64

The header checksum covers every header byte before it, so a flipped bit in the key
or a length is caught without reading the payload (recovery reads headers only); the
payload checksum is checked on every read. A record that fails either is corrupt:
a miss, never data.

- `pack_header(namespace, key, codec, raw_length, payload) -> bytes`
- `unpack_header(buf) -> RecordHeader`, raising `CorruptRecord`
- `RecordHeader.check_payload(payload)` / `RecordHeader.decode(payload)`: the page
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from kvstore.codec import Buffer, Codec, decompress
from kvstore.keys import KEY_BYTES

MAGIC = b"KVPR"
FORMAT_VERSION = 1
_FIELDS = struct.Struct("<4sHBB16s16sQQQ")
_CHECK = struct.Struct("<Q")
HEADER_BYTES = _FIELDS.size + _CHECK.size


class CorruptRecord(ValueError):
    """A record's header or payload does not check out; the message says which."""


class RecordHeader(NamedTuple):
    namespace: bytes
    key: bytes
    codec: Codec
    raw_length: int
    payload_length: int
    payload_xxh3: int

    @property
    def record_bytes(self) -> int:
        return HEADER_BYTES + self.payload_length

    def check_payload(self, payload: Buffer) -> None:
        if len(payload) != self.payload_length:
            raise CorruptRecord(f"payload is {len(payload)} bytes, the header says {self.payload_length}")
        if xxhash.xxh3_64_intdigest(payload) != self.payload_xxh3:
            raise CorruptRecord("payload checksum mismatch")

    def decode(self, payload: Buffer) -> Buffer:
        """The page in `payload` (itself when stored raw), checked against this header."""
        self.check_payload(payload)
        try:
            return decompress(self.codec, payload, self.raw_length)
        except ValueError as exc:
            raise CorruptRecord(str(exc)) from None


def pack_header(
    namespace: bytes, key: bytes, codec: Codec, raw_length: int, payload: bytes | memoryview
) -> bytes:
    if len(namespace) != KEY_BYTES or len(key) != KEY_BYTES:
        raise ValueError(f"namespace and key: expected {KEY_BYTES} bytes each")
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        codec,
        0,
        namespace,
        key,
        raw_length,
        len(payload),
        xxhash.xxh3_64_intdigest(payload),
    )
    return fields + _CHECK.pack(xxhash.xxh3_64_intdigest(fields))


def unpack_header(buf: Buffer) -> RecordHeader:
    if len(buf) < HEADER_BYTES:
        raise CorruptRecord(f"header is {len(buf)} bytes, expected {HEADER_BYTES}")
    fields = bytes(buf[: _FIELDS.size])
    (check,) = _CHECK.unpack_from(buf, _FIELDS.size)
    magic, version, codec, _flags, namespace, key, raw_length, payload_length, payload_xxh3 = _FIELDS.unpack(
        fields
    )
    if magic != MAGIC:
        raise CorruptRecord(f"bad magic {magic!r}")
    if xxhash.xxh3_64_intdigest(fields) != check:
        raise CorruptRecord("header checksum mismatch")
    if version != FORMAT_VERSION:
        raise CorruptRecord(f"format version {version}; this daemon reads version {FORMAT_VERSION}")
    try:
        codec_id = Codec(codec)
    except ValueError:
        raise CorruptRecord(f"unknown codec id {codec}") from None
    return RecordHeader(namespace, key, codec_id, raw_length, payload_length, payload_xxh3)
