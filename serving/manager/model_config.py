"""ModelServerConfig: read it, check it as TF Serving does, and pick the version directories a model serves.

Rules and wording are TF Serving's (tensorflow_serving/model_servers/server.cc, server_core.cc and
sources/storage_path/file_system_storage_path_source.cc):

- a file that does not parse as a text ModelServerConfig: "Invalid protobuf file: '<path>'" (util/proto_util.h)
  with the parser's "Error parsing text-format tensorflow.serving.ModelServerConfig: LINE:COLUMN: ..."
- each model name once, an absolute base_path, model_platform "tensorflow", and in a reload no model
  changing its platform ("Illegal to change a model's platform"; INVALID_ARGUMENT)
- logging_config (the request log, serving/request_log.py): type "tfrecord" or none, a filename_prefix
  in an existing directory, a sampling_rate from 0 to 1 (INVALID_ARGUMENT)
- version policy: `latest {num_versions: N}` (the default; N at least 1), `all {}`, `specific {versions: ...}`;
  version directories as serving/servable/saved_model.py reads them ("00000123" is version 123); other
  directories under a base path are ignored (odd_version_names lists them, for a warning)

Version labels are checked by the model manager: they depend on which versions are loaded. Nothing
here imports TensorFlow, so `python -m serving` refuses a bad config before paying for that import.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from serving.servable import saved_model
from serving.limits import check_model_name

TENSORFLOW_PLATFORM = "tensorflow"  # the only platform TF Serving's model server registers
# Request log collectors (serving/request_log.py): "" too, as a logging_config naming no type gets the only one.
LOG_COLLECTOR_TYPES = ("", "tfrecord")


class ModelConfigError(Exception):
    """A config TF Serving would refuse, or one that could not be applied; `code` is its gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


