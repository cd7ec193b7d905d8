"""`python -m pipeline score`: batch predictions for files of rows on the batch engine (pipeline/engine.py)."""

from pipeline.score.run import print_summary, score

__all__ = ["score", "print_summary"]
