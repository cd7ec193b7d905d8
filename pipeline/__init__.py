"""Mixed-precision train-and-serve pipeline: the public API.

    cfg = load_config("configs/default.yaml", ["train.epochs=3"])
    run = train(cfg)                 # runs/<experiment>/
    version_dir = export(cfg)        # models/<model_name>/<version>/
    Runner.load(version_dir).predict({"features": rows})
    score(version_dir, ["rows-*.csv"], "build/scored")      # Parquet predictions (docs/batch.md)
    audit("models/digits_mlp", ["requests-*.tfrecord"])      # served answers vs float32 (docs/batch.md)

Attributes load lazily so that `import pipeline` (and config errors) do not wait for TensorFlow.
`pipeline/` imports `serving/`, never the reverse (docs/architecture.md).
"""

import importlib
import types

from pipeline.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config", "train", "export", "score", "audit", "Runner"]


class LazyPackage(types.ModuleType):
    """A package whose exported names load from its modules on first use (PEP 562's module __getattr__), so
    importing one of its modules does not import the rest: the CLI reads the data service's defaults without
    loading TensorFlow, a building block (pipeline.train.accumulation) imports without its verb's recipe, and
    nothing imports in a circle. A package sets `sys.modules[__name__].__class__` and `.exports`."""

    exports: dict[str, str] = {}  # name → the module of the package that defines it

    def __getattr__(self, name: str):
        module = self.exports.get(name)
        if module is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{self.__name__}.{module}"), name)
        setattr(self, name, value)
        return value


class VerbPackage(LazyPackage):
    """A verb's sub-package that can be called as its entry point: `pipeline.train(cfg)`.

    Importing pipeline/train/ binds the name `train` on this package to the sub-package, which would
    shadow the function of the same name; calling the package calls the function, so the public API
    `from pipeline import train; train(cfg)` works whether or not the sub-package was imported first.
    """

    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)


def __getattr__(name: str):
    if name in ("train", "export", "score", "audit"):
        return importlib.import_module(f"pipeline.{name}")  # a VerbPackage
    if name == "Runner":
        from serving.servable.runner import Runner

        return Runner
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
