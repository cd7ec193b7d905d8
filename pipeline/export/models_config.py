"""TF Serving's models.config for exported models, so the real tensorflow_model_server can serve them.

Built with TF Serving's own ModelServerConfig proto and text format, so the file is valid by
construction; `python -m serving --model_config_file` reads the same file. Only exported models are
listed: at start-up TF Serving waits for every configured model to become available, by default
forever (tensorflow_serving/model_servers/server_core.cc, WaitUntilModelsAvailable;
servable_state_waiter_timeout in server_core.h), and `python -m serving` refuses to start, so a config
whose model has no version is refused, naming it, and no file is written.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from google.protobuf import text_format

from pipeline.config import Config, ConfigError
from pipeline.errors import ExportError
from serving.servable import saved_model


def models_config(configs: list[Config], container_base: str | None = None, sources: list[str] | None = None) -> str:
    """A text-format ModelServerConfig listing each experiment's exported model.

    Args:
        configs: one per model; export.model_name and export.base_path locate its versions.
        container_base: when the models directory is mounted into a container (e.g. "/models"),
            base paths become <container_base>/<model_name>; otherwise absolute host paths.
        sources: the configs' file names, for the error that names a model never exported.

    Raises:
        ConfigError: two configs share a model name.
        ExportError: a config's model has no exported version (a directory holding a SavedModel).
    """
    from tensorflow_serving.config import model_server_config_pb2

    names = [cfg.export.model_name for cfg in configs]
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice:
        raise ConfigError([f"export.model_name: '{twice}' is listed twice; TF Serving needs unique model names"])
    sources = sources or ["..."] * len(configs)
    missing = [f"{cfg.export.model_name} has no exported version under {cfg.model_base_path} (make export "
               f"CONFIG={source})" for cfg, source in zip(configs, sources)
               if not any(saved_model.has_saved_model(path)
                          for path in saved_model.version_dirs(cfg.model_base_path).values())]
    if missing:
        raise ExportError(f"{'; '.join(missing)}; TF Serving would wait for it forever at start-up; "
                          "nothing was written")
    server_config = model_server_config_pb2.ModelServerConfig()
    for cfg in configs:
        name = cfg.export.model_name
        model = server_config.model_config_list.config.add()
        model.name = name
        model.base_path = (str(PurePosixPath(container_base) / name) if container_base
                           else str(Path(cfg.model_base_path).resolve()))
        model.model_platform = "tensorflow"
    return text_format.MessageToString(server_config)
