"""Page codecs for records (disk tier, and the remote tier later): none and lz4 frame.

- `Codec`: the id a record header stores for its payload.
- `CODECS`: config names (`tiers.disk.codec`) to the codec a tier asks for.
- `compress(codec, page) -> (Codec, payload)`: lz4 falls back to NONE for a page it
  does not shrink. KV in bf16/fp16 rarely shrinks under lz4 (bench/NOTES-disk.md), and
  a page stored raw reads back with no decompression, straight into its target buffer.
- `decompress(codec, payload, raw_length)`: the page (for NONE, `payload` itself, not a
  copy); raises `ValueError` for a payload that does not decode to `raw_length` bytes. A
  record's bytes come from a disk or a server, so lz4 is never asked for more than
  `raw_length` bytes: a frame that would decode to more (a 1 MiB record of 256 MiB of zeros)
  is refused after at most `raw_length + 1` bytes of output, never decoded whole.

A byte-shuffle before lz4 (blosc-style high/low byte planes) was measured on KV from
a transformers Llama and left out: it shrinks bf16 a little and fp16 not at all, and
decompresses far slower than lz4 (bench/NOTES-disk.md, "Codecs on real model KV").
"""

from __future__ import annotations

from enum import IntEnum

import lz4.frame


class Codec(IntEnum):
    NONE = 0
    LZ4 = 1  # lz4 frame, 4 MiB blocks, no frame checksum (the record has its own)


CODECS: dict[str, Codec] = {"none": Codec.NONE, "lz4": Codec.LZ4}
Buffer = bytes | bytearray | memoryview


def compress(codec: Codec, page: bytes | memoryview) -> tuple[Codec, bytes | memoryview]:
    """The payload to store for `page` and the codec it is in (NONE when lz4 does not pay)."""
    if codec is Codec.LZ4:
        # 4 MiB blocks: twice lz4's default 64 KiB blocks' speed on KV, same ratio.
        packed = lz4.frame.compress(page, block_size=lz4.frame.BLOCKSIZE_MAX4MB, store_size=True)
        if len(packed) < len(page):
            return Codec.LZ4, packed
    return Codec.NONE, page


def decompress(codec: Codec, payload: Buffer, raw_length: int) -> Buffer:
    page: Buffer
    if codec is Codec.NONE:
        page = payload
    elif codec is Codec.LZ4:
        page = _lz4_bounded(payload, raw_length)
    else:
        raise ValueError(f"unknown codec {codec!r}")
    if len(page) != raw_length:
        raise ValueError(f"payload decodes to {len(page)} bytes, the header says {raw_length}")
    return page


def _lz4_bounded(payload: Buffer, raw_length: int) -> bytes:
    """The frame's content, refused unless it is exactly `raw_length` bytes; never more decoded."""
    try:  # python-lz4 reports a bad frame as RuntimeError
        declared = lz4.frame.get_frame_info(payload)["content_size"]  # 0: not declared
        if declared and declared != raw_length:
            raise ValueError(f"lz4 frame declares {declared} bytes, the header says {raw_length}")
        decompressor = lz4.frame.LZ4FrameDecompressor()
        page = decompressor.decompress(payload, max_length=raw_length)
    except RuntimeError as exc:
        raise ValueError(f"lz4 payload does not decode: {exc}") from None
    if not decompressor.eof:
        more = "more than" if not decompressor.needs_input else "fewer than"
        raise ValueError(f"lz4 payload decodes to {more} the {raw_length} bytes the header says")
    if decompressor.unused_data:
        raise ValueError(f"{len(decompressor.unused_data)} bytes follow the lz4 frame")
    return page
