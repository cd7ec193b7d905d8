"""Figure 10: image requests: a photograph's JPEG bytes (predict_images) against its float32 pixels
(serving_default), and hostile images sent while good clients run.

The model is trained and exported by the pipeline on an image folder written here: crops, flips and colour
shifts of scikit-learn's two sample photographs (china.jpg, flower.jpg), 224x224 JPEG files in one folder per
photograph, a small CNN (model.kind cnn), one epoch. The request image is each photograph cropped to a square,
resized to 224x224 by tf.image and re-encoded as JPEG (quality 90); its float32 request carries the same file
decoded by the model's own decode (pipeline/data/images.py decode_image), 224x224x3 values 0..255.

Three measurements, each against a yardstick taken in the same run:
1. Bytes on the wire: the serialized PredictRequest (request.ByteSize(), one image, built by
   serving/client/grpc_client.py) for predict_images against serving_default.
2. Images/s over gRPC: one `python -m serving` with batching on (figure 4's parameters and TensorFlow threads),
   32 single-image clients (figure 4's load generator), the two signatures alternating, which goes first
   alternating too; the ratio is the median of each round's. Each window lasts at least WINDOW_BATCHES times the
   slower signature's in-process batch time (below), so that a slow CPU counts whole batches in it. Beside it,
   in a fresh process with the servers' threads, Runner.predict at batch 32 of each signature and the header
   check + decode alone: where the time goes.
3. Hostile images: a second server (the same flags, fresh) serves good clients (32, predict_images) in clean
   windows, and between each two a window that lasts as long as bench/hostile_clients.py takes to send every
   hostile body of HOSTILE_KINDS once, one per request, from HOSTILE_CLIENTS connections. The good clients'
   latencies are those of every request sent in a window, however late the answer. Measured: the good clients'
   p99 under attack against the clean windows on either side, their slowest request and failed requests, the
   hostile calls' status codes per kind, the server's VmRSS sampled during the attacks and its VmHWM (growth over
   the readings after the first clean window), whether it is alive and answers afterwards, and tracebacks in its
   log.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import math
import pickle
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench import timing
from bench.machine import peak_rss_mib, rss_mib
from bench.server_processes import running_servers
from bench.serving_throughput import BATCHING, SERVER_THREADS, load, write_batching_parameters
from bench.workloads import Sizes, image_model_overrides
from pipeline.data.image_probes import png_chunk, png_declaring, png_header

TITLE = "Image requests: JPEG bytes (predict_images) vs float32 pixels (serving_default), and hostile images"
TARGET = ("request bytes <= 0.1x the float32 request's; gRPC images/s at 32 clients with batching >= 0.8x the float32 "
          "signature's; hostile images: 0 crashes, 0 INTERNAL/UNKNOWN, 0 tracebacks, server RSS growth < 50 MB, "
          "good clients' p99 <= 2x the clean run's")
COLUMNS = ["measure", "value", "yardstick", "ratio", "target", "target_met", "note"]
PHOTOGRAPHS = ("china.jpg", "flower.jpg")
IMAGE_SHAPE = (224, 224, 3)
JPEG_QUALITY = 90
IMAGES_SIGNATURE, IMAGES_INPUT = "predict_images", "image_bytes"  # pipeline/export/signatures.py
CLIENTS = 32
HOSTILE_CLIENTS = 4
IN_PROCESS_BATCH = 32
MAX_RSS_GROWTH_MIB = 50e6 / 2 ** 20  # the 50 MB
WINDOW_BATCHES = 8  # a load window lasts at least this many in-process batches of CLIENTS images
SAMPLE_EVERY_S = 0.02
HOSTILE_KINDS = {
    "decompression bomb": "PNG IHDR 40000x40000 (RGB, 60000x40000 gray) and JPEG SOF0/SOF2 65000x65000, each < 2 KB",
    "random bytes": "random lengths 1-4096; a third bare, a third after a JPEG SOI marker, a third after a valid "
                    "224x224 PNG signature and IHDR",
    "truncated JPEG": "the request photograph's JPEG cut at 16 points, from inside its headers to just before EOI",
    "huge PNG chunk length": "the photograph as PNG with an IHDR, IDAT or added tEXt length field of 2^31-1 or 2^32-1",
    "base64 text": "the photograph's JPEG (and the PNG bomb) as base64 text, and as base64 of base64",
}


def run(sizes: Sizes, work_dir: Path) -> dict:
    folder = work_dir / "image_requests"
    photos = {name: request_jpeg(name) for name in PHOTOGRAPHS}
    write_image_folder(folder / "train", sizes.image_files_per_class)
    model = _train_and_export(sizes, work_dir, folder / "train")
    pixels = {name: decode_pixels(jpeg) for name, jpeg in photos.items()}
    rows = [_bytes_row(name, model, photos[name], pixels[name]) for name in PHOTOGRAPHS]
    photo = PHOTOGRAPHS[0]
    requests = write_requests(model, photos[photo], pixels[photo], folder)
    hostile = hostile_requests(model, photos[photo], sizes.image_random_bodies, folder / "hostile.pickle")
    in_process = _in_process(model, folder / "photo.jpg")
    window_s = window_seconds(sizes.image_window_seconds, in_process)
    batching_file = write_batching_parameters(work_dir, BATCHING)
    flags = ["--model_name", model["model_name"], "--model_base_path", model["base_path"],
             "--file_system_poll_wait_seconds", "0", *SERVER_THREADS, "--enable_batching",
             "--batching_parameters_file", str(batching_file)]
    with running_servers([(flags, work_dir / f"server-images-{role}.log", False)
                          for role in ("throughput", "attack")]) as (server, attacked):
        throughput = _throughput(server, requests, sizes, window_s)
        attack = _attack(attacked, requests["images"], hostile, sizes, window_s)
    attack["log"] = _log_problems(attacked.log_path)
    rows += _throughput_rows(throughput, in_process) + _attack_rows(attack, hostile)
    return {"rows": rows, "notes": _notes(attack), "throughput": throughput, "in_process": in_process,
            "attack": attack, "batching_parameters": BATCHING,
            "setup": {"model": model["base_path"], "policy": model["policy"], "image_shape": list(IMAGE_SHAPE),
                      "jpeg_quality": JPEG_QUALITY, "training_files": 2 * sizes.image_files_per_class,
                      "clients": CLIENTS, "hostile_clients": HOSTILE_CLIENTS, "window_s": window_s,
                      "warmup_s": sizes.warmup_seconds, "rounds": sizes.image_rounds,
                      "attack_rounds": sizes.image_attack_rounds, "hostile_kinds": HOSTILE_KINDS,
                      "hostile_bodies": {kind: sum(k == kind for k, _ in hostile["bodies"]) for kind in HOSTILE_KINDS}}}


# --- the images -----------------------------------------------------------------------------------------------


def photograph(name: str) -> np.ndarray:
    """One of scikit-learn's sample photographs (427x640 RGB), read from the installed package's file."""
    import sklearn
    import tensorflow as tf

    path = Path(sklearn.__file__).parent / "datasets" / "images" / name
    return tf.io.decode_jpeg(path.read_bytes(), channels=3).numpy()


def request_jpeg(name: str) -> bytes:
    """The photograph's centre square resized to 224x224 (tf.image, antialiased), as JPEG at JPEG_QUALITY."""
    import tensorflow as tf

    image = photograph(name)
    side = min(image.shape[:2])
    top, left = (image.shape[0] - side) // 2, (image.shape[1] - side) // 2
    return _encode(tf.image.resize(image[top:top + side, left:left + side], IMAGE_SHAPE[:2], antialias=True))


