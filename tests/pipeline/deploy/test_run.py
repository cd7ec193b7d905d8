"""`pipeline deploy`: what the kit holds, that it is written whole or not at all, the same bytes on a re-run,
and one-line errors (exit 2) for input it cannot use."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format
from manifest_checks import load_resources
from tensorflow_serving.config import model_server_config_pb2

from pipeline.config import load_config
from pipeline.deploy import DeploySettings, deploy
from pipeline.deploy import run as deploy_run
from pipeline.errors import DeployError, DiskFullError

REPO = Path(__file__).resolve().parents[3]


def _tree(directory: Path) -> dict[str, str]:
    return {path.relative_to(directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def test_the_kit_holds_the_recipe_the_models_and_both_servers_manifests(kit, exported_model):
    files = _tree(kit)
    version = exported_model.version_dir.name
    assert {name for name in files if not name.startswith(("src/", "models/tiny_digits"))} == {
        ".pipeline-deploy-kit", "Containerfile", "README.md",
        "models/models.config", "models/batching.config", "models/monitoring.config",
        *[f"kubernetes/{server}/{name}.yaml" for server in ("mixed-precision-serving", "tensorflow-serving")
          for name in ("configmap", "deployment", "service", "hpa", "pdb")],
        *[f"kubernetes/data-service/{name}.yaml" for name in ("dispatcher-statefulset", "dispatcher-service",
                                                              "worker-statefulset", "worker-service", "worker-pdb",
                                                              "networkpolicy")],
        *[f"kserve/{server}/{name}.yaml" for server in ("mixed-precision-serving", "tensorflow-serving")
          for name in ("servingruntime", "inferenceservice-tiny-digits", "inferenceservice-tiny-digits-b")]}
    # The served version of each model, byte for byte, and the project's source with no caches.
    for model in ("tiny_digits", "tiny_digits_b"):
        copied = _tree(kit / "models" / model / version)
        assert copied == _tree(exported_model.version_dir) and "saved_model.pb" in copied
    assert {"src/pyproject.toml", "src/README.md", "src/serving/__main__.py", "src/pipeline/cli.py"} <= set(files)
    assert not [name for name in files if "__pycache__" in name or name.endswith(".pyc")]
    config = text_format.Parse((kit / "models/models.config").read_text(), model_server_config_pb2.ModelServerConfig())
    assert [(c.name, c.base_path) for c in config.model_config_list.config] == [
        ("tiny_digits", f"{kit}/models/tiny_digits"), ("tiny_digits_b", f"{kit}/models/tiny_digits_b")]


def test_the_configmap_holds_the_files_the_image_holds(kit):
    [config_map] = load_resources(kit / "kubernetes/mixed-precision-serving/configmap.yaml")
    assert config_map["immutable"] is True
    assert config_map["data"] == {name: (kit / "models" / name).read_text()
                                  for name in ("batching.config", "models.config", "monitoring.config")}


def test_a_rerun_writes_the_same_bytes_and_a_new_export_a_new_image_tag(kit, tiny_config, tmp_path, exported_model):
    settings = DeploySettings(container_base=str(kit / "models"))
    other = load_config(None, [f"export.base_path={kit.parent / 'deploy-models'}", "export.model_name=tiny_digits_b"])
    again = deploy([tiny_config, other], tmp_path / "again", settings, sources=["tiny.yaml", "tiny_b.yaml"])
    assert _tree(again) == _tree(kit)

    copy = tmp_path / "models"
    shutil.copytree(exported_model.base_path, copy / "tiny_digits")
    cfg = load_config(None, [f"export.base_path={copy}", "export.model_name=tiny_digits"])
    first = deploy([cfg], tmp_path / "kit", settings, sources=["tiny.yaml"])
    image = _image(first)
    assert image.startswith("mixed-precision-serving:sha-")
    shutil.copytree(exported_model.version_dir, copy / "tiny_digits" / "99")  # a new version: what the image holds changes
    assert _image(deploy([cfg], tmp_path / "kit", settings, sources=["tiny.yaml"])) != image
    pinned = DeploySettings(image="registry.example.com:5000/team/serving:v7", container_base=str(kit / "models"))
    assert _image(deploy([cfg], tmp_path / "kit", pinned)) == "registry.example.com:5000/team/serving:v7"


def _image(kit: Path) -> str:
    [deployment] = load_resources(kit / "kubernetes/mixed-precision-serving/deployment.yaml")
    return deployment["spec"]["template"]["spec"]["containers"][0]["image"]


def test_a_failure_while_writing_leaves_the_previous_kit_whole(kit, tiny_config, tmp_path, monkeypatch):
    output = tmp_path / "kit"
    deploy([tiny_config], output, sources=["tiny.yaml"])
    before = _tree(output)
    copies, real_copyfile = 0, shutil.copyfile

    def copy_then_die(source, destination):
        nonlocal copies
        copies += 1
        if copies == 3:
            raise OSError(28, "No space left on device")
        return real_copyfile(source, destination)

    monkeypatch.setattr(deploy_run.shutil, "copyfile", copy_then_die)
    with pytest.raises(DiskFullError, match=f"^no space left on device writing .*: nothing was published at {output} "
                       r"\(its temporary directory is removed; what was there before is untouched\)"):
        deploy([tiny_config], output, DeploySettings(memory="4Gi"), sources=["tiny.yaml"])
    assert _tree(output) == before
    assert [p.name for p in tmp_path.iterdir()] == ["kit"]  # no temporary left beside it


@pytest.mark.parametrize("settings, message", [
    (DeploySettings(min_replicas=3, max_replicas=2), "--min_replicas/--max_replicas: expected 1 <= min <= max, got 3 and 2"),
    (DeploySettings(memory="2GB"), "--memory: expected a quantity in Mi or Gi such as 2Gi, got '2GB'"),
    (DeploySettings(cpu=0), "--cpu: expected whole cores (1 or more), got 0"),
    (DeploySettings(image="Serving Image"), "--image: expected a lowercase image repository"),
    (DeploySettings(models_pvc="Models_Claim"), "--models_pvc: expected a PersistentVolumeClaim name"),
    (DeploySettings(storage_uri="/mnt/models"), "--storage_uri: expected a KServe storage URI"),
    (DeploySettings(container_base="models"), "--container_base: expected an absolute directory other than /"),
    (DeploySettings(grace_period_s=0), "--grace_period_s: expected seconds in (0, 3600], got 0"),
    (DeploySettings(data_service_workers=0), "--data_service_workers: expected 1 or more workers, got 0"),
    (DeploySettings(data_service_worker_cpu=0), "--data_service_worker_cpu: expected whole cores (1 or more), got 0"),
    (DeploySettings(data_service_worker_memory="4G"),
     "--data_service_worker_memory: expected a quantity in Mi or Gi such as 2Gi, got '4G'"),
    (DeploySettings(data_service_journal_size="1TB"),
     "--data_service_journal_size: expected a quantity in Mi or Gi such as 1Gi, got '1TB'"),
    (DeploySettings(data_service_pvc="Training_Data"), "--data_service_pvc: expected a PersistentVolumeClaim name"),
    (DeploySettings(data_service_mount="/tmp"), "--data_service_mount: expected an absolute directory other than / "
                                                "and /tmp, got '/tmp'"),
    (DeploySettings(data_service_mount="data"), "--data_service_mount: expected an absolute directory"),
])
def test_bad_settings_are_one_line_each_and_nothing_is_written(tiny_config, tmp_path, settings, message):
    with pytest.raises(DeployError, match=r"^" + message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]").replace("+", r"\+")):
        deploy([tiny_config], tmp_path / "kit", settings)
    assert not (tmp_path / "kit").exists()


def test_a_bad_batching_file_or_an_output_that_is_not_a_kit_is_refused(tiny_config, exported_model, tmp_path):
    bad = tmp_path / "batching.txt"
    bad.write_text("max_batch_size { value: 8 }\nallowed_batch_sizes: 4\n")
    with pytest.raises(DeployError, match=r"^--batching_parameters_file: .*Last entry in allowed_batch_sizes must "
                                          r"match max_batch_size"):
        deploy([tiny_config], tmp_path / "kit", DeploySettings(batching_parameters_file=str(bad)))
    good = tmp_path / "good.txt"
    good.write_text("max_batch_size { value: 8 }\nallowed_batch_sizes: 4\nallowed_batch_sizes: 8\n")
    deploy([tiny_config], tmp_path / "kit", DeploySettings(batching_parameters_file=str(good)))
    assert (tmp_path / "kit/models/batching.config").read_text() == good.read_text()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DeployError, match=r"--output .*/mine: exists and is not a kit written by deploy"):
        deploy([tiny_config], tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_model_names_kubernetes_cannot_take_are_refused(exported_model, tmp_path):
    configs = []
    for name in ("digits_v1", "digits-v1"):
        shutil.copytree(exported_model.base_path, tmp_path / "models" / name)
        configs.append(load_config(None, [f"export.base_path={tmp_path / 'models'}", f"export.model_name={name}"]))
    with pytest.raises(DeployError, match=r"^models 'digits-v1' and 'digits_v1' both become the Kubernetes name 'digits-v1'"):
        deploy(configs, tmp_path / "kit")
    shutil.copytree(exported_model.base_path, tmp_path / "models" / "2025_digits")
    early = load_config(None, [f"export.base_path={tmp_path / 'models'}", "export.model_name=2025_digits"])
    with pytest.raises(DeployError, match=r"^model '2025_digits' makes no Kubernetes name \(a letter first"):
        deploy([early], tmp_path / "kit")


@pytest.mark.subprocess  # the CLI in a child process
def test_cli_refuses_a_config_never_exported_with_exit_2_then_writes_the_kit(exported_model, tmp_path):
    models = tmp_path / "models"
    configs = []
    for name in ("digits_a", "digits_b"):
        configs.append(tmp_path / f"{name}.yaml")
        configs[-1].write_text(f"experiment: {name}\nexport: {{base_path: {models}}}\n")
    shutil.copytree(exported_model.base_path, models / "digits_a")
    argv = [sys.executable, "-m", "pipeline", "deploy", *map(str, configs), "--output", str(tmp_path / "kit"), "--cpu", "4",
            "--data_service_workers", "3", "--data_service_pvc", "training-data"]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr.splitlines() == [f"error: {configs[1]}: digits_b has no exported version under "
                                           f"{models}/digits_b (make export CONFIG={configs[1]}); nothing was written"]
    assert not (tmp_path / "kit").exists()

    shutil.copytree(exported_model.base_path, models / "digits_b")
    written = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert (written.returncode, written.stdout) == (0, f"{tmp_path / 'kit'}\n"), written.stderr
    [deployment] = load_resources(tmp_path / "kit/kubernetes/mixed-precision-serving/deployment.yaml")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "4"
    [workers] = load_resources(tmp_path / "kit/kubernetes/data-service/worker-statefulset.yaml")
    assert workers["spec"]["replicas"] == 3
    assert workers["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "training-data"
