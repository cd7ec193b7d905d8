"""The pipeline's failure kinds: each costs the user one line and an exit code, not a traceback.

Light on purpose (no TensorFlow import), so that the CLI can choose an exit code by exception class.
ConfigError (pipeline/config.py), DataError (CheckpointError with it) and DeployError are the user's input (exit 2);
the rest exit 1.
"""


class PipelineError(Exception):
    """A failure the pipeline explains in one line: the CLI prints it and exits 1."""


class DataError(PipelineError):
    """A data problem a user must fix (missing file, wrong columns, mismatched shapes, bad labels)."""


class CheckpointError(DataError):
    """A pretrained checkpoint (pipeline/lm/gpt2.py) that cannot be read as it claims to be: the user's file, exit 2."""


class ModelError(PipelineError):
    """A model that breaks the pipeline's contract (a float16 output, a builder that is not usable)."""


class TrainingError(PipelineError):
    """Training could not produce a usable model."""


class ExportError(PipelineError):
    """The run cannot be exported (not trained, config mismatch, parity or dtype check failed)."""


class ParityError(PipelineError):
    """A path on the golden batch disagrees beyond what its rule allows."""


class ClientError(PipelineError):
    """A request the model server refused or could not take; one line with the address, code and message."""


class DeployError(PipelineError):
    """Input `pipeline deploy` cannot make a kit from: a model never exported, a bad flag, an output it must not replace."""


class EngineError(PipelineError):
    """The batch engine could not start or reach its cluster (pipeline/score/engine.py)."""


class DiskFullError(PipelineError):
    """The disk filled up while writing (ENOSPC): one line with the path and what was kept (artifacts.disk_full_is_one_line)."""