def _encode(image) -> bytes:
    import tensorflow as tf

    pixels = tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)
    return tf.io.encode_jpeg(pixels, quality=JPEG_QUALITY).numpy()


def decode_pixels(jpeg: bytes) -> np.ndarray:
    """float32 [1, 224, 224, 3]: the file decoded as the model's training pipeline decodes it."""
    import tensorflow as tf

    from pipeline.data.images import decode_image

    return decode_image(tf.constant(jpeg), IMAGE_SHAPE).numpy()[None]


def write_image_folder(folder: Path, per_class: int) -> None:
    """data.source images: one class folder per photograph, `per_class` 224x224 JPEG files in each, random square
    crops (half to all of the short side) with a random flip, brightness and saturation."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    for name in PHOTOGRAPHS:
        image = photograph(name)
        height, width = image.shape[:2]
        (folder / name.split(".")[0]).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            side = int(min(height, width) * rng.uniform(0.5, 1.0))
            top, left = rng.integers(0, height - side + 1), rng.integers(0, width - side + 1)
            crop = tf.image.resize(image[top:top + side, left:left + side], IMAGE_SHAPE[:2], antialias=True)
            crop = tf.image.flip_left_right(crop) if rng.random() < 0.5 else crop
            crop = tf.image.adjust_saturation(tf.image.adjust_brightness(crop, rng.uniform(-20, 20)),
                                              rng.uniform(0.7, 1.3))
            (folder / name.split(".")[0] / f"{i:03d}.jpg").write_bytes(_encode(crop))


def _train_and_export(sizes: Sizes, work_dir: Path, folder: Path) -> dict:
    """pipeline.train then pipeline.export on the folder; the version's paths and names."""
    import keras

    from pipeline.config import load_config
    from pipeline.export import export
    from pipeline.train import train

    cfg = load_config(None, image_model_overrides(sizes, work_dir, folder))
    try:
        timing.progress(f"image_requests: training {cfg.experiment} on {2 * sizes.image_files_per_class} image "
                        f"files (policy {cfg.precision.policy})")
        run = train(cfg, fresh=True)
        timing.progress("image_requests: exporting (parity gate included)")
        version = export(cfg, force=True)
    finally:
        keras.config.set_dtype_policy("float32")
    return {"base_path": str(cfg.model_base_path), "version_path": str(version), "model_name": cfg.export.model_name,
            "input_name": cfg.data.input_name, "policy": run.policy.name}


