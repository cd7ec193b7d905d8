"""What is on disk for a served model: version directories, the SavedModel's MetaGraph, pipeline.json.

One implementation of TF Serving's version-directory rule, used by the model manager, the runner and
the pipeline's export (tensorflow_serving/sources/storage_path/file_system_storage_path_source.cc):
a version is a child directory of the base path whose name is a plain decimal number that fits in
int64 ("00000123" is version 123; "²", "1e3" and "99999999999999999999" are not versions). A '.tmp-…'
directory (an export being written) is therefore never seen half-written, and a version symlinked
from outside the base path is not served.

Also here: what a version's graph computes in (MatMul/Conv ops by dtype) and stores its weights in
(the variables' bytes by dtype), and the rules that check both against the policy recorded in
assets.extra/pipeline.json, the metadata the pipeline writes and the runner, the server and
`pipeline verify` read.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from serving.errors import LoadError, SavedModelNotFound

PIPELINE_JSON = Path("assets.extra") / "pipeline.json"
SERVING_TAG = "serve"  # TF Serving's default --saved_model_tags
DEFAULT_SIGNATURE = "serving_default"
REDUCED_DTYPES = ("float16", "bfloat16")
# Ops whose dtype says what precision the model really computes in.
COMPUTE_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "Conv2D", "Conv3D", "DepthwiseConv2dNative"})
_INT64_MAX = 2 ** 63 - 1


def parse_version(name: str) -> int | None:
    """The version a directory name stands for, or None: plain ASCII digits that fit in int64."""
    if not (name.isascii() and name.isdigit()):
        return None
    version = int(name)
    return version if version <= _INT64_MAX else None


def version_dirs(base_path: str | os.PathLike) -> dict[int, Path]:
    """Every version directory under a model's base path: {version: path}; {} when there is no such directory.

    A version symlinked from outside the base path is left out (is_inside resolves links). Two names
    for one version ("7" and "007") keep the first in sorted order.

    Raises:
        OSError: the base path exists but cannot be listed.
    """
    root = Path(base_path)
    if not root.is_dir():
        return {}
    found: dict[int, Path] = {}
    for child in sorted(root.iterdir()):
        version = parse_version(child.name)
        if version is not None and version not in found and child.is_dir() and is_inside(root, child):
            found[version] = child
    return found


def list_versions(base_path: str | os.PathLike) -> list[int]:
    """The versions under a model's base path, ascending."""
    return sorted(version_dirs(base_path))


def latest_version_dir(base_path: str | os.PathLike) -> Path:
    """The highest version under a base path; FileNotFoundError names the path when there is none."""
    found = version_dirs(base_path)
    if not found:
        raise FileNotFoundError(f"{base_path}: no numeric version directories (expected e.g. {base_path}/1/saved_model.pb)")
    return found[max(found)]


def is_inside(base_path: str | os.PathLike, path: str | os.PathLike) -> bool:
    """Whether path, with symlinks resolved, lies inside base_path (resolved too)."""
    base = Path(base_path).resolve()
    target = Path(path).resolve()
    return target == base or base in target.parents


def has_saved_model(path: Path) -> bool:
    return (path / "saved_model.pb").is_file() or (path / "saved_model.pbtxt").is_file()


def version_path(path: Path) -> Path:
    """path itself if it holds a SavedModel, else its latest version (which must hold one).

    Raises:
        SavedModelNotFound: neither holds a SavedModel.
    """
    if not has_saved_model(path) and (list_versions(path) or parse_version(path.name) is None):
        try:
            path = latest_version_dir(path)
        except FileNotFoundError as error:
            raise SavedModelNotFound(str(error)) from None
    if not has_saved_model(path):
        hint = ""
        if (path / "export.meta").is_file():
            hint = "; it holds a legacy SessionBundle export (export.meta), which TF Serving no longer loads"
        raise SavedModelNotFound(f"{path}: could not find SavedModel .pb or .pbtxt (saved_model.pb or "
                                 f"saved_model.pbtxt){hint}")
    return path


def is_tf1(meta_graph) -> bool:
    """TF1 SavedModels (SavedModelBuilder) have no object graph; tf.saved_model.save always writes one."""
    return not meta_graph.object_graph_def.nodes


