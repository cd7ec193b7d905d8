"""Encoded images that probe the header checks of pipeline/data/encoded_images.py: PNGs declaring any size with a
few bytes of pixel data, chunks whose length field lies, a JPEG header declaring any size. `pipeline verify`, the
bench's hostile clients and the tests build their probes here, so a probe means the same everywhere.
"""

from __future__ import annotations

import struct
import zlib

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_chunk(kind: bytes, data: bytes, length: int | None = None) -> bytes:
    """A PNG chunk: length, type, data, CRC-32 of type and data (length: a field that lies about the data)."""
    return struct.pack(">I", len(data) if length is None else length) + kind + data + \
        struct.pack(">I", zlib.crc32(kind + data))


def png_header(width: int, height: int, color_type: int = 2) -> bytes:
    """A PNG's signature and IHDR chunk declaring width x height 8-bit pixels (color_type 2: RGB, 0: grey)."""
    return PNG_SIGNATURE + png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0))


def png_declaring(width: int, height: int, color_type: int = 2, rows: int | None = None, chunks: bytes = b"") -> bytes:
    """A PNG declaring width x height, then `chunks`, an IDAT of `rows` rows of zero pixels (all of them by default;
    a few make a bomb: a few hundred bytes declaring gigapixels), and IEND."""
    row = b"\0" + bytes(width * (3 if color_type == 2 else 1))  # the filter byte, then the samples
    pixels = zlib.compress(row * (height if rows is None else rows), 9)
    return png_header(width, height, color_type) + chunks + png_chunk(b"IDAT", pixels) + png_chunk(b"IEND", b"")


def jpeg_header(width: int, height: int) -> bytes:
    """A JPEG's start, a baseline frame header (SOF0, one component) declaring width x height, and its end."""
    frame = struct.pack(">BHHB", 8, height, width, 1) + bytes([1, 0x11, 0])
    return b"\xff\xd8" + b"\xff\xc0" + struct.pack(">H", len(frame) + 2) + frame + b"\xff\xd9"
