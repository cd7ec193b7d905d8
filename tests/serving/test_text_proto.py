"""serving/text_proto.py: the one reader of the config text protos TF Serving's pip package has no classes for."""

from __future__ import annotations

import pytest
from google.protobuf import wrappers_pb2

from serving import text_proto
from serving.batching.parameters import BatchingConfigError, read_batching_parameters
from serving.monitoring import MonitoringConfigError, read_monitoring_config
from serving.tls import SslConfigError, read_ssl_config

Config = text_proto.message_class(
    "tests/config.proto", "test.Config",
    {"Inner": [("flag", 1, "bool")],
     "Config": [("name", 1, "string"), ("sizes", 2, "repeated int64"), ("limit", 3, ".google.protobuf.Int64Value"),
                ("inner", 4, ".test.Inner")]},
    dependencies=[wrappers_pb2.DESCRIPTOR])


class ConfigError(ValueError):
    pass


def test_message_class_builds_every_field_kind(tmp_path):
    path = tmp_path / "config.txt"
    path.write_text('name: "m" sizes: 1 sizes: 2 limit { value: 7 } inner { flag: true }')
    config = text_proto.read_text_proto(path, Config, ConfigError)
    assert (config.name, list(config.sizes), config.limit.value, config.inner.flag) == ("m", [1, 2], 7, True)
    assert not Config().HasField("limit")


def test_read_errors_name_the_flag_and_the_file(tmp_path):
    with pytest.raises(ConfigError, match=f"^cannot read --config_file {tmp_path / 'missing'}: No such file"):
        text_proto.read_text_proto(tmp_path / "missing", Config, ConfigError, what="--config_file")
    with pytest.raises(ConfigError, match=f"^cannot read {tmp_path}: Is a directory$"):
        text_proto.read_text_proto(tmp_path, Config, ConfigError)
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="^cannot read .*binary: not a text file$"):
        text_proto.read_text_proto(binary, Config, ConfigError)


def test_parse_errors_name_the_source_and_add_the_hint():
    with pytest.raises(ConfigError, match=r'^src: 1:1 : .*has no field named "nme"\. \(expected name\)$'):
        text_proto.parse_text_proto("nme: 'x'", Config, ConfigError, "src", hint="expected name")


@pytest.mark.parametrize("read, error, flag", [
    (read_batching_parameters, BatchingConfigError, "--batching_parameters_file "),
    (read_monitoring_config, MonitoringConfigError, "--monitoring_config_file "),
    (read_ssl_config, SslConfigError, ""),  # the CLI puts "--ssl_config_file: " in front
])
def test_config_modules_share_the_reader_wording(tmp_path, read, error, flag):
    with pytest.raises(error, match=f"^cannot read {flag}{tmp_path / 'missing'}: No such file or directory$"):
        read(tmp_path / "missing")
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(error, match=f"^cannot read {flag}{binary}: not a text file$"):
        read(binary)
    unknown = tmp_path / "unknown"
    unknown.write_text("no_such_field: 1")
    with pytest.raises(error, match=f'^{unknown}: 1:1 : .*has no field named "no_such_field"'):
        read(unknown)