# --- 1. bytes on the wire ----------------------------------------------------------------------------------------


def request_sizes(model_name: str, input_name: str, jpeg: bytes, pixels: np.ndarray) -> tuple[int, int]:
    """(predict_images request bytes, serving_default request bytes) for one image: PredictRequest.ByteSize()."""
    from serving.client.grpc_client import predict_request

    images = predict_request(model_name, {IMAGES_INPUT: np.array([jpeg], dtype=object)}, IMAGES_SIGNATURE)
    return images.ByteSize(), predict_request(model_name, {input_name: pixels}).ByteSize()


def _bytes_row(name: str, model: dict, jpeg: bytes, pixels: np.ndarray) -> dict:
    images, floats = request_sizes(model["model_name"], model["input_name"], jpeg, pixels)
    timing.progress(f"image_requests: {name}: {images:,} request bytes as JPEG, {floats:,} as float32 pixels")
    return {"measure": f"request bytes, {name} 224x224 (JPEG q{JPEG_QUALITY} vs float32 pixels)", "value": images,
            "yardstick": floats, "ratio": images / floats, "target": "<= 0.1", "target_met": images <= 0.1 * floats,
            "note": f"{floats / images:.0f}x smaller; the JPEG file alone {len(jpeg):,} bytes"}


# --- 2. images/s ----------------------------------------------------------------------------------------------------


def write_requests(model: dict, jpeg: bytes, pixels: np.ndarray, folder: Path) -> dict[str, Path]:
    """The two single-image PredictRequests, serialized once for the load generator."""
    from serving.client.grpc_client import predict_request

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "photo.jpg").write_bytes(jpeg)
    paths = {"images": folder / "request-images.pb", "pixels": folder / "request-pixels.pb"}
    paths["images"].write_bytes(predict_request(model["model_name"], {IMAGES_INPUT: np.array([jpeg], dtype=object)},
                                                IMAGES_SIGNATURE).SerializeToString())
    paths["pixels"].write_bytes(predict_request(model["model_name"], {model["input_name"]: pixels}).SerializeToString())
    return paths


