"""`make bench`: the numbers that show whether the pipeline is fast, each as a ratio to its yardstick.

Five figures, measured side by side in one run (absolute times on shared machines drift, ratios
measured a few seconds apart do not): training overhead, precision speed-ups, inference path
overhead, serving throughput and latency, memory. See bench/README.md.

This module stays free of TensorFlow imports: load-generator processes import the package too.
"""
