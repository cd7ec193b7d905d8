"""Optional figure "peers": the same SavedModel behind MLflow's and BentoML's model servers, beside ours.

The peers are installed by the bench into a virtual environment of their own, build/peers-venv/
(git-ignored; created once from bench/peers-requirements.txt with this Python, reinstalled when that
file changes), never into the project's .venv. Each peer serves the newest exported version of the
bench model, loaded with tf.saved_model.load and called through its serving_default signature:

- MLflow: a pyfunc model ("models from code": a generated PythonModel, the SavedModel as its
  artifact) behind `mlflow models serve --env-manager local`, i.e. MLflow's scoring server, one
  uvicorn worker (its default; MLflow has no request batching). POST /invocations.
- BentoML: a generated `@bentoml.service` (1 worker) whose API is `batchable=True` (its adaptive
  batching, max_batch_size as ours), behind `bentoml serve`. POST /predict.
- ours: `python -m serving` with batching on (figure 4's batching parameters), REST and gRPC.

All REST servers get the same JSON body, {"instances": [row]}, which all three accept. First one
fixed row goes to every server and its probabilities are compared with the SavedModel's own
(called in this process): a server off by more than TOLERANCE fails its rows. Then the same load as
figure 4 (bench.loadgen processes, one connection per client) runs 1/8/32 clients against each
server in turn, interleaved by client count, so the servers are measured minutes apart at most.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from bench import timing
from bench.serving_throughput import (BATCHING, SERVER_THREADS, load, qps_axes, write_batching_parameters,
                                     write_requests)
from bench.workloads import Sizes

TITLE = "Peers: the same SavedModel served by MLflow and BentoML beside ours"
TARGET_RATIO = 3.0
TARGET = f"ours >= {TARGET_RATIO:g}x the best peer's qps at 32 clients; every server's probabilities within 1e-5"
COLUMNS = ["server", "clients", "qps", "p50_ms", "p99_ms", "errors", "max_abs_diff", "ratio_to_best_peer",
           "target", "target_met", "note"]

REPO_ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = Path(__file__).with_name("peers-requirements.txt")
VENV = REPO_ROOT / "build" / "peers-venv"
TOLERANCE = 1e-5  # max abs difference of a probability vector from the SavedModel's own
OUTPUT = "probabilities"
PEERS = ("mlflow", "bentoml")
OURS = ("ours (rest)", "ours (grpc)")
JUDGED_CLIENTS = 32
START_TIMEOUT_S = 240.0


@dataclasses.dataclass
class Endpoint:
    """A server under test as the load generator sees it."""
    server: str  # a row's "server"
    protocol: str  # "rest" or "grpc" (bench.loadgen's protocols)
    address: str  # host:port
    path: str  # the REST route ("" for gRPC)


def run(sizes: Sizes, work_dir: Path, model=None, requests=None) -> dict:
    """Measures the peers and ours; model: a bench.exported_model.ExportedModel (None: figure 4's, trained here);
    requests: (grpc_request, rest_request) paths, a serialized single-row PredictRequest and its REST
    body {"instances": [row]} as figure 4 writes them (None: written here from model.rows[:1])."""
    from bench.exported_model import exported_model
    from bench.server_processes import free_port, running_servers
    from serving.servable import saved_model

    if model is None:
        model = exported_model(sizes, work_dir, kind="guide")
    peers_dir = work_dir / "peers"
    peers_dir.mkdir(parents=True, exist_ok=True)
    version_dir = saved_model.latest_version_dir(model.base_path)
    python = ensure_venv()
    grpc_request, rest_request = requests if requests is not None else write_requests(model, peers_dir)
    versions = installed_versions(python)
    timing.progress(f"peers: {', '.join(f'{name} {version}' for name, version in versions.items())} "
                    f"in {VENV.relative_to(REPO_ROOT)}")

    expected = reference_probabilities(version_dir, model)
    mlflow_model = save_mlflow_model(python, peers_dir, version_dir, model, expected.shape[-1])
    batching = BATCHING
    bento_dir = write_bento_service(peers_dir, version_dir, model, batching["max_batch_size"])
    batching_file = write_batching_parameters(peers_dir, batching)
    flags = ["--model_name", model.model_name, "--model_base_path", str(model.base_path),
             "--file_system_poll_wait_seconds", "0", "--enable_batching", "--batching_parameters_file",
             str(batching_file), *SERVER_THREADS]
    timing.progress("peers: starting our server, MLflow's and BentoML's")
    with contextlib.ExitStack() as stack:
        # Started together (TensorFlow's import dominates start-up), measured one at a time.
        mlflow_port, bento_port = free_port(), free_port()
        mlflow = stack.enter_context(peer_process(
            "mlflow", [str(VENV / "bin" / "mlflow"), "models", "serve", "-m", str(mlflow_model), "--env-manager",
                       "local", "-h", "127.0.0.1", "-p", str(mlflow_port), "-w", "1"],
            peers_dir / "mlflow.log", peers_dir, f"127.0.0.1:{mlflow_port}", "/health"))
        bento = stack.enter_context(peer_process(
            "bentoml", [str(VENV / "bin" / "bentoml"), "serve", "service:SavedModelService", "--host", "127.0.0.1",
                        "--port", str(bento_port), "--working-dir", str(bento_dir)],
            peers_dir / "bentoml.log", bento_dir, f"127.0.0.1:{bento_port}", "/readyz"))
        (ours,) = stack.enter_context(running_servers([(flags, peers_dir / "server.log", True)]))
        mlflow.wait_until_ready()
        bento.wait_until_ready()
        endpoints = [Endpoint("mlflow", "rest", mlflow.address, "/invocations"),
                     Endpoint("bentoml", "rest", bento.address, "/predict"),
                     Endpoint("ours (rest)", "rest", ours.rest_address, f"/v1/models/{model.model_name}:predict"),
                     Endpoint("ours (grpc)", "grpc", ours.grpc_address, "")]
        diffs = {endpoint.server: check(endpoint, model, expected) for endpoint in endpoints}
        timing.progress("peers: max abs diff from the SavedModel's probabilities: "
                        + ", ".join(f"{server} {diff:.2g}" for server, diff in diffs.items()))
        rows, bento_batches = [], {}
        for clients in sizes.peer_clients:  # interleaved: every server at one client count, then the next
            for endpoint in endpoints:
                request = grpc_request if endpoint.protocol == "grpc" else rest_request
                before = bentoml_batches(bento.address) if endpoint.server == "bentoml" else None
                measured = load(endpoint.protocol, endpoint.address, request, clients, sizes, endpoint.path)
                if before is not None:
                    bento_batches[clients] = _mean_batch(before, bentoml_batches(bento.address))
                rows.append({"server": endpoint.server, "clients": clients,
                             **{key: measured[key] for key in ("qps", "p50_ms", "p90_ms", "p99_ms", "errors")},
                             "max_abs_diff": diffs[endpoint.server]})
                timing.progress(f"peers: {endpoint.server}, {clients} clients: {measured['qps']:.0f} qps, "
                                f"p50 {measured['p50_ms']:.2f} ms, p99 {measured['p99_ms']:.2f} ms"
                                f"{_batch_note(bento_batches.get(clients)) if endpoint.server == 'bentoml' else ''}"
                                f"{', ' + str(measured['errors']) + ' errors' if measured['errors'] else ''}")
    summary = judge(rows)
    return {"rows": rows, **summary, "max_abs_diff": diffs, "tolerance": TOLERANCE, "versions": versions,
            "batching_parameters": batching, "bentoml_mean_batch": bento_batches,
            "setup": {"model": str(version_dir), "policy": model.policy, "window_s": sizes.load_seconds,
                      "warmup_s": sizes.warmup_seconds, "venv": str(VENV),
                      "mlflow": "mlflow models serve --env-manager local -w 1: MLflow's scoring server "
                                "(uvicorn, 1 worker), no batching",
                      "bentoml": f"bentoml serve, 1 worker, @bentoml.api(batchable=True, "
                                 f"max_batch_size={batching['max_batch_size']}) (adaptive batching)",
                      "ours": "python -m serving --enable_batching (figure 4's batching parameters)"}}


def judge(rows: list[dict]) -> dict:
    """Fills every row's ratio_to_best_peer, target, target_met and note; returns the summary.

    The best peer is the peer with the most qps at 32 clients. A row fails if its server's
    probabilities are off by more than TOLERANCE or any of its requests failed; ours at 32 clients
    also fails below TARGET_RATIO x the best peer. Without a 32-client row (a smoke run) nothing
    compares to a best peer.
    """
    best = {}
    for row in rows:
        if row["server"] in PEERS and row["clients"] == JUDGED_CLIENTS and _valid(row):
            if row["qps"] > best.get("qps", -1.0):
                best = {"server": row["server"], "qps": row["qps"]}
    peer_qps = {(r["server"], r["clients"]): r["qps"] for r in rows if r["server"] in PEERS and _valid(r)}
    ratios = {}
    for row in rows:
        best_here = max((qps for (server, clients), qps in peer_qps.items() if clients == row["clients"]),
                        default=None)
        row["ratio_to_best_peer"] = row["qps"] / best_here if best_here else None
        notes = []
        if row["max_abs_diff"] is None or not row["max_abs_diff"] <= TOLERANCE:  # NaN fails
            notes.append(f"probabilities differ by {row['max_abs_diff']:.2g} > {TOLERANCE:g}"
                         if row["max_abs_diff"] is not None else "no probabilities")
        if row["errors"]:
            notes.append(f"{row['errors']} failed requests")
        row["target"], row["target_met"] = f"probabilities within {TOLERANCE:g}, no failed request", not notes
        if row["server"] in OURS and row["clients"] == JUDGED_CLIENTS:
            if best:
                ratio = row["qps"] / best["qps"]
                ratios[row["server"]] = ratio
                row["target"] = f">= {TARGET_RATIO:g}x {best['server']} ({best['qps']:.0f} qps)"
                if ratio < TARGET_RATIO:
                    notes.append(f"{ratio:.2f}x the best peer")
            else:
                notes.append("no peer measured correctly at 32 clients")
            row["target_met"] = not notes
        row["note"] = "; ".join(notes) or None
    return {"best_peer_32": best.get("server"), "best_peer_qps_32": best.get("qps"), "ratio_to_best_peer_32": ratios}


def _batch_note(mean: float | None) -> str:
    return f", {mean:.1f} requests per adaptive batch" if mean is not None else ""


def _valid(row: dict) -> bool:
    return row["max_abs_diff"] is not None and row["max_abs_diff"] <= TOLERANCE and not row["errors"]


def plot(figure: dict, ax) -> None:
    styles = {"mlflow": "v:", "bentoml": "^:", "ours (rest)": "s-", "ours (grpc)": "o-"}
    for server, style in styles.items():
        rows = [r for r in figure["rows"] if r["server"] == server]
        if rows:
            ax.plot([r["clients"] for r in rows], [r["qps"] for r in rows], style, label=server)
    qps_axes(ax, "peers: the same model behind MLflow, BentoML and ours")


# --- the peers' virtual environment ------------------------------------------------------------------

def ensure_venv(venv: Path = VENV, requirements: Path = REQUIREMENTS) -> Path:
    """Creates venv with this Python and installs requirements into it, once; returns its python.

    A stamp file records what was installed: a changed requirements file or Python reinstalls.
    Raises RuntimeError with one line (the install's last error line, the log's path) if pip fails.
    """
    python = venv / "bin" / "python"
    stamp, log = venv / ".bench-installed", venv / "install.log"
    wanted = f"{sys.version}\n{requirements.read_text()}"
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    started = time.perf_counter()
    if not python.exists():
        timing.progress(f"peers: creating {venv} (python -m venv, {sys.version.split()[0]})")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    timing.progress(f"peers: installing {requirements.name} into {venv.name} (once; a minute or more, log {log})")
    with open(log, "w") as out:
        result = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check",
                                 "-r", str(requirements)], stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        errors = [line.strip() for line in log.read_text(errors="replace").splitlines() if "ERROR" in line]
        raise RuntimeError(f"could not install the peer servers into {venv} (pip exit {result.returncode}: "
                           f"{errors[-1] if errors else 'no error line'}); log: {log}")
    stamp.write_text(wanted)
    timing.progress(f"peers: installed in {time.perf_counter() - started:.0f} s")
    return python


def installed_versions(python: Path) -> dict:
    code = ("import importlib.metadata as m, json\n"
            "out = {}\n"
            "for name in ('mlflow', 'bentoml', 'tensorflow-cpu', 'tensorflow'):\n"
            "    try: out[name] = m.version(name)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))")
    return json.loads(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout)


def peer_env(peers_dir: Path) -> dict:
    """The environment a peer runs in: the peers' venv first on PATH (MLflow starts `uvicorn` by name),
    none of the project's Python path, TensorFlow as quiet as ours and with the same threads, no usage tracking, BentoML's home
    (its state and logs) in the run's directory rather than ~/bentoml."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(VENV),
               TF_CPP_MIN_LOG_LEVEL=env.get("TF_CPP_MIN_LOG_LEVEL", "2"), BENTOML_DO_NOT_TRACK="True",
               MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1",
               BENTOML_HOME=str(peers_dir / "bentoml-home"),
               # The same TensorFlow threads as our servers (serving_throughput.SERVER_THREADS), read by
               # TensorFlow from the environment when it sizes its pools.
               TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    return env


# --- the peers' model files --------------------------------------------------------------------------

MLFLOW_MODEL_SOURCE = '''"""MLflow pyfunc model (models from code) written by bench/peers.py: the SavedModel
artifact's serving_default signature, returning its {output!r} output."""

import mlflow
import numpy as np


class SavedModelPyfunc(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        import tensorflow as tf

        self._tf = tf
        self._loaded = tf.saved_model.load(context.artifacts["saved_model"])
        self._signature = self._loaded.signatures["serving_default"]

    def predict(self, context, model_input, params=None):
        batch = self._tf.constant(np.asarray(model_input, dtype=np.float32))
        return self._signature(**{{{input!r}: batch}})[{output!r}].numpy()


mlflow.models.set_model(SavedModelPyfunc())
'''

MLFLOW_SAVE_SOURCE = '''"""Saves the MLflow pyfunc model (written by bench/peers.py; run with the peers' venv)."""

import sys

import mlflow
import numpy as np
from mlflow.models import ModelSignature
from mlflow.types import Schema, TensorSpec

code, saved_model, destination = sys.argv[1:4]
signature = ModelSignature(inputs=Schema([TensorSpec(np.dtype(np.float32), {input_shape!r})]),
                           outputs=Schema([TensorSpec(np.dtype(np.float32), {output_shape!r})]))
mlflow.pyfunc.save_model(destination, python_model=code, artifacts={{"saved_model": saved_model}},
                         signature=signature, pip_requirements={requirements!r})
'''

BENTO_SERVICE_SOURCE = '''"""BentoML service written by bench/peers.py: the SavedModel's serving_default
signature behind one batchable API (BentoML's adaptive batching), returning its {output!r} output."""

import bentoml
import numpy as np

SAVED_MODEL = {saved_model!r}


@bentoml.service(workers=1)
class SavedModelService:
    def __init__(self) -> None:
        import tensorflow as tf

        self._tf = tf
        self._loaded = tf.saved_model.load(SAVED_MODEL)
        self._signature = self._loaded.signatures["serving_default"]

    @bentoml.api(batchable=True, batch_dim=0, max_batch_size={max_batch_size!r})
    def predict(self, instances: np.ndarray) -> np.ndarray:
        batch = self._tf.constant(np.asarray(instances, dtype=np.float32))
        return self._signature(**{{{input!r}: batch}})[{output!r}].numpy()
'''


def mlflow_model_source(model) -> str:
    return MLFLOW_MODEL_SOURCE.format(input=model.input_name, output=OUTPUT)


def mlflow_save_source(model, output_classes: int, requirements: list[str]) -> str:
    return MLFLOW_SAVE_SOURCE.format(input_shape=(-1, *model.rows.shape[1:]), output_shape=(-1, output_classes),
                                     requirements=requirements)


def bento_service_source(model, version_dir: Path, max_batch_size: int) -> str:
    return BENTO_SERVICE_SOURCE.format(saved_model=str(version_dir), input=model.input_name, output=OUTPUT,
                                       max_batch_size=max_batch_size)


def save_mlflow_model(python: Path, peers_dir: Path, version_dir: Path, model, classes: int) -> Path:
    """Writes the pyfunc's code and saves the MLflow model (the SavedModel copied in as its artifact)."""
    source_dir, destination = peers_dir / "mlflow-src", peers_dir / "mlflow-model"
    source_dir.mkdir(exist_ok=True)
    shutil.rmtree(destination, ignore_errors=True)
    code, save = source_dir / "saved_model_pyfunc.py", source_dir / "save.py"
    code.write_text(mlflow_model_source(model))
    save.write_text(mlflow_save_source(model, classes, _pinned(("mlflow", "tensorflow"))))
    timing.progress("peers: saving the MLflow pyfunc model")
    result = subprocess.run([str(python), str(save), str(code), str(version_dir), str(destination)],
                            env=peer_env(peers_dir), cwd=source_dir, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"saving the MLflow model failed: {_last_line(result.stderr)}")
    return destination


def write_bento_service(peers_dir: Path, version_dir: Path, model, max_batch_size: int) -> Path:
    bento_dir = peers_dir / "bentoml-src"
    bento_dir.mkdir(exist_ok=True)
    (bento_dir / "service.py").write_text(bento_service_source(model, version_dir, max_batch_size))
    return bento_dir


def _pinned(names: tuple[str, ...]) -> list[str]:
    """The requirement lines of REQUIREMENTS naming these packages (markers kept): the model's pip requirements."""
    lines = [line.strip() for line in REQUIREMENTS.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    return [line for line in lines if line.split("==")[0].strip().split("-")[0] in names]


# --- requests and the correctness check --------------------------------------------------------------

def reference_probabilities(version_dir: Path, model):
    """The SavedModel's own probabilities for model.rows[:1], called in this process."""
    import tensorflow as tf

    signature = tf.saved_model.load(str(version_dir)).signatures["serving_default"]
    return signature(**{model.input_name: tf.constant(model.rows[:1])})[OUTPUT].numpy()[0]


def check(endpoint: Endpoint, model, expected) -> float:
    """Sends model.rows[:1] alone; the max abs difference of the returned probabilities from expected."""
    import numpy as np

    row = model.rows[:1]
    if endpoint.protocol == "grpc":
        from serving.client.grpc_client import predict_rows

        got = predict_rows(endpoint.address, model.model_name, model.input_name, row, 1)[OUTPUT]
    else:
        status, body = http_post(endpoint.address, endpoint.path, json.dumps({"instances": row.tolist()}).encode())
        if status != 200:
            raise RuntimeError(f"{endpoint.server} answered the check request with HTTP {status}: {body[:200]!r}")
        got = probabilities(json.loads(body))
    got = np.asarray(got, dtype=np.float64).reshape(-1)
    if got.shape != expected.shape:
        raise RuntimeError(f"{endpoint.server} returned {got.size} probabilities, the SavedModel {expected.size}")
    return float(np.max(np.abs(got - expected)))


def probabilities(payload):
    """The first row's probabilities from a JSON response: ours {"predictions": [{"probabilities": [...], ...}]},
    MLflow {"predictions": [[...]]}, BentoML [[...]]."""
    if isinstance(payload, dict):
        if "predictions" not in payload:
            raise ValueError(f"no predictions in {str(payload)[:200]}")
        payload = payload["predictions"]
    if isinstance(payload, dict):  # columns: {"probabilities": [[...]], ...}
        payload = payload[OUTPUT]
    first = payload[0]
    return first[OUTPUT] if isinstance(first, dict) else first


def http_post(address: str, path: str, body: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
    host, _, port = address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def bentoml_batches(address: str) -> tuple[float, float] | None:
    """(sum, count) of BentoML's adaptive-batch-size histogram from its /metrics (None if absent): the
    batches its dispatcher formed, to show that its batching is on."""
    host, _, port = address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        text = response.read().decode(errors="replace")
    except OSError:
        return None
    finally:
        connection.close()
    totals = {}
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name == f"bentoml_service_adaptive_batch_size{suffix}":
                totals[suffix] = totals.get(suffix, 0.0) + float(line.rsplit(" ", 1)[1])
    return (totals["_sum"], totals["_count"]) if len(totals) == 2 else None


def _mean_batch(before: tuple[float, float], after: tuple[float, float] | None) -> float | None:
    """Mean requests per batch between two bentoml_batches readings."""
    if after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


# --- peer processes ----------------------------------------------------------------------------------

class PeerProcess:
    """A peer server started in a session of its own, so that it and every process it starts are stopped."""

    def __init__(self, name: str, command: list[str], log_path: Path, cwd: Path, address: str, ready_path: str):
        self.name, self.log_path, self.address, self.ready_path = name, log_path, address, ready_path
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                            env=peer_env(log_path.parent),
                                            start_new_session=True)

    def wait_until_ready(self, timeout_s: float = START_TIMEOUT_S) -> "PeerProcess":
        """Polls GET ready_path until it answers 200; raises with the log's last line if the peer exits or times out."""
        host, _, port = self.address.rpartition(":")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with code {self.process.returncode}: "
                                   f"{_last_line(self.log_path.read_text(errors='replace'))} (log: {self.log_path})")
            connection = http.client.HTTPConnection(host, int(port), timeout=2)
            try:
                connection.request("GET", self.ready_path)
                response = connection.getresponse()
                response.read()
                if response.status == 200:
                    return self
            except OSError:
                pass
            finally:
                connection.close()
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} server not ready after {timeout_s:.0f} s (log: {self.log_path})")

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to the peer's process group (MLflow's uvicorn, BentoML's arbiter, which stops its workers),
        then SIGKILL to whatever it started that is still alive: BentoML's workers run in sessions of their own."""
        started = _descendants(self.process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        deadline = time.monotonic() + timeout_s
        while any(_alive(pid, start) for pid, start in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid, start in started:
            if _alive(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) from /proc (empty where there is no /proc)."""
    table = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(entry.name)] = (int(fields[1]), fields[19])
    return table


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process below pid."""
    children: dict[int, list[int]] = {}
    table = _process_table()
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append((child, table[child][1]))
            stack.append(child)
    return found


def _alive(pid: int, start: str) -> bool:
    """pid still runs and is the same process (its start time has not changed)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[19] == start and fields[0] != "Z"


@contextlib.contextmanager
def peer_process(name: str, command: list[str], log_path: Path, cwd: Path, address: str,
                 ready_path: str) -> Iterator[PeerProcess]:
    peer = PeerProcess(name, command, log_path, cwd, address, ready_path)
    try:
        yield peer
    finally:
        peer.stop()


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"
