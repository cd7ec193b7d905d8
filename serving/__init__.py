"""A TF Serving-compatible gRPC/REST model server: PredictionService, ModelService, health, over serving.servable.runner.

It knows nothing of YAML or training, and imports nothing from pipeline/ (docs/architecture.md)."""
