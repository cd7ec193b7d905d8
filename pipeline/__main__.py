"""`python -m pipeline`: quiets TensorFlow's C++ start-up log unless the user chose its level, then runs the CLI.

Level 3 (serving/tf_log.py): a command's output starts with the pipeline's own lines; the processes it
starts (compare's trainings, the demo's server) inherit it. What the hidden lines said about float16 and
bfloat16 support, training says once in its own words.
"""

import sys

from pipeline.cli import main
from serving import tf_log

if __name__ == "__main__":
    tf_log.quiet_tensorflow("3")
    sys.exit(main())