def window_seconds(configured: float, in_process: dict) -> float:
    """The configured window, lengthened to WINDOW_BATCHES of the slower signature's in-process batch time: a
    window shorter than a batch's service time counts 0 or 1 batches (on a slow CPU, 0 images/s), not a rate."""
    batch_seconds = in_process["batch"] / min(in_process["images"], in_process["pixels"])
    return max(configured, WINDOW_BATCHES * batch_seconds)


def _throughput(server, requests: dict[str, Path], sizes: Sizes, window_s: float) -> dict:
    """Rounds of the two signatures at CLIENTS clients, one after the other, which goes first alternating."""
    window = dataclasses.replace(sizes, load_seconds=window_s)
    rounds = []
    for number in range(sizes.image_rounds):
        order = ("images", "pixels") if number % 2 == 0 else ("pixels", "images")
        measured = {side: load("grpc", server.grpc_address, requests[side], CLIENTS, window, "") for side in order}
        rounds.append(measured)
        timing.progress(f"image_requests: round {number + 1}: predict_images {measured['images']['qps']:.0f} images/s, "
                        f"serving_default {measured['pixels']['qps']:.0f} images/s at {CLIENTS} clients")
    return {"rounds": rounds, "ratio": timing.median([r["images"]["qps"] / r["pixels"]["qps"] for r in rounds]),
            **{side: {key: timing.median([r[side][key] for r in rounds]) for key in rounds[0][side]}
               for side in ("images", "pixels")}}


def _in_process(model: dict, jpeg_path: Path) -> dict:
    """Runner.predict at IN_PROCESS_BATCH in a fresh process with the servers' TensorFlow threads."""
    output = subprocess.run([sys.executable, "-m", "bench.image_requests", model["version_path"], str(jpeg_path),
                             model["input_name"], str(IN_PROCESS_BATCH), *SERVER_THREADS],
                            check=True, capture_output=True, text=True).stdout
    measured = json.loads(output.splitlines()[-1])
    timing.progress(f"image_requests: in-process at batch {IN_PROCESS_BATCH}: predict_images "
                    f"{measured['images']:.0f} images/s, serving_default {measured['pixels']:.0f}, decode alone "
                    f"{measured['decode']:.0f}")
    return measured


def _measure_in_process(version_path: str, jpeg: bytes, input_name: str, batch: int) -> dict:
    """Images/s of each signature at `batch` (the same image repeated), and of the header check + decode alone
    (pipeline/data/encoded_images.py decode_checked, as predict_images runs it)."""
    import tensorflow as tf

    from pipeline.data.encoded_images import decode_checked
    from serving.servable.runner import Runner

    runner = Runner.load(version_path)
    images = np.array([jpeg] * batch, dtype=object)
    limits = json.loads((Path(version_path) / "assets.extra" / "pipeline.json").read_text())[
        "signatures"][IMAGES_SIGNATURE]["inputs"][IMAGES_INPUT]
    decode = tf.function(lambda x: decode_checked(x, IMAGE_SHAPE, limits["min_image_side"],
                                                  limits["max_image_pixels"], IMAGES_INPUT))
    pixels = decode(tf.constant(images)).numpy()
    sides = {"images": lambda: runner.predict({IMAGES_INPUT: images}, IMAGES_SIGNATURE),
             "pixels": lambda: runner.predict({input_name: pixels}),
             "decode": lambda: decode(tf.constant(images)).numpy()}
    try:
        seconds: dict[str, list[float]] = {side: [] for side in sides}
        for function in sides.values():
            function()
        for _ in range(3):  # the three sides take turns
            for side, function in sides.items():
                seconds[side].append(timing.seconds_per_call(function, timing.calls_for(function, 0.3)))
    finally:
        runner.close()
    return {"batch": batch, **{side: batch / timing.median(times) for side, times in seconds.items()}}


