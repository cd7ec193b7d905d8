"""The exported model figures 3 to 5 load and serve: trained and exported once per bench run by the
pipeline itself (`pipeline.train.train`, then `pipeline.export.export`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from bench import timing
from bench.workloads import Sizes, exported_model_overrides, serving_model_overrides

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"


@dataclasses.dataclass(frozen=True)
class ExportedModel:
    base_path: Path  # <export.base_path>/<model_name>: numeric versions under it
    model_name: str
    input_name: str
    rows: Any  # float32 validation rows (a numpy array); requests are cut from them
    policy: str


_cache: dict[tuple[Path, str], ExportedModel] = {}


def exported_model(sizes: Sizes, work_dir: Path, versions: int = 1, kind: str = "digits") -> ExportedModel:
    """Trains a model once per run, and exports until `versions` versions exist.

    kind "digits": configs/default.yaml with small overrides (figures 3 and 5). kind "guide": the
    mixed-precision guide's MLP (784 -> 1024 -> 1024 -> 10 under mixed_float16, synthetic rows; figure 4
    and the peers), the model the serving targets were set on.
    """
    import keras

    from pipeline import artifacts
    from pipeline.config import load_config
    from pipeline.export import export
    from pipeline.train import train
    from serving.servable import saved_model

    overrides = exported_model_overrides(sizes, work_dir) if kind == "digits" else serving_model_overrides(sizes, work_dir)
    cfg = load_config(DEFAULT_CONFIG, overrides)
    try:
        if (work_dir, kind) not in _cache:
            timing.progress(f"exported model: training {cfg.experiment} (policy {cfg.precision.policy})")
            run = train(cfg, fresh=True)
            _cache[work_dir, kind] = ExportedModel(cfg.model_base_path, cfg.export.model_name, cfg.data.input_name,
                                             run.datasets.validation_rows()[0], run.policy.name)
        while len(saved_model.list_versions(cfg.model_base_path)) < versions:
            timing.progress(f"exported model: exporting version {artifacts.next_version(cfg.model_base_path)}")
            export(cfg, force=True)  # versions of the same weights: the server tests need several
    finally:
        keras.config.set_dtype_policy("float32")
    return _cache[work_dir, kind]
