"""One loaded model version and how a request runs on it: load, check once, run (TF Serving's servables/tensorflow/).

runner.py loads a version and runs checked model calls; saved_model.py reads what is on disk; tensors.py is the
TensorProto codec and the one table of dtype facts; inference.py checks Predict, Classify, Regress and
MultiInference requests and builds their responses; examples.py turns tf.Example inputs into rows; warmup.py
replays a version's warmup requests. Nothing here knows of gRPC servers, batching or model lists.
"""
