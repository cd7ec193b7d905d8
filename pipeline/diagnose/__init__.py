"""`pipeline diagnose`: where a model is at risk under its mixed-precision policy, and the fix for each risk."""

from pipeline.diagnose.run import Diagnosis, diagnose, print_diagnosis

__all__ = ["diagnose", "print_diagnosis", "Diagnosis"]
