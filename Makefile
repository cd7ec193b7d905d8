# Every target is a thin wrapper over `python -m pipeline ...` and depends on the .venv bootstrap,
# which reinstalls only when pyproject.toml changes.
CONFIG ?= configs/default.yaml
ARGS ?=
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
SETUP := $(VENV)/.installed

.PHONY: setup train export serve predict demo compare deploy score audit example-data bench bench-quick test test-fast test-numerics clean

$(SETUP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $@

setup: $(SETUP)

train: $(SETUP)
	$(PY) -m pipeline train $(CONFIG) $(ARGS)

export: $(SETUP)
	$(PY) -m pipeline export $(CONFIG) $(ARGS)

serve: $(SETUP)
	$(PY) -m pipeline serve $(CONFIG) $(ARGS)

predict: $(SETUP)
	$(PY) -m pipeline predict $(CONFIG) $(ARGS)

# configs/gpt2_finetune.yaml fine-tunes build/gpt2-random/, a random-initialised GPT-2 written here once (docs/pretrained.md)
demo: $(SETUP) $(if $(findstring gpt2_finetune,$(CONFIG)),build/gpt2-random)
	$(PY) -m pipeline demo $(CONFIG) $(ARGS)

build/gpt2-random: | $(SETUP)
	$(PY) -m pipeline gpt2-checkpoint --output $@

compare: $(SETUP)
	$(PY) -m pipeline compare $(CONFIG) $(ARGS)

# The deployment kit (docs/deploying.md) for the shipped configs whose data ships too (mnist_mlp needs a
# data/mnist.npz you supply); each must be exported first (make export CONFIG=...).
DEPLOY_CONFIGS ?= configs/default.yaml configs/digits_cnn.yaml configs/diabetes_mlp.yaml
deploy: $(SETUP)
	$(PY) -m pipeline deploy $(DEPLOY_CONFIGS) --output build/deploy $(ARGS)

# Batch jobs on the local engine (docs/batch.md); they take a MODEL_DIR, not a CONFIG:
#   make score ARGS="models/digits_mlp --input 'data/rows-*.csv' --output build/scored"
#   make audit ARGS="models/digits_mlp --log '/var/log/serving/requests-digits_mlp-*.tfrecord'"
score: $(SETUP)
	$(PY) -m pipeline score $(ARGS)

audit: $(SETUP)
	$(PY) -m pipeline audit $(ARGS)

# scikit-learn's digits as a folder of PNG files per class and as CSV shards, under data/ (docs/data.md).
example-data: $(SETUP)
	$(PY) -m pipeline example-data data $(ARGS)

bench: $(SETUP)
	$(PY) -m bench $(ARGS)

# Smoke run: writes build/bench-quick/ (git-ignored), never bench/results/ or bench/README.md.
bench-quick: $(SETUP)
	$(PY) -m bench --quick $(ARGS)

# Test processes (pytest-xdist): one per core. Each takes whole test files (--dist loadfile), so a module's fixtures
# (its servers, its trained model) are made once; TEST_WORKERS=0 runs the suite in this process (docs/testing.md).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# The whole suite: what CI runs (.ci/run) and what the README gives.
test: $(SETUP)
	$(PYTEST) $(ARGS)

# The inner loop: everything except tests that start a model server or a training in a child process.
test-fast: $(SETUP)
	$(PYTEST) -m "not subprocess" $(ARGS)

# The tests that compare numbers (parity, served answers, audit, verify, score) again on Eigen's kernels, oneDNN's
# off: the kernel path of a CPU oneDNN does not cover (docs/testing.md). CI runs it after `make test`.
NUMERICS_TESTS = tests/pipeline/export tests/pipeline/audit tests/pipeline/score tests/pipeline/test_verify.py \
	tests/pipeline/test_verify_images.py tests/serving/test_server_e2e.py tests/serving/test_image_requests.py \
	tests/pipeline/lm/test_gpt2.py
test-numerics: $(SETUP)
	TF_ENABLE_ONEDNN_OPTS=0 $(PYTEST) $(NUMERICS_TESTS) $(ARGS)

clean:
	rm -rf runs models build .pytest_cache .venv-tritonclient .gpt2-vocabulary
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