def read_model_config(path: str | os.PathLike) -> model_server_config_pb2.ModelServerConfig:
    """Parses a text-format ModelServerConfig file (--model_config_file); ModelConfigError if it cannot."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        code = grpc.StatusCode.NOT_FOUND if isinstance(error, FileNotFoundError) else grpc.StatusCode.UNKNOWN
        raise ModelConfigError(f"{path}: {error.strerror or error}", code) from None
    config = model_server_config_pb2.ModelServerConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as error:
        # TF Serving's ParseProtoTextFile (util/proto_util.h) answers "Invalid protobuf file: '<path>'" after
        # protobuf's C++ parser logged "Error parsing text-format <type>: LINE:COLUMN: <what>"; one line with both.
        where = f"{error.GetLine()}:{error.GetColumn()}: " if error.GetLine() is not None else ""
        what = str(error).split(" : ", 1)[-1]  # Python's ParseError reads "LINE:COLUMN : <what>"
        raise ModelConfigError(f"Invalid protobuf file: '{path}': Error parsing text-format "
                               f"{config.DESCRIPTOR.full_name}: {where}{what}") from None
    return config


def single_model_config(model_name: str,
                        model_base_path: str | os.PathLike) -> model_server_config_pb2.ModelServerConfig:
    """The config --model_name/--model_base_path stand for (TF Serving's BuildSingleModelConfig): latest version.

    Unlike TF Serving, a relative base path is taken relative to the working directory.
    """
    config = model_server_config_pb2.ModelServerConfig()
    config.model_config_list.config.add(name=model_name, base_path=os.path.abspath(model_base_path),
                                        model_platform=TENSORFLOW_PLATFORM)
    return config


def validate_model_config(config: model_server_config_pb2.ModelServerConfig,
                          previous: model_server_config_pb2.ModelServerConfig | None = None) -> None:
    """Raises ModelConfigError (INVALID_ARGUMENT) for what TF Serving's ServerCore::ReloadConfig refuses,
    in its order; previous is the config being replaced (a model may not change its platform).

    An empty config (neither model_config_list nor custom_model_config) is valid: TF Serving takes no action.
    """
    which = config.WhichOneof("config")
    if which is None:
        return
    if which != "model_config_list":
        raise ModelConfigError("ModelServer does not yet support custom model config.")
    names: set[str] = set()
    for model in config.model_config_list.config:
        try:
            check_model_name(model.name)  # names become file names (request logs) and metric labels
        except ValueError as error:
            raise ModelConfigError(str(error)) from None
        if model.name in names:
            raise ModelConfigError(f"Illegal to list model {model.name} multiple times in config list")
        names.add(model.name)
    for model in config.model_config_list.config:
        if "://" not in model.base_path and not os.path.isabs(model.base_path):
            raise ModelConfigError(f"Expected model {model.name} to have an absolute path or URI; "
                                   f"got base_path()={model.base_path}")
    if previous is not None and previous.WhichOneof("config") == "model_config_list":
        _check_no_platform_changes(previous, config)
    for model in config.model_config_list.config:
        platform = _platform(model)
        if platform != TENSORFLOW_PLATFORM:
            raise ModelConfigError(f"Model {model.name} requests unsupported platform {platform}")
    for model in config.model_config_list.config:
        problem = logging_config_problem(model)
        if problem:
            raise ModelConfigError(problem)


def _check_no_platform_changes(previous: model_server_config_pb2.ModelServerConfig,
                               config: model_server_config_pb2.ModelServerConfig) -> None:
    """server_core.cc's ValidateNoModelsChangePlatforms: a model that stays keeps its platform."""
    old_platforms = {model.name: _platform(model) for model in previous.model_config_list.config}
    for model in config.model_config_list.config:
        old, new = old_platforms.get(model.name), _platform(model)
        if old is not None and new != old:
            raise ModelConfigError(f"Illegal to change a model's platform. For model {model.name} platform was "
                                   f"{old} and new platform requested is {new}")


def logging_config_problem(model: model_server_config_pb2.ModelConfig) -> str | None:
    """Why a model's logging_config cannot be used, in one line (None: usable, or no logging_config)."""
    if not model.HasField("logging_config"):
        return None
    config = model.logging_config
    where = f"model {model.name}: logging_config"
    if config.HasField("custom_logging_config"):
        return f"{where}.custom_logging_config is not supported; use log_collector_config"
    collector = config.log_collector_config
    if collector.type not in LOG_COLLECTOR_TYPES:
        return (f"{where}: Cannot find LogCollector::Factory for type: {collector.type}; this server has "
                "\"tfrecord\" (PredictionLog records in TFRecord files)")
    if not collector.filename_prefix:
        return f"{where}.log_collector_config.filename_prefix is empty; give a path prefix, e.g. \"/var/log/requests\""
    directory = Path(collector.filename_prefix).parent
    if not directory.is_dir():
        return f"{where}.log_collector_config.filename_prefix: directory {directory} does not exist"
    rate = config.sampling_config.sampling_rate
    if not 0.0 <= rate <= 1.0:
        return f"{where}.sampling_config.sampling_rate must be between 0 and 1, got {rate:g}"
    return None


def version_dirs(model: model_server_config_pb2.ModelConfig) -> dict[int, Path]:
    """Every version directory under a model's base path: {version: path}, whatever the policy.

    Raises:
        ModelConfigError: NOT_FOUND if the base path does not exist, UNKNOWN if it cannot be read.
    """
    if not Path(model.base_path).is_dir():
        raise ModelConfigError(f"Could not find base path {model.base_path} for servable {model.name}",
                               grpc.StatusCode.NOT_FOUND)
    try:
        return saved_model.version_dirs(model.base_path)
    except OSError as error:
        raise ModelConfigError(f"{model.base_path}: {error.strerror or error}", grpc.StatusCode.UNKNOWN) from None


def odd_version_names(model: model_server_config_pb2.ModelConfig) -> list[str]:
    """Directories under a model's base path that are not versions ("²", "1e3", "99999999999999999999"),
    for a warning; hidden ones ('.tmp-…' exports being written) are left out. [] if it cannot be listed."""
    try:
        children = sorted(Path(model.base_path).iterdir())
    except OSError:
        return []
    return [child.name for child in children if not child.name.startswith(".")
            and saved_model.parse_version(child.name) is None and child.is_dir()]


def aspired_versions(model: model_server_config_pb2.ModelConfig, on_disk: dict[int, Path]) -> dict[int, Path]:
    """The versions a model's version policy selects among those on disk."""
    policy = model.model_version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return dict(on_disk)
    if choice == "specific":
        wanted = set(policy.specific.versions)
        return {version: path for version, path in on_disk.items() if version in wanted}
    newest = sorted(on_disk)[-max(policy.latest.num_versions, 1):]  # no policy at all means latest 1
    return {version: on_disk[version] for version in newest}


def no_versions_message(model: model_server_config_pb2.ModelConfig, on_disk: dict[int, Path]) -> str:
    """Why a model has nothing to serve: no version directories, or none its policy selects."""
    base = model.base_path
    if not on_disk:
        return f"{base}: no numeric version directories (expected e.g. {base}/1/saved_model.pb)"
    found = ", ".join(str(version) for version in sorted(on_disk))
    return (f"No versions of servable {model.name} found under base path {base} for its version policy "
            f"({describe_policy(model)}); found versions {found}")


def check_versions_exist(config: model_server_config_pb2.ModelServerConfig) -> None:
    """At start-up: every model must have a version to load (TF Serving would wait for one forever)."""
    for model in config.model_config_list.config:
        on_disk = version_dirs(model)
        if not aspired_versions(model, on_disk):
            raise ModelConfigError(no_versions_message(model, on_disk), grpc.StatusCode.NOT_FOUND)


def describe_policy(model: model_server_config_pb2.ModelConfig) -> str:
    """'latest 1', 'all', 'specific 123, 124': a version policy in a log line."""
    policy = model.model_version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return "all"
    if choice == "specific":
        return "specific " + ", ".join(str(version) for version in policy.specific.versions)
    return f"latest {max(policy.latest.num_versions, 1)}"


def _platform(model: model_server_config_pb2.ModelConfig) -> str:
    """model_platform, or the deprecated model_type it replaces (server_core.cc GetPlatform)."""
    if model.model_type != model_server_config_pb2.MODEL_TYPE_UNSPECIFIED:
        if model.model_platform:
            raise ModelConfigError("Illegal setting both ModelServerConfig::model_type (deprecated) "
                                   "and ModelServerConfig::model_platform.")
        if model.model_type != model_server_config_pb2.TENSORFLOW:
            raise ModelConfigError(f"ModelServerConfig::model_type choice {model.model_type} not supported.")
        return TENSORFLOW_PLATFORM
    if not model.model_platform:
        raise ModelConfigError("Illegal setting neither ModelServerConfig::model_type (deprecated) "
                               f"nor ModelServerConfig::model_platform, model name is {model.name}")
    return model.model_platform
