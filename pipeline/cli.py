"""`python -m pipeline {train,export,predict,serve,demo,config,diagnose,compare} CONFIG [--set key=value ...]`;
`verify MODEL_DIR`; `score MODEL_DIR --input PATTERN --output DIR`; `audit MODEL_DIR --log PATTERN`;
`models-config CONFIG...`; `deploy CONFIG... --output DIR`; `data-service {dispatcher,worker}`;
`convert INPUT... --output DIR` (Parquet → TFRecord shards); `example-data [DIR]`.

Each subcommand parses arguments and calls one function. The config is validated before TensorFlow
is imported, so a bad key costs one line, exit code 2 and nothing written. The verbs' modules are
imported inside their cmd_* functions on purpose: that is what keeps `--help` and config errors fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pipeline.config import Config, ConfigError, load_config
from pipeline.errors import DataError, DeployError, PipelineError
from serving.errors import RunnerError
from serving.client.process import ServerStartError


class ArgumentError(Exception):
    """A command-line argument that names nothing usable, e.g. a MODEL_DIR without a SavedModel (exit 2)."""


EXIT_BAD_INPUT = 2
# Known failures print one line; anything else keeps its traceback. The first matching class wins.
EXIT_CODES = ((ConfigError, EXIT_BAD_INPUT), (DataError, EXIT_BAD_INPUT), (ArgumentError, EXIT_BAD_INPUT),
              (DeployError, EXIT_BAD_INPUT),
              (PipelineError, 1), (RunnerError, 1), (ServerStartError, 1))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("tensorflow", "absl"):  # e.g. "Assets written to: <temporary dir>" on every export
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        cfg = load_config(args.config, args.overrides) if hasattr(args, "config") else None  # verify takes a MODEL_DIR
        return args.command(cfg, args) or 0
    except Exception as e:
        code = next((code for kind, code in EXIT_CODES if isinstance(e, kind)), None)
        if code is None:
            raise
        print(e if isinstance(e, ConfigError) else f"error: {e}", file=sys.stderr)
        return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, func, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("config", help="experiment YAML, e.g. configs/default.yaml")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set train.epochs=3 (repeatable)")
        p.set_defaults(command=func)
        return p

    p = command("train", cmd_train, "train the experiment under its precision policy → runs/<experiment>/ "
                "(resumes the run from its newest checkpoint)")
    p.add_argument("--fresh", action="store_true",
                   help="discard the run's checkpoints and outputs and start over instead of resuming")
    p = command("export", cmd_export, "export the trained run as <base_path>/<model_name>/<version>/ (nothing "
                "when the newest version already holds the same weights and config)")
    p.add_argument("--force", action="store_true",
                   help="publish a new version even when the newest one holds the same weights and config")
    p = command("predict", cmd_predict, "send validation rows to the model and report accuracy")
    p.add_argument("--local", action="store_true", help="run the exported model in-process instead of over gRPC")
    p.add_argument("--server", help="gRPC address (default serving.host:serving.port)")
    command("serve", cmd_serve, "serve the exported model over gRPC (python -m serving)")
    command("demo", cmd_demo, "train, export, serve, predict over gRPC, stop: the whole path once")
    command("config", cmd_config, "print the fully resolved config as YAML")
    p = command("diagnose", cmd_diagnose, "dtype audit of the configured model (trained run if any, else built "
                "untrained): per-layer dtypes, float16 risks, Tensor Core sizes, float16 range probes of activations and gradients on real batches")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("--batches", type=_non_negative_int, default=4, metavar="N",
                   help="batches for the range probes: validation batches for activations, training batches for "
                        "gradients (0: no probe)")
    p = command("compare", cmd_compare, "train under float32 and the config's mixed policy (each in its own process, "
                "same seed, data order and steps) and write runs/<experiment>/compare/: report.md, report.json, "
                "plots, numeric diagnosis; exit 0 when every policy trained, 1 when one failed, 2 on bad input")
    p.add_argument("--bfloat16", action="store_true", help="also train under mixed_bfloat16")
    p.add_argument("--tolerance", type=_non_negative, metavar="T",
                   help="the verdict's tolerance: accuracy points (classification) or percent of float32's "
                        "MAE (regression; default 1.0 for both) or val_nats_per_byte (language model; default 2.0)")
    p.add_argument("--batches", type=_non_negative_int, default=4, metavar="N",
                   help="training/validation batches for the diagnosis's range and gradient probes (default 4)")
    p = sub.add_parser("verify", help="audit an exported model: signature dtypes, MatMul/Conv dtypes, policy, parity",
                       description="audit an exported version (or the latest under a model base path): signature "
                                   "dtypes, MatMul/Conv compute dtypes, recorded policy vs graph, parity with the "
                                   "training run; exit 1 if any check fails")
    p.add_argument("model_dir", help="a version directory, e.g. models/digits_mlp/1, or a model base path (latest)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(command=cmd_verify)
    p = sub.add_parser("models-config", help="write TF Serving's models.config for the configs' exported models",
                       description="print (or --output) a ModelServerConfig listing each config's exported model, "
                                   "for tensorflow_model_server --model_config_file or python -m serving")
    p.add_argument("configs", nargs="+", help="experiment YAMLs, one per model")
    p.add_argument("--container_base", help="base path of the models inside a container, e.g. /models "
                                            "(default: absolute host paths)")
    p.add_argument("--output", help="write the file (atomically) instead of printing it")
    p.set_defaults(command=cmd_models_config)
    _deploy_parser(sub)
    _score_parser(sub)
    _audit_parser(sub)
    _data_service_parser(sub)
    _convert_parser(sub)
    p = sub.add_parser("example-data", help="write scikit-learn's digits as a folder of PNG and JPEG files per class and as "
                                            "CSV shards (no download), for configs/digits_images.yaml and "
                                            "configs/digits_csv.yaml (docs/data.md)",
                       description="write DIR/digits-images/<digit>/*.png|jpg and DIR/digits-csv/part-*.csv from "
                                   "scikit-learn's digits, each directory replaced whole")
    p.add_argument("directory", nargs="?", default="data", help="where to write them (default data/)")
    p.set_defaults(command=cmd_example_data)
    _gpt2_checkpoint_parser(sub)
    return parser


def _gpt2_checkpoint_parser(sub) -> None:
    p = sub.add_parser("gpt2-checkpoint", help="write a GPT-2 checkpoint in Hugging Face's layout: a trained run's "
                                               "weights (CONFIG), or random-initialised ones to fine-tune "
                                               "(docs/pretrained.md)",
                       description="write OUTPUT/{config.json, model.safetensors, vocab.json, merges.txt}: the run "
                                   "of CONFIG (model.init_from, data.tokenizer gpt2) as trained, or, without CONFIG, "
                                   "a random-initialised GPT-2 for model.init_from (the demo's)")
    p.add_argument("run_config", nargs="?", metavar="CONFIG", help="the experiment whose trained run to write")
    p.add_argument("--set", dest="run_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a value of CONFIG (repeatable)")
    p.add_argument("--output", required=True, help="the checkpoint directory to write (must not exist)")
    p.add_argument("--vocabulary", help="random: a directory with vocab.json and merges.txt (default: GPT-2's first "
                                        "200 merges, 457 ids, shipped with the pipeline)")
    for flag, default, what in (("--layers", 2, "blocks"), ("--width", 64, "the embedding width"),
                                ("--heads", 4, "attention heads"), ("--context", 128, "positions (n_positions)")):
        p.add_argument(flag, type=_positive_int, default=default, help=f"random: {what} (default {default})")
    p.set_defaults(command=cmd_gpt2_checkpoint)


def _convert_parser(sub) -> None:
    def shard_mb(text: str) -> float:
        value = _non_negative(text)
        if value == 0:
            raise argparse.ArgumentTypeError(f"expected a size in MB > 0, got {text!r}")
        return value

    p = sub.add_parser("convert", help="convert Parquet files once into TFRecord shards for data.source tfrecord "
                                       "(docs/data.md)",
                       description="read Parquet files a row group at a time and write DIR/part-00000.tfrecord, ... "
                                   "(tf.Examples: integer columns → int64_list, floating → float_list, lists of one "
                                   "length → one feature of that shape), published whole, and DIR/data.yaml, the "
                                   "data: section that trains on them (printed too); exit 2 on a column that does "
                                   "not convert (strings, nulls, ragged lists), nothing written")
    p.add_argument("input", nargs="+", metavar="INPUT",
                   help="Parquet files, or globs such as 'data/rows-*.parquet' (quote them); rows in sorted file order")
    p.add_argument("--output", required=True, metavar="DIR", help="the shards' directory, written whole at the end")
    p.add_argument("--label", default="label", metavar="COLUMN",
                   help="the label column: integers (classification) or floating values (regression); default label")
    p.add_argument("--drop", action="append", default=[], metavar="COLUMN",
                   help="a column to leave out, e.g. an id or a string column (repeatable)")
    p.add_argument("--shard_mb", type=shard_mb, default=128, metavar="MB",
                   help="start a new shard once one holds this many megabytes (default 128)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DIR (only once the new one is complete)")
    p.set_defaults(command=cmd_convert)


def _data_service_parser(sub) -> None:
    from pipeline.data.service import DISPATCHER_PORT, WORKER_PORT, WORKER_TIMEOUT_S

    p = sub.add_parser("data-service", help="run a tf.data service dispatcher or worker: input pipelines on other "
                                            "machines, for training with data.service (docs/data.md)",
                       description="run a tf.data service server until SIGTERM: the dispatcher (one per cluster) or a "
                                   "worker (any number; each registers with the dispatcher). Training with "
                                   "data.service: grpc://DISPATCHER:PORT reads its batches from the workers.")
    roles = p.add_subparsers(required=True, metavar="ROLE")
    d = roles.add_parser("dispatcher", help="the dispatcher: hands out the shards of each epoch to the workers")
    d.add_argument("--port", type=_port, default=DISPATCHER_PORT, help=f"its port (default {DISPATCHER_PORT})")
    d.add_argument("--work_dir", metavar="DIR",
                   help="a directory it journals its state to, so that a restarted dispatcher resumes its jobs "
                        "(fault-tolerant mode; without one, a restart loses them)")
    d.add_argument("--worker_timeout_s", type=_non_negative, default=WORKER_TIMEOUT_S, metavar="S",
                   help=f"a worker silent this long is removed, so trainers stop waiting on it (default "
                        f"{WORKER_TIMEOUT_S:g})")
    d.set_defaults(command=cmd_data_service, role="dispatcher")
    w = roles.add_parser("worker", help="a worker: reads and decodes the shards the dispatcher gives it")
    w.add_argument("--dispatcher", required=True, metavar="HOST:PORT", help="the dispatcher's address")
    w.add_argument("--port", type=_port, default=WORKER_PORT, help=f"its port (default {WORKER_PORT})")
    w.add_argument("--worker_address", metavar="HOST:PORT",
                   help="the address trainers reach this worker at (default localhost:PORT; in Kubernetes the "
                        "pod's address)")
    w.set_defaults(command=cmd_data_service, role="worker")


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """Where a batch job runs (pipeline/score/engine.py): this process, or an existing Dask cluster."""
    p.add_argument("--workers", type=_positive_int, default=2, metavar="N",
                   help="local engine: threads that run shards at once (default 2)")
    p.add_argument("--cluster", metavar="ADDRESS",
                   help="run on the Dask cluster at ADDRESS (e.g. tcp://scheduler:8786) instead of in this process; "
                        "its workers need this project and every path on a shared filesystem (docs/batch.md)")


def _score_parser(sub) -> None:
    p = sub.add_parser("score", help="batch predictions: csv/npz/tfrecord shards (or images) through an exported "
                                     "version → Parquet (docs/batch.md)",
                       description="run every row of the input shards (csv, npz, tfrecord of tf.Example; for a model "
                                   "trained on an image folder also image folders, image files and tfrecords of "
                                   "image/encoded, sent as bytes to predict_images) through the exported version, as "
                                   "the server runs it, on the batch engine; writes DIR/predictions/*.parquet, "
                                   "DIR/bad_rows/*.jsonl and DIR/summary.json, published whole; exit 2 on bad input, "
                                   "nothing written")
    p.add_argument("model_dir", help="a version directory, e.g. models/digits_mlp/1, or a model base path (latest)")
    p.add_argument("--input", action="append", required=True, metavar="PATTERN",
                   help="input files, a glob such as 'data/rows-*.csv' (quote it; repeatable), or a folder of images; "
                        "one task per file (images: per 1,024 files)")
    p.add_argument("--output", required=True, metavar="DIR", help="the output directory, written whole at the end")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DIR (only once the new one is complete)")
    p.add_argument("--batch_size", type=_positive_int, default=256, metavar="N",
                   help="rows per model call (default 256)")
    p.add_argument("--keep", action="append", default=[], metavar="COLUMN",
                   help="csv: a column that is not a feature, copied to the predictions (e.g. an id; repeatable)")
    _engine_arguments(p)
    p.set_defaults(command=cmd_score)


def _audit_parser(sub) -> None:
    from typing import get_args

    from pipeline.config import ExportConfig

    # The policies a version can be served under (export.serving_policy's names), so a new serving policy is
    # auditable against as soon as export can serve it.
    policies = [name for name in get_args(ExportConfig.model_fields["serving_policy"].annotation)
                if name not in ("trained", "auto")]
    p = sub.add_parser("audit", help="replay a server's request log through the float32 twin of the served version "
                                     "and report how far the served answers strayed (docs/batch.md)",
                       description="replay the sampled requests of a request log (PredictionLog TFRecords, the "
                                   "server's logging_config) through the float32 twin of the version that answered "
                                   "each (or its rebuild under --against POLICY) and compare with what the server "
                                   "answered: per output max/mean abs and relative difference, argmax agreement (a "
                                   "language model's generate calls teacher-forced, per generated step), "
                                   "rows beyond the tolerance with reproducers, a plot; exit 1 beyond the tolerance, "
                                   "2 on bad input")
    p.add_argument("model_dir", help="the model's base path (each logged version is audited), e.g. models/digits_mlp, "
                                     "or one version directory")
    p.add_argument("--log", action="append", required=True, metavar="PATTERN",
                   help="request-log files, a glob such as '/var/log/serving/requests-digits_mlp-*.tfrecord' "
                        "(quote it; repeatable); one task per file")
    p.add_argument("--against", default="float32", choices=policies, metavar="POLICY",
                   help=f"the reference: the trained weights rebuilt under this policy ({', '.join(policies)}; "
                        "default float32)")
    p.add_argument("--output", metavar="DIR", help="the report's directory, replaced whole (default "
                                                   "build/audit/<model>-vs-<POLICY>)")
    p.add_argument("--tolerance", type=_non_negative, metavar="T",
                   help="the largest max abs diff allowed, as a share of the output's largest magnitude (default: "
                        "the export's policy tolerance, parity.json)")
    p.add_argument("--run_dir", metavar="DIR",
                   help="the training run to rebuild the reference from (default: pipeline.json's run_dir)")
    p.add_argument("--reproducers", type=_non_negative_int, default=20, metavar="N",
                   help="rows beyond the tolerance to keep as reproducers (default 20)")
    p.add_argument("--batch_size", type=_positive_int, default=256, metavar="N",
                   help="rows per reference model call: logged requests are merged up to this (default 256)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _engine_arguments(p)
    p.set_defaults(command=cmd_audit)


def _deploy_parser(sub) -> None:
    """`deploy`'s flags are DeploySettings' fields, with its defaults (pipeline/deploy/settings.py)."""
    from pipeline.deploy.settings import DeploySettings

    d = DeploySettings()
    p = sub.add_parser("deploy", help="write the container recipe, Kubernetes and KServe manifests for the configs' "
                                      "exported models (docs/deploying.md)",
                       description="write a deployment kit for the configs' exported models: a Containerfile "
                                   "(build context: the kit), Kubernetes manifests and KServe resources, for "
                                   "python -m serving and for the real TF Serving image, and Kubernetes manifests "
                                   "for the tf.data service that feeds training (data.service); exit 2 on bad input, "
                                   "nothing written")
    p.add_argument("configs", nargs="+", help="experiment YAMLs, one per model (each exported: make export)")
    p.add_argument("--output", default="build/deploy", help="the kit's directory, replaced whole (default build/deploy)")
    p.add_argument("--image", default=d.image, help="image repository[:tag] of python -m serving; without a tag, the "
                                                    f"tag is a hash of the image's content (default {d.image})")
    p.add_argument("--tensorflow_serving_image", default=d.tensorflow_serving_image,
                   help=f"the real TF Serving image for the same models (default {d.tensorflow_serving_image})")
    p.add_argument("--min_replicas", type=int, default=d.min_replicas, help=f"autoscaler floor (default {d.min_replicas})")
    p.add_argument("--max_replicas", type=int, default=d.max_replicas, help=f"autoscaler ceiling (default {d.max_replicas})")
    p.add_argument("--cpu", type=int, default=d.cpu, help=f"whole cores per replica, requested and limit (default {d.cpu})")
    p.add_argument("--memory", default=d.memory, help=f"memory per replica, requested and limit (default {d.memory})")
    p.add_argument("--grace_period_s", type=float, default=d.grace_period_s,
                   help=f"python -m serving's drain on SIGTERM; the pods' grace period outlasts it (default {d.grace_period_s:g})")
    p.add_argument("--models_pvc", default=d.models_pvc, help="a PersistentVolumeClaim holding <model_name>/<version>/ "
                                                              "to mount at --container_base (new versions hot-swap); "
                                                              "default: the models copied into the image")
    p.add_argument("--storage_uri", default=d.storage_uri,
                   help=f"KServe: each model is fetched from STORAGE_URI/<model_name> (default {d.storage_uri})")
    p.add_argument("--container_base", default=d.container_base,
                   help=f"the models' directory inside the containers (default {d.container_base})")
    p.add_argument("--batching_parameters_file", default=d.batching_parameters_file,
                   help="TF Serving's BatchingParameters text for both servers (default: one batch thread, no wait, "
                        "batches up to 64)")
    p.add_argument("--data_service_workers", type=int, default=d.data_service_workers,
                   help=f"tf.data service worker pods for training input (default {d.data_service_workers})")
    p.add_argument("--data_service_worker_cpu", type=int, default=d.data_service_worker_cpu,
                   help=f"whole cores per tf.data service worker, requested and limit (default {d.data_service_worker_cpu})")
    p.add_argument("--data_service_worker_memory", default=d.data_service_worker_memory,
                   help=f"memory per tf.data service worker, requested and limit (default {d.data_service_worker_memory})")
    p.add_argument("--data_service_journal_size", default=d.data_service_journal_size,
                   help="the tf.data service dispatcher's PersistentVolumeClaim for its journal "
                        f"(default {d.data_service_journal_size})")
    p.add_argument("--data_service_pvc", default=d.data_service_pvc,
                   help="a PersistentVolumeClaim holding the training files, mounted read-only in each tf.data service "
                        "worker at --data_service_mount (default: none)")
    p.add_argument("--data_service_mount", default=d.data_service_mount,
                   help="where the workers mount --data_service_pvc; the trainers' data.path must name files there "
                        f"(default {d.data_service_mount})")
    p.set_defaults(command=cmd_deploy)


def cmd_data_service(cfg: None, args) -> None:
    from pipeline.data import service

    if args.role == "dispatcher":
        service.run_dispatcher(args.port, args.work_dir, args.worker_timeout_s)
    else:
        service.run_worker(args.port, args.dispatcher, args.worker_address)


def cmd_example_data(cfg: None, args) -> None:
    from pipeline.data.examples import write_examples

    for path in write_examples(args.directory):
        print(path)


def cmd_gpt2_checkpoint(cfg: None, args) -> None:
    from pipeline.lm import gpt2

    if args.run_config is None:
        print(gpt2.write_random(args.output, args.vocabulary, args.layers, args.width, args.heads, args.context))
        return
    print(gpt2.save_run(load_config(args.run_config, args.run_overrides), args.output))


def cmd_convert(cfg: None, args) -> None:
    from pipeline.data import parquet

    parquet.print_conversion(parquet.convert(args.input, args.output, label=args.label, drop=tuple(args.drop),
                                             shard_mb=args.shard_mb, overwrite=args.overwrite))


def cmd_train(cfg: Config, args) -> None:
    from pipeline.train import train

    train(cfg, fresh=args.fresh)


def cmd_export(cfg: Config, args) -> None:
    from pipeline.export import export

    print(export(cfg, force=args.force))


# What a language model (model.kind causal_lm) has instead of each command that does not take one.
LANGUAGE_MODEL_INSTEAD = {
    "predict": "make demo asks the served generate signature over gRPC; docs/export.md#language-models shows a request",
    "score": "call the generate signature over gRPC or REST (docs/export.md#language-models)",
}


def _refuse_language_model(command: str, kind: str | None) -> None:
    """A verb built for rows of features, given a language model: one line, exit 2, before any work."""
    if kind == "causal_lm" or kind == "language_model":
        raise ArgumentError(f"{command} does not take a language model (model.kind causal_lm); "
                            f"{LANGUAGE_MODEL_INSTEAD[command]}")


def _model_dir_task(model_dir: str) -> str | None:
    """The task pipeline.json records for a MODEL_DIR (None without one)."""
    from serving.servable import saved_model

    return (saved_model.read_pipeline_json(saved_model.version_path(Path(model_dir))) or {}).get("task")


def cmd_predict(cfg: Config, args) -> None:
    _refuse_language_model("predict", cfg.model.kind)
    from pipeline.predict import evaluate_locally, evaluate_over_grpc

    if args.local:
        evaluate_locally(cfg)
    else:
        evaluate_over_grpc(cfg, args.server or f"{cfg.serving.host}:{cfg.serving.port}")


def cmd_serve(cfg: Config, args) -> None:
    from pipeline.serve import serve

    serve(cfg)


def cmd_demo(cfg: Config, args) -> None:
    from pipeline.demo import run_demo

    run_demo(cfg)


def cmd_models_config(cfg: None, args) -> None:
    from pipeline import artifacts
    from pipeline.export.models_config import models_config

    text = models_config([load_config(path) for path in args.configs], container_base=args.container_base,
                         sources=args.configs)
    if args.output:
        artifacts.write_text_atomic(args.output, text)
    else:
        print(text, end="")


def cmd_deploy(cfg: None, args) -> None:
    import dataclasses

    from pipeline.deploy import DeploySettings, deploy

    settings = DeploySettings(**{field.name: getattr(args, field.name) for field in dataclasses.fields(DeploySettings)})
    print(deploy([load_config(path) for path in args.configs], args.output, settings, sources=args.configs))


def cmd_verify(cfg: None, args) -> int:
    _model_dir_argument(args.model_dir)  # a mistyped path: stderr, exit 2, not a failed audit (stdout, exit 1)
    from pipeline.verify import print_report, verify  # TensorFlow: only once there is something to audit

    return print_report(verify(args.model_dir), as_json=args.json)


def cmd_score(cfg: None, args) -> None:
    from pipeline.score.engine import EngineOptions

    _model_dir_argument(args.model_dir)
    _refuse_language_model("score", _model_dir_task(args.model_dir))
    from pipeline.score import print_summary, score  # TensorFlow: only once there is something to score

    summary = score(args.model_dir, args.input, args.output, batch_size=args.batch_size, keep=tuple(args.keep),
                    overwrite=args.overwrite, options=EngineOptions(workers=args.workers, cluster=args.cluster))
    print_summary(summary, args.output)


def cmd_audit(cfg: None, args) -> int:
    from pipeline.score.engine import EngineOptions

    _model_dir_argument(args.model_dir)
    from pipeline.audit import audit, print_report

    report = audit(args.model_dir, args.log, against=args.against, output=args.output, tolerance=args.tolerance,
                   run_dir=args.run_dir, reproducers=args.reproducers, batch_size=args.batch_size,
                   options=EngineOptions(workers=args.workers, cluster=args.cluster))
    return print_report(report, as_json=args.json)


def _model_dir_argument(model_dir: str) -> None:
    """A MODEL_DIR without a SavedModel is a mistyped argument: one line, exit 2, before the verb's work starts."""
    from serving.errors import SavedModelNotFound
    from serving.servable.saved_model import version_path

    try:
        version_path(Path(model_dir))
    except SavedModelNotFound as error:
        raise ArgumentError(f"{error}; pass a version directory (e.g. models/digits_mlp/1) or a model base "
                            "path (e.g. models/digits_mlp)") from None


def cmd_diagnose(cfg: Config, args) -> int:
    from pipeline.diagnose import diagnose, print_diagnosis

    return print_diagnosis(diagnose(cfg, probe_batches=args.batches), as_json=args.json)


def cmd_compare(cfg: Config, args) -> int:
    from pipeline.compare import compare

    return compare(args.config, args.overrides, cfg, bfloat16=args.bfloat16, tolerance=args.tolerance,
                   probe_batches=args.batches)


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"expected a port 1..65535, got {text!r}")
    return int(text)


def cmd_config(cfg: Config, args) -> None:
    print(cfg.to_yaml(), end="")
