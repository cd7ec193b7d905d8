"""Clients' encoded images: the declared size read from the header, the limits checked before any pixel is decoded."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from pipeline.data import encoded_images
from pipeline.data.encoded_images import (DAMAGED_CHUNKS, DAMAGED_HEADER, DAMAGED_JPEG, DAMAGED_PNG, EMPTY, JPEG,
                                          NOT_AN_IMAGE, OK, PNG, TOO_LARGE, TOO_SMALL, UNKNOWN)
from pipeline.data.image_probes import png_declaring
from pipeline.data.images import decode_image

PHOTO = (Path(__import__("sklearn").__file__).parent / "datasets" / "images" / "china.jpg").read_bytes()  # 640x427


def png(width: int, height: int, chunks: bytes = b"", rows: int | None = None) -> bytes:
    return png_declaring(width, height, rows=rows, chunks=chunks)


def jpeg(width: int, height: int, channels: int = 3, **options) -> bytes:
    return tf.io.encode_jpeg(tf.zeros([height, width, channels], tf.uint8), **options).numpy()


def declaring(contents: bytes, width: int, height: int) -> bytes:
    """A JPEG whose frame header (SOF0) is rewritten to declare width x height."""
    at = contents.index(b"\xff\xc0")
    return contents[:at + 5] + struct.pack(">HH", height, width) + contents[at + 9:]


def headers(*images: bytes) -> list[tuple[int, int, int]]:
    kind, height, width = encoded_images.image_headers(tf.constant(list(images)))
    return list(zip(kind.numpy().tolist(), height.numpy().tolist(), width.numpy().tolist()))


def test_the_header_gives_format_and_size_without_decoding():
    gif = b"GIF89a\x10\x00\x10\x00" + b"\0" * 20
    assert headers(PHOTO, png(7, 5), jpeg(33, 17), jpeg(33, 17, progressive=True), jpeg(9, 4, channels=1),
                   gif, b"", b"\xff\xd8\xff") == [
        (JPEG, 427, 640), (PNG, 5, 7), (JPEG, 17, 33), (JPEG, 17, 33), (JPEG, 4, 9), (UNKNOWN, 0, 0),
        (UNKNOWN, 0, 0), (DAMAGED_JPEG, 0, 0)]


def test_the_checked_decode_is_decode_image():
    checked = encoded_images.decode_checked(tf.constant([PHOTO, png(20, 10)]), (24, 32, 3), 8, 10 ** 6, "image_bytes")
    np.testing.assert_array_equal(checked[0], decode_image(tf.constant(PHOTO), (24, 32, 3)))
    np.testing.assert_array_equal(checked[1], decode_image(tf.constant(png(20, 10)), (24, 32, 3)))


BOMB_PNG = png(40_000, 40_000, rows=1)  # 1.6 Gpixel declared
BOMB_JPEG = declaring(jpeg(16, 16), 65_000, 65_000)
HOSTILE = {
    "a PNG declaring 1.6 Gpixel": (BOMB_PNG, TOO_LARGE, "40000x40000 pixels, more than the 1000000"),
    "a JPEG declaring 4.2 Gpixel": (BOMB_JPEG, TOO_LARGE, "65000x65000 pixels, more than the 1000000"),
    "a 1x1 image": (png(1, 1), TOO_SMALL, "1x1 pixels: a side shorter than 8"),
    "text": (b"not an image at all", NOT_AN_IMAGE, "not a JPEG or PNG image"),
    "an image as base64 text": (base64.b64encode(PHOTO), NOT_AN_IMAGE, "not a JPEG or PNG image"),
    "base64 of base64": (base64.b64encode(base64.b64encode(PHOTO)), NOT_AN_IMAGE, "not a JPEG or PNG image"),
    "nothing": (b"", EMPTY, "empty; send the bytes of a JPEG or PNG file"),
    "a JPEG cut in its header": (PHOTO[:150], DAMAGED_HEADER, "a JPEG whose frame header is damaged"),
    "a JPEG of fill bytes": (b"\xff\xd8" + b"\xff" * 100_000, DAMAGED_HEADER, "a JPEG whose frame header is damaged"),
    "a JPEG segment longer than the file": (b"\xff\xd8\xff\xe0\xff\xf0" + b"\0" * 40, DAMAGED_HEADER, "damaged"),
}


@pytest.mark.parametrize("attack", HOSTILE)
def test_hostile_images_are_refused_before_decoding_naming_row_and_reason(attack):
    contents, reason, words = HOSTILE[attack]
    assert len(BOMB_PNG) < 2048 and len(BOMB_JPEG) < 2048
    refused = encoded_images.refusals(tf.constant([PHOTO, contents]), 8, 10 ** 6)[0].numpy().tolist()
    assert refused == [OK, reason]
    decode = tf.function(lambda images: encoded_images.decode_checked(images, (8, 8, 3), 8, 10 ** 6, "image_bytes"))
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"image_bytes\[1\]: .*{words}"):
        decode(tf.constant([PHOTO, contents]))


def test_a_png_chunk_running_past_the_end_of_the_file_is_refused_before_the_decoder_allocates_it():
    """TensorFlow's PNG decoder allocates a text chunk's declared length first: a 141-byte PNG whose tEXt chunk
    claims 2 GiB cost 2 GiB and 0.9 s before it was refused (found by bench figure 10)."""
    huge = struct.pack(">I", 0x7FFFFFF0) + b"tEXt" + b"x" * 64
    damaged = [png(16, 16, chunks=huge), png(16, 16)[:-12] + huge + png(16, 16)[-12:], png(16, 16)[:-20],
               png(16, 16)[:-12]]  # before IDAT, after it, cut in IDAT, without IEND
    assert [kind for kind, _, _ in headers(*damaged)] == [DAMAGED_PNG] * 4
    assert headers(png(16, 16) + b"trailing bytes after IEND") == [(PNG, 16, 16)]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"image_bytes\[0\]: a PNG whose chunks run past the end"):
        encoded_images.decode_checked(tf.constant(damaged[:1]), (8, 8, 3), 8, 10 ** 6, "image_bytes")
    assert encoded_images.refusals(tf.constant(damaged), 8, 10 ** 6)[0].numpy().tolist() == [DAMAGED_CHUNKS] * 4


def test_a_jpeg_damaged_past_its_header_fails_the_decode_as_invalid_argument():
    with pytest.raises(tf.errors.InvalidArgumentError, match="Invalid JPEG data"):
        encoded_images.decode_checked(tf.constant([PHOTO[:len(PHOTO) // 2]]), (8, 8, 3), 8, 10 ** 6, "image_bytes")


def test_random_bytes_never_pass_as_an_image():
    bodies = [np.random.default_rng(seed).bytes(int(size)) for seed, size in
              enumerate(np.random.default_rng(0).integers(0, 4096, 2000))]
    reasons = encoded_images.refusals(tf.constant(bodies), 8, 10 ** 6)[0].numpy()
    assert OK not in reasons.tolist()
