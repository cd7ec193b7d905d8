"""`python -m serving FLAGS`: tensorflow_model_server's flags (serving/flags.py), then the server (serving/app.py).

The flags are checked before TensorFlow loads, so a bad one costs a fraction of a second; TensorFlow's
start-up INFO lines stay out of the log unless TF_CPP_MIN_LOG_LEVEL is set (serving/tf_log.py).
"""

import sys

from serving import flags, tf_log


def main(argv: list[str] | None = None) -> int:
    options = flags.parse(argv)  # a bad flag exits 2 here
    tf_log.quiet_tensorflow("1")
    from serving import app  # imports TensorFlow, now quieted

    return app.run(options)


if __name__ == "__main__":
    sys.exit(main())
