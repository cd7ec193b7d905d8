"""What callers of a model server use, never the server itself: a TF Serving gRPC client: request builders and predict_rows (grpc_client.py) and
`python -m serving` as a child process (process.py), for the pipeline, the bench and the tests."""