def _throughput_rows(throughput: dict, in_process: dict) -> list[dict]:
    images, pixels, ratio = throughput["images"], throughput["pixels"], throughput["ratio"]
    batch = in_process["batch"]
    return [
        {"measure": f"gRPC images/s, {CLIENTS} clients, batching on: predict_images (decode in the server)",
         "value": images["qps"], "yardstick": pixels["qps"], "ratio": ratio, "target": ">= 0.8",
         "target_met": ratio >= 0.8, "note": f"p50/p99 {images['p50_ms']:.1f}/{images['p99_ms']:.1f} ms vs "
                                            f"{pixels['p50_ms']:.1f}/{pixels['p99_ms']:.1f} ms; errors "
                                            f"{images['errors']:.0f}/{pixels['errors']:.0f}"},
        {"measure": f"in-process images/s at batch {batch}: predict_images vs serving_default",
         "value": in_process["images"], "yardstick": in_process["pixels"],
         "ratio": in_process["images"] / in_process["pixels"], "target": None, "target_met": None,
         "note": f"header check + decode alone {in_process['decode']:,.0f} images/s"},
    ]


# --- 3. hostile images -----------------------------------------------------------------------------------------------


def hostile_requests(model: dict, jpeg: bytes, random_bodies: int, path: Path) -> dict:
    """Every hostile body as a serialized single-image predict_images request, shuffled, pickled for
    bench/hostile_clients.py as (kind, request bytes); returns the path and the (kind, body) pairs."""
    from serving.client.grpc_client import predict_request

    bodies = hostile_bodies(jpeg, random_bodies)
    order = np.random.default_rng(1).permutation(len(bodies))
    pairs = [(bodies[i][0], predict_request(model["model_name"], {IMAGES_INPUT: np.array([bodies[i][1]], dtype=object)},
                                            IMAGES_SIGNATURE).SerializeToString()) for i in order]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(pairs))
    return {"path": path, "bodies": bodies}


