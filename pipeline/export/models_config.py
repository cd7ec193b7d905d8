"""TF Serving's models.config for exported models, so the real tensorflow_model_server can serve them.

Built with TF Serving's own ModelServerConfig proto and text format, so the file is valid by
construction; `python -m serving --model_config_file` reads the same file.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from google.protobuf import text_format

from pipeline.config import Config, ConfigError


def models_config(configs: list[Config], container_base: str | None = None) -> str:
    """A text-format ModelServerConfig listing each experiment's exported model.

    Args:
        configs: one per model; export.model_name and export.base_path locate its versions.
        container_base: when the models directory is mounted into a container (e.g. "/models"),
            base paths become <container_base>/<model_name>; otherwise absolute host paths.
    """
    from tensorflow_serving.config import model_server_config_pb2

    server_config = model_server_config_pb2.ModelServerConfig()
    seen: set[str] = set()
    for cfg in configs:
        name = cfg.export.model_name
        if name in seen:
            raise ConfigError([f"export.model_name: '{name}' is listed twice; TF Serving needs unique model names"])
        seen.add(name)
        model = server_config.model_config_list.config.add()
        model.name = name
        model.base_path = (str(PurePosixPath(container_base) / name) if container_base
                           else str(Path(cfg.model_base_path).resolve()))
        model.model_platform = "tensorflow"
    return text_format.MessageToString(server_config)
