"""`pipeline diagnose`: where a model is at risk under its mixed-precision policy, and the fix for each risk."""

from pipeline.diagnose.findings import Diagnosis, print_diagnosis
from pipeline.diagnose.run import diagnose

__all__ = ["diagnose", "print_diagnosis", "Diagnosis"]
