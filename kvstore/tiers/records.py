"""Page records: the self-checking form of a page on disk and in the remote tier.

A record is a 72-byte header followed by the payload. Header, little-endian:

    magic "KVPR" | version u16 | codec u8 | flags u8 | namespace 16B | key 16B |
    raw_length u64 | payload_length u64 | payload xxh3_64 u64 | header xxh3_64 u64

Flags are 0, or `FLAG_MAC` for an authenticated record (the remote tier's, with
`tiers.remote.record_key_file`): a `MAC_BYTES` HMAC-SHA256 under the fleet's record key
follows the header, over the header (namespace, key, codec, lengths, checksum) and the
payload. Checksums catch a flipped bit; only the MAC stops a record someone else wrote.

The header checksum covers every header byte before it, so a flipped bit in the key
or a length is caught without reading the payload (recovery reads headers only); the
payload checksum is checked on every read. A record that fails either is corrupt:
a miss, never data.

- `pack_header(namespace, key, codec, raw_length, payload) -> bytes`
- `unpack_header(buf) -> RecordHeader`, raising `CorruptRecord`
- `RecordHeader.check_payload(payload)` / `RecordHeader.decode(payload)`: the page
- `RecordKey(secret)`: `mac(header, payload)` to write; `hasher(header)`, fed the payload as it
  arrives, and `verify(hasher, mac)`, raising `ForgedRecord`, to read
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import NamedTuple

import xxhash

from kvstore.shared.keys import KEY_BYTES
from kvstore.tiers.codec import Buffer, Codec, decompress

MAGIC = b"KVPR"
FORMAT_VERSION = 1
_FIELDS = struct.Struct("<4sHBB16s16sQQQ")
_CHECK = struct.Struct("<Q")
HEADER_BYTES = _FIELDS.size + _CHECK.size
FLAG_MAC = 0x01  # a MAC_BYTES MAC follows the header
MAC_BYTES = 32
MIN_RECORD_KEY_BYTES = 16
_MAC_DOMAIN = b"kvstore page record MAC v1\0"  # the key file's secret MACs nothing else


class CorruptRecord(ValueError):
    """A record's header or payload does not check out; the message says which."""


class ForgedRecord(CorruptRecord):
    """A record without a MAC, or whose MAC fails, under this daemon's record key: someone without
    the fleet's key wrote it (or a daemon with another key file)."""


class RecordHeader(NamedTuple):
    namespace: bytes
    key: bytes
    codec: Codec
    raw_length: int
    payload_length: int
    payload_xxh3: int
    flags: int = 0

    @property
    def authenticated(self) -> bool:
        return bool(self.flags & FLAG_MAC)

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
    namespace: bytes, key: bytes, codec: Codec, raw_length: int, payload: bytes | memoryview, flags: int = 0
) -> bytes:
    if len(namespace) != KEY_BYTES or len(key) != KEY_BYTES:
        raise ValueError(f"namespace and key: expected {KEY_BYTES} bytes each")
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        codec,
        flags,
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
    magic, version, codec, flags, namespace, key, raw_length, payload_length, payload_xxh3 = _FIELDS.unpack(
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
    if flags & ~FLAG_MAC:
        raise CorruptRecord(f"unknown flags {flags:#x}")
    return RecordHeader(namespace, key, codec_id, raw_length, payload_length, payload_xxh3, flags)


class RecordKey:
    """The fleet's secret for authenticated records. HMAC-SHA256, faster than keyed BLAKE2b on
    CPUs with SHA extensions (1.3-1.6 against 0.9 GB/s on one core: bench/NOTES-remote.md)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_RECORD_KEY_BYTES:
            raise ValueError(f"a record key of {len(secret)} bytes; expected at least {MIN_RECORD_KEY_BYTES}")
        self._base = hmac.new(secret, _MAC_DOMAIN, hashlib.sha256)

    def hasher(self, header: Buffer) -> hmac.HMAC:
        """A MAC in progress over `header`; feed it the payload, then `verify`."""
        hasher = self._base.copy()
        hasher.update(header)
        return hasher

    def mac(self, header: Buffer, payload: Buffer) -> bytes:
        hasher = self.hasher(header)
        hasher.update(payload)
        return hasher.digest()

    @staticmethod
    def verify(hasher: hmac.HMAC, mac: bytes) -> None:
        if not hmac.compare_digest(hasher.digest(), mac):
            raise ForgedRecord("its MAC does not check out under this daemon's record key")