def read_pipeline_json(version_path: str | os.PathLike) -> dict[str, Any] | None:
    """The pipeline's metadata of an exported version, or None for a model the pipeline did not write.

    Raises:
        LoadError: the file is there but is not a JSON object (damaged, or half copied), in one line.
    """
    path = Path(version_path) / PIPELINE_JSON
    if not path.is_file():
        return None
    try:
        metadata = json.loads(path.read_bytes())
    except (ValueError, OSError) as error:  # JSONDecodeError, UnicodeDecodeError, a read that failed
        raise LoadError(f"{path}: not a readable JSON file ({error}); re-export the version, or remove the "
                        "file to serve it as a foreign model") from None
    if not isinstance(metadata, dict):
        raise LoadError(f"{path}: expected a JSON object, got {type(metadata).__name__}")
    return metadata


# pipeline.json's list of the Python modules that register ops a version's graph needs beyond core TensorFlow,
# imported before it loads. Only these are known: a module name from a file is never imported blindly.
OP_LIBRARIES = "op_libraries"
KNOWN_OP_LIBRARIES = {"tensorflow_text": "tensorflow-text"}  # module → the package that installs it


def load_op_libraries(metadata: Mapping[str, Any] | None, version_path: str | os.PathLike) -> None:
    """Imports the op libraries pipeline.json says the version needs (a sentencepiece language model: TF Text's
    ops), so that its graph loads.

    Raises:
        LoadError: one the server does not know, or one that is not installed, naming the package to install.
    """
    for name in (metadata or {}).get(OP_LIBRARIES) or ():
        package = KNOWN_OP_LIBRARIES.get(name)
        if package is None:
            raise LoadError(f"{Path(version_path) / PIPELINE_JSON}: op_libraries names {name!r}, which this server "
                            f"does not load (it knows {', '.join(sorted(KNOWN_OP_LIBRARIES))})")
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise LoadError(f"{version_path}: its graph needs the ops of {package} ({name}), which is not installed "
                            f"here ({error}); pip install {package} (the release matching TensorFlow's), or install "
                            "this project with its text extra") from None


