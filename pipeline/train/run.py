"""`python -m pipeline train CONFIG [--fresh]`: trains one experiment under its precision policy.

Writes runs/<experiment>/:
    config.yaml          the fully resolved config (written first)
    checkpoints/ckpt-N/  crash-safe checkpoints (model, optimizer, loss scale, RNG, position, history)
    logs/                TensorBoard scalars: metrics per epoch, loss scale and skipped steps per step
    history.json         per-epoch metrics, loss scale, skipped steps, seconds and examples/s (rewritten each epoch)
    samples.txt          a language model's greedy completion of a fixed prompt after each epoch (samples.py)
    history.png          the same as curves (redrawn at most once a minute, and when training ends)
    model.keras          the trained model          } written last: their presence
    metrics.json         final metrics, throughput, } marks a finished run
                         peak memory                }

Running it again on the same run directory resumes from the newest checkpoint (a killed run included)
and finishes it; --fresh discards the run's checkpoints and outputs and starts over.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from pipeline import artifacts, data, models, precision
from pipeline.lm import gpt2, tokenizers
from pipeline.models import columns, nonfinite
from pipeline.artifacts import (CHECKPOINTS_DIR, CONFIG_FILE, DATA_DIR, HISTORY_FILE, HISTORY_PLOT, LOGS_DIR,
                                METRICS_FILE, MODEL_FILE, SAMPLES_FILE)
from pipeline.config import WEIGHT_SECTIONS, Config, ConfigError, TrainConfig, validate_config
from pipeline.data.text import Baselines
from pipeline.errors import TrainingError
from pipeline.train import auto, checkpoints, distribute, loops, memory, samples
from pipeline.train.discard import discard
from pipeline.train.history import NON_METRIC_KEYS, write_history
from pipeline.train.input_wait import InputClock
from pipeline.train.length import RunLength, run_length
from pipeline.train.length import describe as describe_length
from pipeline.train.recorder import RunRecorder
from serving import frozen_weights

log = logging.getLogger(__name__)

# A checkpoint resumes only under the settings that shaped its weights (config.WEIGHT_SECTIONS) and
# its data order; anything else (epochs, loop, checkpointing, distribution, export, serving) may change.
RESUME_TRAIN_KEYS = ("batch_size", "optimizer", "learning_rate", "gradient_accumulation_steps",
                     "learning_rate_schedule", "warmup_steps", "global_clipnorm",
                     "steps_per_epoch")  # where each epoch starts in the stream of passes (train/length.py)

@dataclasses.dataclass
class RunResult:
    run_dir: Path
    model: keras.Model
    datasets: data.Datasets
    policy: precision.PolicyInfo
    metrics: dict


def train(cfg: Config, fresh: bool = False) -> RunResult:
    """Trains one experiment and writes its run directory.

    Resumes from the run's newest checkpoint when there is one (unless fresh), so a re-run after a
    crash or a kill finishes the same run.

    Raises:
        ConfigError: train.batch_size larger than the training examples (nothing written yet).
        TrainingError: non-finite training, a checkpoint from incompatible settings, workers that
            disagree on where to resume, or oneDNN's frozen-weights switch set in this process.
    """
    if frozen_weights.is_on():  # docs/serving.md#frozen-weights
        raise TrainingError(f"{frozen_weights.VARIABLE}=1 is set: oneDNN would keep computing with its packed "
                            "copies of the weights this run changes; it is for serving processes only, unset it "
                            "to train")
    strategy = distribute.make_strategy(cfg.train.distribution)  # before any other TensorFlow op
    keras.utils.set_random_seed(cfg.seed)
    datasets = data.load_datasets(cfg.data, seed=cfg.seed, recorded=None if fresh else cfg.run_dir / DATA_DIR,
                                  pretrained=cfg.model.init_from)
    if not fresh:
        _check_tokenizer_resumable(cfg.run_dir, datasets.tokenizer)
    _check_batch_size(cfg.train.batch_size, datasets.train_examples)
    _check_warmup(cfg, datasets.train_examples)
    # Before any layer exists. A resumed run keeps the policy its checkpoint recorded; `auto` may time train steps
    # under each candidate here (pipeline/train/auto.py), since the flags alone do not decide on every CPU.
    policy = precision.apply_policy(cfg.precision, recorded=None if fresh else checkpoints.recorded_policy(cfg.run_dir),
                                    measure=auto.measurer(cfg, datasets, strategy,
                                                          lambda chosen: build_compiled_model(cfg, datasets, chosen)))
    with strategy.scope():
        model = build_compiled_model(cfg, datasets, policy)
    if cfg.model.normalize:
        columns.warn_if_ids_are_standardised(model, datasets.spec, datasets.sample_x)
    memory_estimate = memory.estimate(cfg, model)  # before the first step allocates gradients and activations
    clock = InputClock()
    plan = loops.plan_for(cfg, datasets, verbose=1 if sys.stdout.isatty() else 2, clock=clock,
                          service=cfg.data.service,
                          job_name=f"{cfg.experiment}-{datasets.statistics.fingerprint[:12] or cfg.seed}")

    # A full disk is one line with what was kept (issue 23), whichever write hit it: checkpoint, model.keras, logs.
    with artifacts.disk_full_is_one_line(cfg.run_dir, lambda: _kept_on_disk_full(cfg.run_dir)):
        with distribute.run_directory(cfg.run_dir, strategy) as run_dir:
            checkpointer = checkpoints.Checkpointer(run_dir, model, cfg.train.keep_checkpoints)
            state = _start_or_resume(cfg, run_dir, checkpointer, strategy, fresh, plan.length)
            state.policy = policy.to_dict()  # in every checkpoint, for a resume (checkpoints.recorded_policy)
            if distribute.is_chief(strategy):
                data.record(datasets, run_dir / DATA_DIR)
            _log_start(cfg, policy, strategy, datasets, model, plan, run_dir)
            (log.info if memory_estimate.fits else log.warning)("%s", memory_estimate.describe())
            recorder = RunRecorder(run_dir, checkpointer, state, cfg.train, policy, plan.length,
                                   examples_per_pass=datasets.train_examples, clock=clock,
                                   input_advice=data.input_advice(cfg.data))
            # Before the recorder: an epoch's sample is written before its checkpoint, which a resume goes back to.
            callbacks = ([samples.SampleWriter(run_dir, state.epoch, datasets.tokenizer)]
                         if datasets.corpus is not None and distribute.is_chief(strategy) else []) + [recorder]
            first_step, started = state.global_step, time.perf_counter()
            try:
                with precision.check_numerics(cfg.precision.check_numerics):
                    loops.run(cfg.train.loop, model, plan, callbacks, state.epoch, state.step_in_epoch, strategy)
            except TrainingError as error:
                raise TrainingError(_name_the_layer(str(error), model, datasets.sample_x, cfg, policy)) from None
            except (tf.errors.InvalidArgumentError, tf.errors.DataLossError, tf.errors.NotFoundError,
                    tf.errors.FailedPreconditionError) as error:
                raise data.explain_input_failure(datasets, error) from None
            finally:
                recorder.close()
            seconds = time.perf_counter() - started
            metrics = _final_metrics(cfg, state, datasets, model, plan, state.global_step - first_step, seconds)
            metrics["policy"] = policy.to_dict()  # what `auto` resolved to here; export reuses it elsewhere
            metrics["loss_scale_health"] = recorder.loss_scale_health()
            metrics["memory_estimate"] = memory_estimate.to_dict()
            if datasets.baselines is not None:
                metrics.update(language_model_metrics(metrics, datasets.baselines))
            _save_model(model, run_dir / MODEL_FILE)
            artifacts.write_json_atomic(run_dir / METRICS_FILE, metrics)
    log.info("%s after %d epochs (%d steps, %d skipped) in %.1f s; peak memory %s; weights sha1 %s → %s",
             ", ".join(f"{k} {v:.4f}" for k, v in state.history[-1].items() if k.startswith("val_")), plan.epochs,
             state.global_step, state.skipped_steps, state.train_seconds, describe_memory(metrics),
             metrics["weights_sha1"], run_dir)
    return RunResult(cfg.run_dir, model, datasets, policy, metrics)


def _kept_on_disk_full(run_dir: Path) -> str:
    """What a run stopped by a full disk kept: its newest complete checkpoint, which the same command resumes from."""
    try:
        latest = checkpoints.latest_checkpoint(run_dir)
        state = checkpoints.read_state(latest) if latest is not None else None
    except Exception:  # noqa: BLE001 - the disk-full line matters more than this detail
        log.debug("could not read the newest checkpoint", exc_info=True)
        latest = state = None
    if latest is None:
        return f"no complete checkpoint in {run_dir / CHECKPOINTS_DIR} yet, so the next run starts over"
    return (f"kept {latest} (epoch {state.epoch}, step {state.global_step}), complete; the same command resumes "
            "from it")


def _name_the_layer(message: str, model: keras.Model, sample_x: np.ndarray, cfg: Config,
                    policy: precision.PolicyInfo) -> str:
    """A stop for non-finite training (the guard's), with the first layer whose output is inf or NaN on training rows
    under the weights as they are now, and its fix; or, when every output is finite, where to look instead."""
    if not message.startswith("training stopped at step"):
        return message
    try:
        found = nonfinite.first_nonfinite(model, nonfinite.probe_rows(sample_x, first=nonfinite.MAX_ROWS))
    except Exception:  # noqa: BLE001 - the stop's own message is what matters; this only adds to it
        log.debug("could not look for the first non-finite layer", exc_info=True)
        return message
    if found is None:
        return (f"{message}; every layer's output is finite on the training rows, so the loss or the gradients "
                "overflow: set precision.check_numerics: true to find the op")
    return f"{message}; {nonfinite.describe(found, policy.name, cfg.precision.float32_layers, cfg.precision.float16_layers)}"


def build_compiled_model(cfg: Config, datasets: data.Datasets, policy: precision.PolicyInfo) -> keras.Model:
    """The experiment's model, compiled with its optimizer, loss and metrics, all variables created.

    Call it after precision.apply_policy, inside the strategy's scope. The optimizer and the compiled
    metrics are built now rather than in the first step, so that a checkpoint restores into them.
    """
    model = models.build_model(cfg.model, datasets.spec, datasets.statistics, cfg.precision.float32_layers,
                               cfg.precision.float16_layers)
    loss, metrics = models.compile_settings(datasets.spec)
    total_steps = run_length(cfg.train, datasets.train_examples).total_steps
    model.compile(optimizer=precision.build_optimizer(cfg.train, policy, total_steps), loss=loss, metrics=metrics,
                  auto_scale_loss=False,  # build_optimizer already decided on loss scaling
                  jit_compile=cfg.train.jit_compile)
    model.optimizer.build(model.trainable_variables)
    x, y = datasets.sample_x[:2], datasets.sample_y[:2].astype(np.float32 if datasets.spec.task == "regression"
                                                                 else np.int64)
    y_pred = model(x, training=False)
    model.compute_loss(x=x, y=y, y_pred=y_pred, training=False)
    model.compute_metrics(x, y, y_pred)
    model.reset_metrics()
    return model


def _check_batch_size(batch_size: int, examples: int) -> None:
    """Refuses a batch larger than the training set (before anything is written): it cannot be honoured, every
    epoch would silently become one step over all the rows."""
    if batch_size > examples:
        raise ConfigError([f"train.batch_size: {batch_size} is larger than the {examples} training examples (each "
                           f"epoch would be a single step of {examples}); use at most {examples}"])


def _check_warmup(cfg: Config, examples: int) -> None:
    """Refuses a warm-up as long as the whole run (the data decides how many updates that is)."""
    length = run_length(cfg.train, examples)
    updates = precision.total_updates(cfg.train, length.total_steps)
    if cfg.train.warmup_steps and cfg.train.warmup_steps >= updates:
        raise ConfigError([f"train.warmup_steps: {cfg.train.warmup_steps} is not below the run's {updates} updates "
                           f"({describe_length(length, cfg.train.batch_size)} of {examples} training examples"
                           + (f", {cfg.train.gradient_accumulation_steps} batches per update"
                              if cfg.train.gradient_accumulation_steps > 1 else "") + "); lower it"])


def _start_or_resume(cfg: Config, run_dir: Path, checkpointer: checkpoints.Checkpointer, strategy,
                     fresh: bool, length: RunLength) -> checkpoints.TrainingState:
    """The state to train from: the newest checkpoint's (restored into the model), or a fresh one.

    Every worker resumes from the chief's run directory (cfg.run_dir), which multi-machine resumes
    therefore need on shared storage; the workers check that they agree before any step.
    """
    chief = distribute.is_chief(strategy)
    if fresh and chief:
        _clear_run(cfg.run_dir, Path(cfg.train.runs_dir))
    latest = None if fresh else checkpoints.latest_checkpoint(cfg.run_dir)
    if latest is None:
        state = checkpoints.TrainingState()
        if cfg.model.init_from:  # a fresh run from a pretrained checkpoint starts from its weights
            gpt2.load_weights(checkpointer.model, cfg.model.init_from)
            log.info("model.init_from: the weights of %s", cfg.model.init_from)
    else:
        _check_resumable(checkpoints.read_state(latest).config, cfg, latest)
        state = checkpointer.restore(latest)
        if state.global_step > length.total_steps:
            raise TrainingError(f"{latest} is at step {state.global_step} (epoch {state.epoch}), past the run's "
                                f"{length.total_steps} steps; raise train.epochs or train.max_steps, {_KEEP_OR_FRESH}")
        log.info("resuming from %s: epoch %d of %d, batch %d of %d (step %d of %d, %d skipped so far); "
                 "--fresh starts over", latest, state.epoch + (state.step_in_epoch > 0), length.epochs,
                 state.step_in_epoch, length.steps_in_epoch(state.epoch), state.global_step, length.total_steps,
                 state.skipped_steps)
    if not distribute.all_workers_agree(strategy, state.global_step):
        raise TrainingError(f"the workers found different checkpoints to resume from in {cfg.run_dir} (this one: "
                            f"step {state.global_step}); put train.runs_dir on storage every worker shares, "
                            "or start over with --fresh")
    state.config = cfg.to_dict()
    if chief:
        _start_run_dir(cfg, run_dir, state)
    return state


def _check_tokenizer_resumable(run_dir: Path, tokenizer) -> None:
    """A checkpoint's token ids mean what its run's sentencepiece tokenizer says: a tokenizer trained again (the
    training text changed) cannot resume it. (A GPT-2 one is read from the run's data directory once recorded, so it
    is the run's own.)"""
    latest = checkpoints.latest_checkpoint(run_dir) if getattr(tokenizer, "kind", None) == "sentencepiece" else None
    if latest is None:
        return
    stored = tokenizers.read_sentencepiece(run_dir / DATA_DIR)
    if stored is None or stored.sha256 != tokenizer.sha256:
        raise TrainingError(f"{latest} was trained with the sentencepiece tokenizer of {run_dir / DATA_DIR}, and the "
                            f"training text has changed since, so the tokenizer would be trained again; "
                            f"{_KEEP_OR_FRESH}")


def _check_resumable(saved: dict, cfg: Config, checkpoint: Path) -> None:
    current = cfg.to_dict()
    try:  # with the defaults of keys added since the checkpoint was written
        saved = validate_config(saved).to_dict()
    except ConfigError:
        pass  # a config this version refuses differs from any it accepts: the comparison below says where
    differ = [key for key in WEIGHT_SECTIONS if saved.get(key) != current[key]]
    # A schedule spans the run: its length (train.epochs, train.max_steps) is fixed once it decays
    # (precision.learning_rate).
    keys = RESUME_TRAIN_KEYS + (("epochs", "max_steps") if cfg.train.learning_rate_schedule == "cosine" else ())
    differ += [f"train.{key}" for key in keys if saved.get("train", {}).get(key) != current["train"][key]]
    if differ:
        raise TrainingError(f"{checkpoint} was trained with different {', '.join(differ)} settings; resuming needs "
                            f"the same ones; {_KEEP_OR_FRESH}")


# The two ways out of a run that cannot resume; the first keeps the run (e.g. make demo's).
_KEEP_OR_FRESH = ("train a new run beside it (--set experiment=NEW_NAME), or delete it and start over "
                  "(--fresh; make train ARGS=--fresh)")


def _clear_run(run_dir: Path, runs_dir: Path) -> None:
    """--fresh: hides, then deletes, everything a previous run wrote (config.yaml is rewritten next), the
    finished-run markers first; only inside a run directory that resolves to one below runs_dir."""
    resolved, root = run_dir.resolve(), runs_dir.resolve()
    if root not in resolved.parents:
        raise TrainingError(f"--fresh: refusing to clear {run_dir}: it resolves to {resolved}, which is not inside "
                            f"train.runs_dir {runs_dir} ({root})")
    names = (METRICS_FILE, MODEL_FILE, CHECKPOINTS_DIR, LOGS_DIR, HISTORY_FILE, HISTORY_PLOT, DATA_DIR, SAMPLES_FILE)
    discard((run_dir / name for name in names), inside=run_dir)
    log.info("--fresh: cleared %s", run_dir)


def _start_run_dir(cfg: Config, run_dir: Path, state: checkpoints.TrainingState) -> None:
    """Writes the resolved config and the history so far, and clears the markers of a finished run, so a
    crash midway never leaves an old model.keras next to a new config.yaml."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in (METRICS_FILE, MODEL_FILE):
        (run_dir / name).unlink(missing_ok=True)
    artifacts.write_text_atomic(run_dir / CONFIG_FILE, cfg.to_yaml())
    write_history(run_dir, state.history)  # drops epochs a killed process recorded after its last checkpoint


def _log_start(cfg: Config, policy, strategy, datasets: data.Datasets, model: keras.Model, plan: loops.Plan,
               run_dir: Path) -> None:
    spec, accumulation = datasets.spec, cfg.train.gradient_accumulation_steps
    log.info("%s", policy.describe())
    log.info("%s", precision_support(precision.detect_hardware()))
    if spec.task == "language_model":
        tokens = f" (windows of token ids, data.tokenizer {cfg.data.tokenizer}: vocabulary {spec.vocab_size})"
    else:
        tokens = f" (token ids, vocabulary {spec.vocab_size}, 0 = padding)" if spec.tokens else ""
    validation = (f", validating on the first {cfg.train.validation_steps} batches"
                  if cfg.train.validation_steps else "")
    log.info("data %s (%s): %d training / %d validation examples, input %s%s; %s%s%s",
             cfg.data.source, spec.task, datasets.train_examples, datasets.val_examples, spec.input_shape, tokens,
             describe_length(plan.length, cfg.train.batch_size), validation, _accumulation_text(accumulation, plan))
    log.info("optimizer %s: %s%s", cfg.train.optimizer, _schedule_text(cfg.train, plan.length.total_steps),
             f", gradients clipped to global norm {cfg.train.global_clipnorm:g} (unscaled)"
             if cfg.train.global_clipnorm else "")
    log.info("model %s: %s parameters; loop %s, XLA %s; %s; run directory %s", model.name,
             f"{model.count_params():,}", cfg.train.loop, "on" if model.jit_compile else "off",
             distribute.describe(strategy), run_dir)


def _accumulation_text(accumulation: int, plan: loops.Plan) -> str:
    if accumulation == 1:
        return ""
    left = plan.length.total_steps % accumulation
    return (f", {accumulation} batches per update (an update with an overflowing batch is skipped whole)"
            + (f"; the last {left} batches fill no update and are not applied" if left else ""))


def _schedule_text(train: TrainConfig, total_steps: int) -> str:
    updates = precision.total_updates(train, total_steps)
    if train.learning_rate_schedule == "constant" and not train.warmup_steps:
        return f"learning rate {train.learning_rate:g}, constant, {updates} updates"
    warmup = f"linear warm-up over {train.warmup_steps} updates, then " if train.warmup_steps else ""
    after = "constant" if train.learning_rate_schedule == "constant" else "cosine decay to 0"
    return f"learning rate {train.learning_rate:g}: {warmup}{after}, {updates} updates in all"


def language_model_metrics(metrics: dict, baselines: Baselines) -> dict:
    """A language model's figures against the baselines on the same validation bytes: unigram and bigram nats per
    byte, and the model's validation nats per byte as a share of each (0.6: 40% below)."""
    found = {"baselines": {"unigram_nats_per_byte": round(baselines.unigram, 4),
                           "bigram_nats_per_byte": round(baselines.bigram, 4),
                           "train_bytes": baselines.train_bytes, "validation_bytes": baselines.validation_bytes}}
    loss = metrics.get(f"val_{models.NATS_PER_BYTE}")
    if loss is not None:
        found["val_nats_per_byte_vs_unigram"] = round(loss / baselines.unigram, 4)
        found["val_nats_per_byte_vs_bigram"] = round(loss / baselines.bigram, 4)
        log.info("val_%s %.4f: %.2f× the unigram baseline (%.4f), %.2f× the bigram baseline (%.4f) on the same "
                 "%s validation bytes", models.NATS_PER_BYTE, loss, loss / baselines.unigram, baselines.unigram,
                 loss / baselines.bigram, baselines.bigram, f"{baselines.validation_bytes:,}")
    return found


def describe_memory(metrics: dict) -> str:
    """'812 MiB RSS' on a CPU; '812 MiB RSS, 1,234 MiB on GPU:0' where TensorFlow reports device memory."""
    text = f"{metrics['peak_rss_bytes'] / 2 ** 20:,.0f} MiB RSS"
    if metrics.get("memory_estimate"):
        text += f" (estimated {metrics['memory_estimate']['peak_bytes'] / 2 ** 20:,.0f} MiB)"
    if metrics.get("peak_device_bytes") is not None:
        text += f", {metrics['peak_device_bytes'] / 2 ** 20:,.0f} MiB on GPU:0"
    return text


def _final_metrics(cfg: Config, state: checkpoints.TrainingState, datasets: data.Datasets, model: keras.Model,
                   plan: loops.Plan, steps: int, seconds: float) -> dict:
    """The last epoch's validation and training metrics (metric names as compiled: val_accuracy,
    val_mae, ...) and how the run went. The weights are the last epoch's, so this needs no second pass."""
    last = state.history[-1]
    metrics = {key: value for key, value in last.items() if key.startswith("val_")}
    metrics.update({f"train_{key}": value for key, value in last.items()
                    if key not in NON_METRIC_KEYS and not key.startswith("val_")})
    metrics.update({
        "epochs": plan.epochs,
        "steps": state.global_step,
        "train_examples": datasets.train_examples,
        "val_examples": datasets.val_examples,
        "train_seconds": round(state.train_seconds, 2),
        # This process only: steps it trained (a resumed run's earlier steps are not in `seconds`).
        "train_examples_per_second": (round(steps / plan.length.pass_steps * datasets.train_examples / seconds, 1)
                                      if steps else None),
        "steady_examples_per_second": steady_examples_per_second(state.history),
        "loop": cfg.train.loop,
        "final_loss_scale": precision.current_loss_scale(model.optimizer),
        "skipped_steps": state.skipped_steps,
        "weights_sha1": weights_sha1(model),
        **peak_memory(),
    })
    return metrics


# Instruction-set flags (/proc/cpuinfo) with which a CPU computes float16 natively; without them TensorFlow
# converts each float16 value to float32 and back (oneDNN's C++ log line "supports DT_HALF only on platforms
# with AVX-512 ... Falling back to the default Eigen-based implementation", hidden by pipeline/__main__.py):
# docs/keras3-mixed-precision.md §7.
FLOAT16_CPU_FLAGS = ("avx512_fp16", "amx_fp16")


def precision_support(hardware: precision.Hardware) -> str:
    """One line, in our words, on what this machine computes natively: float16, bfloat16, both or neither."""
    if hardware.gpus:
        name, capability = hardware.gpus[0]
        if capability is None:
            return f"precision: GPU {name} of unknown compute capability (float16 Tensor Cores need 7.0, bfloat16 8.0)"
        major, minor = capability
        half = "float16 on Tensor Cores" if (major, minor) >= (7, 0) else "no float16 Tensor Cores (below 7.0)"
        brain = "bfloat16 on Tensor Cores" if (major, minor) >= (8, 0) else "no bfloat16 Tensor Cores (below 8.0)"
        return f"precision: GPU {name} (compute capability {major}.{minor}): {half}; {brain}"
    if hardware.tpu:
        return "precision: TPU: bfloat16 is its native matmul type"
    half = [flag for flag in FLOAT16_CPU_FLAGS if flag in hardware.cpu_flags]
    brain = [flag for flag in precision.BF16_CPU_FLAGS if flag in hardware.cpu_flags]
    half_text = (f"float16 is native ({', '.join(half)})" if half else
                 "float16 is emulated (no AVX512_FP16), so mixed_float16 computes correctly but slower than float32")
    if brain:
        brain_text = (f"bfloat16 is native ({', '.join(brain)}), so mixed_bfloat16 may beat float32, by how much "
                      "depends on the model's shapes (precision.policy auto measures both)")
    elif half:
        brain_text = "bfloat16 is emulated (no AVX512_BF16 or AMX_BF16)"
    else:
        brain_text = "bfloat16 is emulated too (no AVX512_BF16 or AMX_BF16), so float32 is the fastest policy"
    return f"precision: this CPU (no GPU): {half_text}; {brain_text}"


def steady_examples_per_second(history: list[dict]) -> float | None:
    """Training throughput without the warm-up: the median over the epochs after the first (which traces
    and compiles the train step); None with a single epoch."""
    rates = [h["examples_per_second"] for h in history[1:] if h.get("examples_per_second")]
    return round(float(np.median(rates)), 1) if rates else None


def peak_memory() -> dict:
    """This process's peak resident memory and, on a GPU, TensorFlow's peak allocation on the first GPU (None
    on a CPU): what `compare` reports per policy, each trained in a process of its own."""
    import resource

    import tensorflow as tf

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    device = None
    if tf.config.list_logical_devices("GPU"):
        device = int(tf.config.experimental.get_memory_info("GPU:0")["peak"])
    return {"peak_rss_bytes": int(rss), "peak_device_bytes": device}


def weights_sha1(model: keras.Model) -> str:
    """A fingerprint of the trained weights, e.g. to check that workers or repeated runs agree bit for bit."""
    digest = hashlib.sha1()
    for weight in model.get_weights():
        digest.update(np.ascontiguousarray(weight).tobytes())
    return digest.hexdigest()[:16]


def _save_model(model: keras.Model, path: Path) -> None:
    """model.keras: the architecture and the trained weights, without the optimizer's state (Adam's moments are two
    thirds of the file, and every reader loads it with compile=False; a resume reads the checkpoints). A functional
    model is saved through an uncompiled model over the same layers, which shares the weights (no copy); another
    keras.Model (a custom builder's subclass) is saved whole."""
    if type(model).__name__ == "Functional":
        model = keras.Model(model.input, model.output, name=model.name)  # the same structure: a tensor, a list or a dict
    with artifacts.atomic_file(path) as tmp:  # keeps the .keras suffix Keras insists on
        model.save(tmp)
