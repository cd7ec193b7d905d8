"""verify on a model trained on an image folder: predict_images answers serving_default's bits on the training
decode of real files, and refuses hostile bytes before decoding them."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from pipeline import artifacts, cli, verify as verify_module
from pipeline.data.image_probes import png_chunk, png_header
from pipeline.data.shards import ShardSource
from pipeline.verify import verify
from serving.servable import saved_model

pytestmark = pytest.mark.timeout(240)


def statuses(report) -> dict[str, str]:
    return {check.name: check.status for check in report.checks}


def detail(report, name: str) -> str:
    return next(check.detail for check in report.checks if check.name == name)


def test_an_image_model_passes_the_image_checks(image_model, capsys):
    assert cli.main(["verify", str(image_model.base_path)]) == 0
    out = capsys.readouterr().out
    assert "PASS  images " in out and "PASS  hostile images " in out, out
    report = verify(image_model.version_dir)
    assert statuses(report)["signature predict_images"] == "PASS" and report.ok
    assert detail(report, "images") == (
        f"{verify_module.PROBE_IMAGES} validation image files through predict_images vs serving_default on the "
        "training pipeline's decode of the same files (one batch each): the same bits (logits, probabilities)")
    limits = saved_model.read_pipeline_json(image_model.version_dir)["signatures"]["predict_images"]["inputs"]
    side = int(np.sqrt(limits["image_bytes"]["max_image_pixels"])) + 1
    assert detail(report, "hostile images") == (
        f"refused INVALID_ARGUMENT: bytes that are no image, a PNG header declaring {side}x{side} pixels, a JPEG "
        f"header declaring {side}x{side} pixels (max_image_pixels {limits['image_bytes']['max_image_pixels']:,})")


def test_without_the_training_data_images_skip_and_hostile_inputs_are_still_refused(image_model, tmp_path):
    version = tmp_path / image_model.model_name / "1"
    shutil.copytree(image_model.version_dir, version)
    metadata = saved_model.read_pipeline_json(version)
    config = {**metadata["config"], "data": {**metadata["config"]["data"], "path": str(tmp_path / "gone")}}
    artifacts.write_json_atomic(version / saved_model.PIPELINE_JSON,
                                {**metadata, "config": config, "run_dir": str(tmp_path / "no-run")})
    report = verify(version)
    found = statuses(report)
    assert found["images"] == "SKIP" and found["hostile images"] == "PASS" and report.ok
    assert detail(report, "images").startswith("the training data cannot be loaded here: DataError")


def test_answers_that_differ_from_the_training_decode_fail_the_images_check(image_model, monkeypatch):
    encoded_rows = ShardSource.encoded_rows

    def shifted(self, limit):  # as if the graph decoded the files to other pixels than training did
        files, rows, labels = encoded_rows(self, limit)
        return files, rows + 16, labels

    monkeypatch.setattr(ShardSource, "encoded_rows", shifted)
    report = verify(image_model.version_dir)
    assert statuses(report)["images"] == "FAIL" and not report.ok
    assert "the graph's decode is not the training pipeline's" in detail(report, "images")
    assert "probabilities max abs diff" in detail(report, "images")


def test_hostile_bytes_answered_or_refused_by_the_decode_fail(image_model, monkeypatch):
    real = next(image_model.folder.rglob("*.png")).read_bytes()
    no_pixels = png_header(16, 16, color_type=0) + png_chunk(b"IEND", b"")  # within the limits, nothing to decode

    monkeypatch.setattr(verify_module, "_hostile_images", lambda max_pixels: [
        ("a real image", real, ""), ("a 16x16 header without pixels", no_pixels, "99x99")])
    report = verify(image_model.version_dir)
    assert statuses(report)["hostile images"] == "FAIL"
    found = detail(report, "hostile images")
    assert found.startswith("a real image: answered, not refused; a 16x16 header without pixels: refused, but not "
                            "by its header ("), found
