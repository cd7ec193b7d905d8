"""Encoded images from clients: each one's format and declared size read from its header, checked against the
export's limits, and only then decoded by decode_image (pipeline/data/images.py), the training pipeline's decode.

A few KB of JPEG or PNG can declare gigapixels (TensorFlow's own decoders allow up to 512 MiB per JPEG and more
per PNG), so the size a header declares is checked before any pixel is decoded, for every row of the request,
and a refusal names the row and the reason (docs/serving.md, "Sending images"). Graph ops only, vectorised over
the batch, so the stock tensorflow_model_server runs the same checks.
"""

from __future__ import annotations

import tensorflow as tf

from pipeline.data.images import decode_image

SERVED_ENCODINGS = "JPEG or PNG"
# A JPEG's frame header (SOF) comes after its tables; past this many segments the header is called damaged,
# so a body of fill bytes costs a bounded loop.
MAX_JPEG_SEGMENTS = 256
# A PNG's chunks are walked to IEND, each checked to lie within the file: TensorFlow's PNG decoder allocates a
# text chunk's declared length before reading it (2 GiB and 0.9 s for a 141-byte file). A step costs ~17 us;
# a 4 Mpixel RGBA image in libpng's 8 KiB IDAT chunks has ~2,000 chunks; past this many the file is refused.
MAX_PNG_CHUNKS = 8192
_HEAD_BYTES = 24
_PNG_SIGNATURE = (0x89, 0x50, 0x4E, 0x47, 0x0D, 0x0A, 0x1A, 0x0A)
_IHDR = (0x49, 0x48, 0x44, 0x52)
_IEND = (0x49, 0x45, 0x4E, 0x44)
# Start-of-frame markers (ITU T.81 table B.1): C0-CF except DHT (C4), JPG (C8) and DAC (CC).
_SOF_MARKERS = tuple(m for m in range(0xC0, 0xD0) if m not in (0xC4, 0xC8, 0xCC))
# What image_headers finds; why refusals() refuses a row (its message is decode_checked's texts[reason]).
UNKNOWN, JPEG, PNG, DAMAGED_JPEG, DAMAGED_PNG = range(5)
EMPTY, NOT_AN_IMAGE, DAMAGED_HEADER, DAMAGED_CHUNKS, TOO_SMALL, TOO_LARGE, OK = range(7)
REFUSAL_NAMES = {EMPTY: "empty", NOT_AN_IMAGE: "not_an_image", DAMAGED_HEADER: "damaged_header",
                 DAMAGED_CHUNKS: "damaged_header", TOO_SMALL: "too_small",
                 TOO_LARGE: "too_large"}  # a refused image's kind, where a report counts them (pipeline score)


