"""`python -m pipeline audit`: a server's request log replayed through the float32 twin of the served version."""

from pipeline.audit.run import audit, print_report

__all__ = ["audit", "print_report"]
