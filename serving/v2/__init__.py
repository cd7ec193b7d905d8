"""The Open Inference Protocol ("KServe v2"; KServe, Triton, MLServer speak it) on the server's own ports, for
every model it loads: REST under /v2 (rest.py) and gRPC's inference.GRPCInferenceService (grpc_service.py),
both answered by service.py, which turns an inference request into the PredictRequest TF Serving's clients
send, so limits, batching, metrics and the request log are those of Predict (docs/serving.md#kserve-v2).
"""