def image_headers(images: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(format, height, width) of each encoded image in a [n] string tensor, from its header alone.

    format: JPEG, PNG, DAMAGED_JPEG (a JPEG's first bytes, but no frame header within the file or the first
    MAX_JPEG_SEGMENTS segments), DAMAGED_PNG (a PNG header, but a chunk running past the end of the file or no
    IEND within MAX_PNG_CHUNKS chunks) or UNKNOWN (any other bytes); height and width: int64, 0 where not found.
    """
    head = _bytes_at(images, tf.zeros_like(tf.strings.length(images)), _HEAD_BYTES)
    png = tf.reduce_all(tf.equal(head[:, :8], _PNG_SIGNATURE), axis=1) & \
        tf.reduce_all(tf.equal(head[:, 12:16], _IHDR), axis=1)
    png_width, png_height = _big_endian(head[:, 16:20]), _big_endian(head[:, 20:24])
    jpeg_start = tf.equal(head[:, 0], 0xFF) & tf.equal(head[:, 1], 0xD8) & tf.equal(head[:, 2], 0xFF)
    jpeg, jpeg_height, jpeg_width = _jpeg_frames(images, jpeg_start)
    kind = tf.where(png, tf.where(_png_chunks_fit(images, png), PNG, DAMAGED_PNG),
                    tf.where(jpeg, JPEG, tf.where(jpeg_start, DAMAGED_JPEG, UNKNOWN)))
    height = tf.where(png, png_height, tf.where(jpeg, jpeg_height, tf.zeros_like(png_height)))
    width = tf.where(png, png_width, tf.where(jpeg, jpeg_width, tf.zeros_like(png_width)))
    return kind, height, width


def refusals(images: tf.Tensor, min_side: int, max_pixels: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(reason [n] int32, height, width): OK, or why each row is refused (EMPTY, NOT_AN_IMAGE, DAMAGED_HEADER,
    DAMAGED_CHUNKS, TOO_SMALL, TOO_LARGE)."""
    kind, height, width = image_headers(images)
    reason = tf.fill(tf.shape(kind), OK)
    reason = tf.where(tf.equal(kind, DAMAGED_PNG), DAMAGED_CHUNKS, reason)  # its IHDR's size still counts, below
    reason = tf.where(tf.minimum(height, width) < min_side, TOO_SMALL, reason)
    reason = tf.where(height * width > max_pixels, TOO_LARGE, reason)
    reason = tf.where(tf.equal(kind, DAMAGED_JPEG), DAMAGED_HEADER, reason)
    reason = tf.where(tf.equal(kind, UNKNOWN), NOT_AN_IMAGE, reason)
    reason = tf.where(tf.equal(tf.strings.length(images), 0), EMPTY, reason)
    return reason, height, width


def decode_checked(images: tf.Tensor, image_shape: tuple[int, int, int], min_side: int, max_pixels: int,
                   name: str) -> tf.Tensor:
    """[n] encoded images → float32 [n, height, width, channels] by decode_image, after every row's header passed
    the limits; else INVALID_ARGUMENT naming the first refused row, e.g. "image_bytes[3]: 20000x20000 pixels ...".
    Rows decode one at a time, so a request holds one image's pixels at full size at once."""
    reason, height, width = refusals(images, min_side, max_pixels)
    passed = tf.reduce_all(tf.equal(reason, OK))

    def refuse() -> tf.Tensor:
        row = tf.cast(tf.where(tf.not_equal(reason, OK))[0, 0], tf.int32)
        h, w = tf.gather(height, row), tf.gather(width, row)
        at = f"{name}[{{}}]: "
        texts = [
            tf.strings.format(at + f"empty; send the bytes of a {SERVED_ENCODINGS} file", (row,)),
            tf.strings.format(at + f"not a {SERVED_ENCODINGS} image (its first bytes match neither format)",
                              (row,)),
            tf.strings.format(at + "a JPEG whose frame header is damaged, truncated or missing", (row,)),
            tf.strings.format(at + "a PNG whose chunks run past the end of the file (damaged or truncated) or "
                              f"number more than {MAX_PNG_CHUNKS}", (row,)),
            tf.strings.format(at + "{}x{} pixels: a side shorter than " + f"{min_side}, the smallest this model takes",
                              (row, w, h)),
            tf.strings.format(at + "{}x{} pixels, more than the " + f"{max_pixels} this model decodes "
                              "(export.max_image_pixels); resize it before sending", (row, w, h)),
        ]
        with tf.control_dependencies([tf.debugging.Assert(passed, [tf.gather(tf.stack(texts), tf.gather(reason, row))],
                                                          name="image_limits")]):
            return tf.identity(passed)

    checked = tf.cond(passed, lambda: passed, refuse)
    with tf.control_dependencies([checked]):
        images = tf.identity(images)
    height_out, width_out, channels = image_shape
    return tf.map_fn(lambda contents: decode_image(contents, image_shape), images, parallel_iterations=1,
                     fn_output_signature=tf.TensorSpec([height_out, width_out, channels], tf.float32))


def _bytes_at(images: tf.Tensor, positions: tf.Tensor, count: int) -> tf.Tensor:
    """[n, count] int64: count bytes of each image from its position on, 0 past its end (only that slice is copied)."""
    lengths = tf.strings.length(images)
    start = tf.minimum(positions, lengths)
    piece = tf.strings.substr(images, start, tf.fill(tf.shape(start), count))
    padded = tf.strings.substr(tf.strings.join([piece, tf.fill(tf.shape(piece), "\0" * count)]), 0, count)
    values = tf.reshape(tf.io.decode_raw(padded, tf.uint8), [-1, count])
    values.set_shape(images.shape.concatenate([count]))
    return tf.cast(values, tf.int64)


def _big_endian(columns: tf.Tensor) -> tf.Tensor:
    value = tf.zeros_like(columns[:, 0])
    for i in range(columns.shape[1]):
        value = value * 256 + columns[:, i]
    return value


def _png_chunks_fit(images: tf.Tensor, started: tf.Tensor) -> tf.Tensor:
    """Whether each PNG's chunks, walked from its signature to IEND (all rows at once, at most MAX_PNG_CHUNKS
    steps), each lie within the file (length, type, data and CRC)."""
    lengths = tf.cast(tf.strings.length(images), tf.int64)
    n = tf.shape(lengths)

    def step(i, position, active, sound):
        chunk = _bytes_at(images, tf.cast(position, tf.int32), 8)
        end = position + 12 + _big_endian(chunk[:, :4])
        fits = end <= lengths
        last = tf.reduce_all(tf.equal(chunk[:, 4:8], _IEND), axis=1)
        sound = sound | (active & fits & last)
        active = active & fits & ~last
        return i + 1, tf.where(active, end, position), active, sound

    _, _, _, sound = tf.while_loop(lambda i, position, active, sound: (i < MAX_PNG_CHUNKS) & tf.reduce_any(active),
                                   step, (tf.constant(0), tf.fill(n, tf.constant(8, tf.int64)), started,
                                          tf.zeros(n, tf.bool)))
    return sound


def _jpeg_frames(images: tf.Tensor, started: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(found, height, width): walks each JPEG's marker segments from byte 2 to its start-of-frame header, all rows
    at once, at most MAX_JPEG_SEGMENTS steps; a row without one (data before the frame, a segment past the end)
    is not found."""
    lengths = tf.cast(tf.strings.length(images), tf.int64)
    n = tf.shape(lengths)
    sof = tf.constant(_SOF_MARKERS, tf.int64)

    def step(i, position, active, found, height, width):
        segment = _bytes_at(images, tf.cast(position, tf.int32), 9)
        marker = segment[:, 1]
        valid = tf.equal(segment[:, 0], 0xFF) & (position + 4 <= lengths)
        fill = valid & tf.equal(marker, 0xFF)  # fill bytes before a marker
        frame = valid & tf.reduce_any(tf.equal(marker[:, None], sof[None, :]), axis=1) & (position + 9 <= lengths)
        length = segment[:, 2] * 256 + segment[:, 3]
        skip = valid & ~fill & ~frame & (length >= 2) & ~tf.equal(marker, 0xDA) & ~tf.equal(marker, 0xD9) \
            & ~tf.equal(marker, 0xD8)
        found = found | (active & frame)
        height = tf.where(active & frame, segment[:, 5] * 256 + segment[:, 6], height)
        width = tf.where(active & frame, segment[:, 7] * 256 + segment[:, 8], width)
        position = tf.where(active & fill, position + 1, tf.where(active & skip, position + 2 + length, position))
        active = active & (fill | skip) & (position < lengths)
        return i + 1, position, active, found, height, width

    zeros = tf.zeros(n, tf.int64)
    _, _, _, found, height, width = tf.while_loop(
        lambda i, position, active, *_: (i < MAX_JPEG_SEGMENTS) & tf.reduce_any(active),
        step, (tf.constant(0), zeros + 2, started, tf.zeros(n, tf.bool), zeros, zeros))
    return found, height, width
