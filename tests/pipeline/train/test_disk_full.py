"""A full disk is one line (issue 23): "no space left on device" with the path and what was kept, exit 1, no
traceback, the run resumable from its newest complete checkpoint. ENOSPC is raised where the real writers are
(the checkpoint publisher, model.keras), as Python's OSError and as TensorFlow's error with its OOM hint."""

import errno
import logging

import pytest
import tensorflow as tf

from pipeline import artifacts, cli
from pipeline.config import load_config
from pipeline.errors import DiskFullError
from pipeline.train import checkpoints, train
from pipeline.train import run as train_run

pytestmark = pytest.mark.timeout(300)


def _overrides(tmp_path, *more):
    return ["experiment=full", "train.epochs=3", "model.hidden_units=[16]", f"train.runs_dir={tmp_path}",
            "train.checkpoint_every_steps=0", *more]


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_run_resumes(tmp_path, monkeypatch, capsys, caplog):
    publish, published = checkpoints.Checkpointer.publish, []

    def publish_until_full(self, staged):
        if published:  # the second checkpoint: the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", str(staged.final))
        published.append(staged.final)
        return publish(self, staged)

    monkeypatch.setattr(checkpoints.Checkpointer, "publish", publish_until_full)
    code = cli.main(["train", "configs/default.yaml", *(f"--set={o}" for o in _overrides(tmp_path))])
    out, err = capsys.readouterr()
    [first] = published
    assert code == 1 and "Traceback" not in out + err
    assert err.strip().splitlines()[-1] == (
        f"error: no space left on device writing {tmp_path / 'full' / 'checkpoints'}/"
        f"{first.name[:5]}{int(first.name[5:]) * 2:09d}: kept {first} (epoch 1, step {int(first.name[5:])}), "
        "complete; the same command resumes from it; free space on that filesystem and run the same command again")
    assert not (tmp_path / "full" / "model.keras").exists()
    monkeypatch.undo()
    with caplog.at_level(logging.INFO, logger="pipeline.train.run"):
        train(load_config(None, _overrides(tmp_path)))
    assert any(m.startswith(f"resuming from {first}: ") for m in caplog.messages), caplog.messages
    assert (tmp_path / "full" / "model.keras").is_file() and (tmp_path / "full" / "metrics.json").is_file()


def test_tensorflows_disk_full_error_is_recognised_too(tmp_path, monkeypatch):
    # What TensorFlow's writers raise: a ResourceExhaustedError whose hint says OOM, ENOSPC only in its text.
    def full(model, path):
        raise tf.errors.ResourceExhaustedError(None, None, f"{path}; No space left on device [Op:SaveV2] "
                                               "Hint: If you want to see a list of allocated tensors when OOM happens")

    monkeypatch.setattr(train_run, "_save_model", full)
    with pytest.raises(DiskFullError) as stopped:
        train(load_config(None, _overrides(tmp_path, "train.epochs=1")))
    message = str(stopped.value)
    assert message.startswith(f"no space left on device writing {tmp_path / 'full'}: kept ")
    assert "(epoch 1, step " in message and "OOM" not in message and len(message.splitlines()) == 1


def test_other_errors_pass_unchanged():
    assert not artifacts.is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert artifacts.is_disk_full(RuntimeError("wrapped").with_traceback(None)) is False
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as cause:
            raise RuntimeError("callback failed") from cause
    except RuntimeError as wrapped:
        assert artifacts.is_disk_full(wrapped)