def hostile_bodies(jpeg: bytes, random_bodies: int) -> list[tuple[str, bytes]]:
    """(kind, image bytes) for every kind of HOSTILE_KINDS."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    png = tf.io.encode_png(tf.io.decode_jpeg(jpeg)).numpy()
    bombs = [png_declaring(40000, 40000, color_type=2, rows=4), png_declaring(60000, 40000, color_type=0, rows=4),
             jpeg_bomb(65000, 65000, marker=0xC0), jpeg_bomb(65000, 65000, marker=0xC2)]
    header = png_header(224, 224)
    random = []
    for i in range(random_bodies):
        body = rng.bytes(int(rng.integers(1, 4097)))
        random.append(body if i % 3 == 0 else (b"\xff\xd8\xff" if i % 3 == 1 else header) + body)
    truncated = [jpeg[:int(cut)] for cut in np.linspace(4, len(jpeg) - 2, 16)]
    huge = [png_with_length(png, chunk, length) for chunk in (b"IHDR", b"IDAT", b"tEXt")
            for length in (2 ** 31 - 1, 2 ** 32 - 1)]
    text = [base64.b64encode(jpeg), base64.b64encode(base64.b64encode(jpeg)), base64.b64encode(bombs[0]),
            base64.b64encode(base64.b64encode(bombs[0]))]
    return ([("decompression bomb", body) for body in bombs] + [("random bytes", body) for body in random]
            + [("truncated JPEG", body) for body in truncated] + [("huge PNG chunk length", body) for body in huge]
            + [("base64 text", body) for body in text])


def jpeg_bomb(width: int, height: int, marker: int = 0xC0) -> bytes:
    """A small real JPEG (16x16) whose start-of-frame segment declares height x width (marker 0xC0: SOF0
    baseline, 0xC2: SOF2 progressive)."""
    import tensorflow as tf

    small = bytearray(tf.io.encode_jpeg(tf.fill([16, 16, 3], tf.constant(128, tf.uint8))).numpy())
    at = small.index(b"\xff\xc0")
    small[at + 1] = marker
    small[at + 5:at + 9] = struct.pack(">HH", height, width)
    return bytes(small)


def png_with_length(png: bytes, kind: bytes, length: int) -> bytes:
    """The PNG with the length field of its first `kind` chunk set to `length` (tEXt: a chunk added before IDAT)."""
    if kind == b"tEXt":
        at = png.index(b"IDAT") - 4
        return png[:at] + png_chunk(b"tEXt", b"Comment\x00hello", length) + png[at:]
    at = png.index(kind) - 4
    return png[:at] + struct.pack(">I", length) + png[at + 4:]


def _attack(server, good_request: Path, hostile: dict, sizes: Sizes, window_s: float) -> dict:
    """Clean windows of CLIENTS good clients, and between each two a window that lasts one pass of the attacker over
    every hostile body; the server's memory around the attacks."""
    window = dataclasses.replace(sizes, load_seconds=window_s)
    pid = server.process.pid
    cleans = [load("grpc", server.grpc_address, good_request, CLIENTS, window, "", late_answers=True)]
    before = {"rss_mib": rss_mib(pid), "hwm_mib": peak_rss_mib(pid)}
    attacks, kinds, peaks = [], {}, []
    for number in range(sizes.image_attack_rounds):
        with _attacker(server.grpc_address, hostile["path"], pid) as attacker:
            attacked = load("grpc", server.grpc_address, good_request, CLIENTS, window, "", late_answers=True,
                            until=attacker.run_from)
        peaks.append(max(attacker.rss_samples, default=0.0))
        _merge(kinds, attacker.result["kinds"])
        attacks.append({**attacked, "attack_seconds": attacker.result["seconds"],
                        "hostile_sent": sum(entry["sent"] for entry in attacker.result["kinds"].values())})
        cleans.append(load("grpc", server.grpc_address, good_request, CLIENTS, window, "", late_answers=True))
        timing.progress(f"image_requests: attack {number + 1}: good p99 {attacked['p99_ms']:.1f} ms (slowest "
                        f"{attacked['max_ms']:.0f} ms, {attacked['errors']} failed), clean before/after "
                        f"{cleans[-2]['p99_ms']:.1f}/{cleans[-1]['p99_ms']:.1f} ms; {attacks[-1]['hostile_sent']:,} "
                        f"hostile calls in {attacks[-1]['attack_seconds']:.1f} s")
    alive = server.process.poll() is None
    answers = alive and load("grpc", server.grpc_address, good_request, 1, dataclasses.replace(
        sizes, load_seconds=0.3, warmup_seconds=0.0), "")["errors"] == 0
    after = {"rss_mib": rss_mib(pid), "hwm_mib": peak_rss_mib(pid)}
    # Each attack against the clean windows on either side of it.
    yardsticks = [(earlier["p99_ms"] + later["p99_ms"]) / 2 for earlier, later in zip(cleans, cleans[1:])]
    return {"attacks": attacks, "cleans": cleans, "kinds": kinds, "before": before, "after": after, "alive": alive,
            "answers": answers, "sampled_peak_rss_mib": max(peaks),
            "rss_growth_mib": max(max(peaks) - before["rss_mib"], (after["hwm_mib"] or 0) - (before["hwm_mib"] or 0)),
            "p99_ratio": _median_ratio([(a["p99_ms"], clean) for a, clean in zip(attacks, yardsticks)])}


def _merge(kinds: dict, found: dict) -> None:
    """Adds one attack's per-kind counts (bench/hostile_clients.py) to the totals."""
    for kind, entry in found.items():
        merged = kinds.setdefault(kind, {"sent": 0, "codes": {}, "messages": {}, "slowest_ms": 0.0})
        merged["sent"] += entry["sent"]
        for code, count in entry["codes"].items():
            merged["codes"][code] = merged["codes"].get(code, 0) + count
        merged["messages"] = {**entry["messages"], **merged["messages"]}
        merged["slowest_ms"] = max(merged["slowest_ms"], entry["slowest_ms"])


def _median_ratio(pairs: list[tuple[float, float]]) -> float | None:
    """The median of value / yardstick over rounds; None if a round has no finite pair (no request was sent and
    answered in one of its windows)."""
    ratios = [value / yardstick for value, yardstick in pairs if math.isfinite(value) and math.isfinite(yardstick)
              and yardstick > 0]
    return timing.median(ratios) if len(ratios) == len(pairs) else None


