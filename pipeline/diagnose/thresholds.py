"""float16's range, and the thresholds diagnose judges activations, gradients and divergence by."""

FLOAT16_MAX = 65504.0
FLOAT16_MIN_NORMAL = 6.1e-5  # 2**-14
FLOAT16_MIN_SUBNORMAL = 6e-8  # 2**-24: smaller magnitudes round to zero
# Flushing a few tiny gradients to zero is harmless; a sizeable share means updates that never happen.
GRADIENT_ZERO_WARNING = 0.05
AT_RISK_SHOWN = 10
AT_RISK_UNDERFLOW = 0.01
# The highest loss scale a fix suggests: well past any scale dynamic scaling reaches on a healthy run.
MAX_SUGGESTED_SCALE = 2 ** 24
# float16 keeps ~3 significant digits (2**-11 relative); rounding through a few layers stays well under 1%.
DIVERGENCE_TOLERANCE = 1e-2
# The input-limits probe tries each feature alone at both ends; past this many features, a fixed sample of them.
EDGE_MAX_FEATURES = 1024
# ... and probes the same rows this many training ranges past either end: inputs no client should send, which a
# served model must still answer with finite numbers.
FAR_BEYOND = 100.0
# Smallest normal number per compute dtype: a constant below it (an epsilon, a divisor) is subnormal or zero there.
SMALLEST_NORMAL = {"float16": 2.0 ** -14, "bfloat16": 2.0 ** -126, "float32": 2.0 ** -126, "float64": 2.0 ** -1022}
LARGEST_FINITE = {"float16": FLOAT16_MAX, "bfloat16": 3.39e38, "float32": 3.4e38, "float64": 1.8e308}