def serving_policy(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The policy a version's serving graph computes under: pipeline.json's serving_policy, or (exports
    from before export.serving_policy existed) the training policy, which was then always the serving one."""
    metadata = metadata or {}
    return metadata.get("serving_policy") or metadata.get("policy") or {}


def serving_meta_graph(version_path: Path):
    """The MetaGraph tagged 'serve' (the first one if none is), as TF Serving picks it."""
    from google.protobuf import text_format
    from tensorflow.core.protobuf import saved_model_pb2

    saved_model = saved_model_pb2.SavedModel()
    binary = version_path / "saved_model.pb"
    if binary.is_file():
        saved_model.ParseFromString(binary.read_bytes())
    else:
        text_format.Parse((version_path / "saved_model.pbtxt").read_text(), saved_model)
    graphs = [g for g in saved_model.meta_graphs if SERVING_TAG in g.meta_info_def.tags] or list(saved_model.meta_graphs)
    if not graphs:
        raise LoadError(f"{version_path}: the SavedModel has no MetaGraph")
    return graphs[0]


def copy_signature_defs(meta_graph) -> dict[str, Any]:
    """The MetaGraph's SignatureDefs, copied so that the (large) MetaGraph can be dropped."""
    from tensorflow.core.protobuf import meta_graph_pb2

    signature_defs = {}
    for name, signature in meta_graph.signature_def.items():
        signature_defs[name] = meta_graph_pb2.SignatureDef()
        signature_defs[name].CopyFrom(signature)
    return signature_defs


def read_signature_defs(version_path: str | os.PathLike) -> dict[str, Any]:
    """The SignatureDefs of the 'serve' MetaGraph, as TF Serving reports them in GetModelMetadata."""
    return copy_signature_defs(serving_meta_graph(Path(version_path)))


def count_ops(graph_def) -> dict[str, int]:
    """MatMul/BatchMatMul/Conv ops by dtype in a GraphDef and its function library, e.g. {"float16": 3}.

    Keras layers run inside nested functions, so the library must be searched too.
    """
    import tensorflow as tf

    library_nodes = (node for function in graph_def.library.function for node in function.node_def)
    counts = Counter(tf.as_dtype(node.attr["T"].type).name
                     for node in itertools.chain(graph_def.node, library_nodes)
                     if node.op in COMPUTE_OPS and "T" in node.attr)
    return dict(counts)


def count_compute_ops(concrete_fn: Any) -> dict[str, int]:
    """count_ops over a concrete function's graph (a TF2 signature)."""
    return count_ops(concrete_fn.graph.as_graph_def())


def describe_ops(ops: Mapping[str, int]) -> str:
    """'float16 x3, float32 x1': compute ops by dtype in a log line."""
    return ", ".join(f"{dtype} x{count}" for dtype, count in sorted(ops.items())) or "none"


def policy_problem(policy: Mapping[str, Any], compute_ops: Mapping[str, int]) -> str | None:
    """Why a graph does not compute under the policy recorded for it, in one line; None when it does.

    The graph's MatMul/Conv ops must use the policy's compute dtype, and a float32 policy must have no
    reduced-precision ones: this catches an export that lost its policy (a float32 graph labelled
    mixed_float16) or the reverse. A graph without such ops cannot be checked and passes.
    """
    return _contradiction(policy, "computes in", policy.get("compute_dtype"), compute_ops, describe_ops(compute_ops),
                          "the serving graph", "MatMul/Conv ops")


def weights_by_dtype(version_path: str | os.PathLike) -> dict[str, int]:
    """Bytes of a version's floating-point variables by dtype, read from its checkpoint's index
    (variables/variables.index), e.g. {"bfloat16": 3727360, "float32": 6272}; {} without variables."""
    import numpy as np
    import tensorflow as tf

    prefix = Path(version_path) / "variables" / "variables"
    if not prefix.with_suffix(".index").is_file():
        return {}
    reader = tf.train.load_checkpoint(str(prefix))
    shapes = reader.get_variable_to_shape_map()
    counts: Counter[str] = Counter()
    for name, dtype in reader.get_variable_to_dtype_map().items():
        if dtype.is_floating:
            counts[dtype.name] += int(np.prod(shapes[name], dtype=np.int64)) * dtype.size
    return dict(counts)


def describe_bytes(by_dtype: Mapping[str, int]) -> str:
    """'bfloat16 3.73 MB, float32 6.3 kB': weights by dtype in a log line, largest first."""
    def size(n: int) -> str:
        return next(f"{n / scale:.3g} {unit}" for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B"))
                    if n >= scale or unit == "B")

    return ", ".join(f"{dtype} {size(n)}" for dtype, n in sorted(by_dtype.items(), key=lambda item: -item[1])) or "none"


def weights_problem(policy: Mapping[str, Any], weights: Mapping[str, int]) -> str | None:
    """Why a version's stored weights contradict the variable dtype recorded for its serving policy; None if they
    do not.

    The recorded dtype must hold weights (float16/bfloat16 policies keep float32 ones only in the layers pinned to
    float32, such as the standardisation), and a float32 one must have no float16 or bfloat16 weights: this
    catches a full-size export labelled bfloat16 or the reverse. A version without variables passes.
    """
    return _contradiction(policy, "stores its weights in", policy.get("variable_dtype"), weights,
                          describe_bytes(weights), "the version", "variables")


def _contradiction(policy: Mapping[str, Any], does: str, dtype: str | None, by_dtype: Mapping[str, int], found: str,
                   subject: str, items: str) -> str | None:
    """The rule policy_problem and weights_problem share: the recorded dtype must be among `by_dtype`, and a float32
    record must have no float16 or bfloat16 there; nothing to judge without a dtype or without items."""
    if not dtype or not by_dtype:
        return None
    if not by_dtype.get(dtype):
        return f"pipeline.json says policy '{policy.get('name')}' {does} {dtype}, but {subject}'s {items} are {found}"
    if dtype == "float32" and any(by_dtype.get(reduced) for reduced in REDUCED_DTYPES):
        return (f"pipeline.json says policy '{policy.get('name')}' {does} float32, but {subject} has "
                f"reduced-precision {items}: {found}")
    return None