class _Attacker:
    """A started, ready bench/hostile_clients.py process; run_from(start) runs its one pass."""

    def __init__(self, address: str, requests_file: Path, server_pid: int) -> None:
        spec = {"address": address, "requests_file": str(requests_file), "threads": HOSTILE_CLIENTS}
        self.process = subprocess.Popen([sys.executable, "-m", "bench.hostile_clients", json.dumps(spec)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.server_pid, self.result, self.rss_samples = server_pid, {}, []
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"hostile client did not start (exit {self.process.wait()})")

    def run_from(self, start: float) -> float:
        """Sends every hostile request once from `start` on (the good clients' window) while sampling the server's
        VmRSS; returns when the last is answered, with that time (the window's end)."""
        self.process.stdin.write(f"{start}\n")
        self.process.stdin.flush()
        with _sampled_rss(self.server_pid) as samples:
            self.result = json.loads(self.process.stdout.readline())
        self.rss_samples = samples
        return time.time()


@contextlib.contextmanager
def _attacker(address: str, requests_file: Path, server_pid: int):
    attacker = _Attacker(address, requests_file, server_pid)
    try:
        yield attacker
    finally:
        if attacker.process.poll() is None and not attacker.result:
            attacker.process.kill()
        attacker.process.wait()


@contextlib.contextmanager
def _sampled_rss(pid: int):
    """VmRSS of the process every SAMPLE_EVERY_S while the block runs, into the yielded list."""
    samples: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_EVERY_S):
            value = rss_mib(pid)
            if value is not None:
                samples.append(value)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join()


def _log_problems(log_path: Path) -> dict:
    """Tracebacks and fatal lines in the server's log (stderr and stdout)."""
    text = "".join(path.read_text(errors="replace") for path in (log_path, log_path.with_name(log_path.name + ".stdout"))
                   if path.exists())
    fatal = [line for line in text.splitlines() if line.startswith(("F0", "Fatal Python error", "Segmentation fault"))]
    return {"tracebacks": text.count("Traceback (most recent call last)"), "fatal_lines": len(fatal),
            "first_fatal": fatal[0] if fatal else None, "path": str(log_path)}


