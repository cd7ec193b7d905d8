"""`make compare`: float32 against the config's mixed policy (and bfloat16), each trained in its own process."""

from pipeline.compare.run import compare

__all__ = ["compare"]