def _attack_rows(attack: dict, hostile: dict) -> list[dict]:
    attacks, cleans = attack["attacks"], attack["cleans"]
    clean = timing.median([c["p99_ms"] for c in cleans])
    failed = sum(window["errors"] for window in attacks + cleans)
    seconds = sum(a["attack_seconds"] for a in attacks)
    rows = [
        {"measure": f"good clients' p99 latency under attack ({CLIENTS} good, {HOSTILE_CLIENTS} hostile clients) (ms)",
         "value": timing.median([a["p99_ms"] for a in attacks]), "yardstick": clean, "ratio": attack["p99_ratio"],
         "target": "<= 2", "target_met": attack["p99_ratio"] is not None and attack["p99_ratio"] <= 2,
         "note": f"slowest {max(a['max_ms'] for a in attacks):,.0f} ms vs {max(c['max_ms'] for c in cleans):,.0f} "
                 f"clean; p50 {timing.median([a['p50_ms'] for a in attacks]):.1f} vs "
                 f"{timing.median([c['p50_ms'] for c in cleans]):.1f} ms; good images/s "
                 f"{timing.median([a['qps'] for a in attacks]):,.0f} vs {timing.median([c['qps'] for c in cleans]):,.0f}"
                 + ("" if attack["p99_ratio"] is not None else "; a window in which no good request was sent (all "
                                                               "stalled from the warm-up on)")},
        {"measure": "good clients' failed requests (clean and attacked windows)", "value": failed, "yardstick": None,
         "ratio": None, "target": "0", "target_met": failed == 0, "note": None},
        {"measure": "server RSS growth during the attacks (MiB)", "value": attack["rss_growth_mib"],
         "yardstick": attack["before"]["rss_mib"], "ratio": None, "target": "< 50 MB (47.7 MiB)",
         "target_met": attack["rss_growth_mib"] < MAX_RSS_GROWTH_MIB,
         "note": f"VmRSS {attack['before']['rss_mib']} MiB before, peak sampled {attack['sampled_peak_rss_mib']}, "
                 f"{attack['after']['rss_mib']} after; VmHWM {attack['before']['hwm_mib']} -> "
                 f"{attack['after']['hwm_mib']} MiB"},
        {"measure": "server crashes; tracebacks and fatal lines in its log", "value": attack["log"]["tracebacks"],
         "yardstick": None, "ratio": None, "target": "0 crashes, 0 tracebacks",
         "target_met": attack["alive"] and attack["answers"] and attack["log"]["tracebacks"] == 0
         and attack["log"]["fatal_lines"] == 0,
         "note": f"alive {'yes' if attack['alive'] else 'NO'}, answers {'yes' if attack['answers'] else 'NO'}, "
                 f"{attack['log']['fatal_lines']} fatal lines; the attack{'s' if len(attacks) > 1 else ''} took "
                 f"{seconds:.0f} s ({sum(a['hostile_sent'] for a in attacks) / seconds:.0f} hostile calls/s)"},
    ]
    distinct = {kind: sum(k == kind for k, _ in hostile["bodies"]) for kind in HOSTILE_KINDS}
    for kind in HOSTILE_KINDS:
        entry = attack["kinds"].get(kind, {"sent": 0, "codes": {}, "slowest_ms": 0.0})
        bad = sum(entry["codes"].get(code, 0) for code in ("INTERNAL", "UNKNOWN"))
        rows.append({"measure": f"hostile: {kind} ({distinct[kind]:,} bodies) - calls sent", "value": entry["sent"],
                     "yardstick": None, "ratio": None, "target": "0 INTERNAL/UNKNOWN",
                     "target_met": bad == 0 and entry["sent"] >= distinct[kind],
                     "note": ", ".join(f"{code} {count:,}" for code, count in sorted(entry["codes"].items()))
                     + f"; slowest {entry['slowest_ms']:.1f} ms"})
    return rows


def _notes(attack: dict) -> list[str]:
    """What each hostile kind is, and the first message the server answered per kind and status code."""
    notes = ["hostile kinds: " + "; ".join(f"{kind}: {what}" for kind, what in HOSTILE_KINDS.items())]
    for kind, entry in attack["kinds"].items():
        for code, message in sorted(entry["messages"].items()):
            notes.append(f"{kind}, {code}, e.g.: {message or '(an answer)'}")
    return notes


def plot(figure: dict, ax) -> None:
    rows = [row for row in figure["rows"] if row["ratio"] is not None]
    ax.barh([row["measure"][:48] for row in rows], [row["ratio"] for row in rows],
            color=["tab:green" if row["target_met"] or row["target_met"] is None else "tab:red" for row in rows])
    ax.set_xscale("log")
    ax.set_xlabel("ratio to the yardstick (log)")
    ax.set_title("10. image requests", fontsize=9)


if __name__ == "__main__":  # python -m bench.image_requests VERSION_PATH JPEG INPUT BATCH [server thread flags]
    import argparse

    parser = argparse.ArgumentParser()
    for name in ("version_path", "jpeg", "input_name"):
        parser.add_argument(name)
    parser.add_argument("batch", type=int)
    parser.add_argument("--tensorflow_intra_op_parallelism", type=int, default=0)
    parser.add_argument("--tensorflow_inter_op_parallelism", type=int, default=0)
    arguments = parser.parse_args()
    from serving import tf_log

    tf_log.quiet_tensorflow("2")
    import tensorflow as tf

    if arguments.tensorflow_intra_op_parallelism:
        tf.config.threading.set_intra_op_parallelism_threads(arguments.tensorflow_intra_op_parallelism)
    if arguments.tensorflow_inter_op_parallelism:
        tf.config.threading.set_inter_op_parallelism_threads(arguments.tensorflow_inter_op_parallelism)
    print(json.dumps(_measure_in_process(arguments.version_path, Path(arguments.jpeg).read_bytes(),
                                         arguments.input_name, arguments.batch)))
