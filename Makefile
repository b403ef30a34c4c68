# The README's two commands:
#   make run   - set up a virtualenv, install everything, run the pipeline on the default model
#   make test  - set up the same virtualenv and run the whole test suite
#
# torch is installed first and on its own: a CPU build (`torch==2.13.0`) when no NVIDIA GPU is
# visible, the default CUDA build from PyPI when one is.  Override with TORCH_SPEC=... if needed
# (pip arguments: TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu").

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TORCH_SPEC ?= torch
EXTRAS ?= all,gpu
# llama.cpp with CUDA for compute capability 7.5 (T4) and newer
LLAMA_CMAKE_ARGS ?= -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=75;80;86;89;90
else
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= all
# Portable x86-64 build: the default -march=native build dies with "Illegal instruction" on some
# CPUs (AMX) at the first quantized eval.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
endif
PYTEST_ARGS ?=
# Two test processes, each taking whole files (a file's module fixtures are built once): the
# pipeline's fine-tune runs in one while the rest of the suite runs in the other.  21 min against
# 27 min in one process on a 2-core CPU (README, "Tests").  TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

.PHONY: run test reliability install clean help
help:
	@echo "make run   - install and run the whole pipeline on the embedded default model"
	@echo "make test  - install and run the test suite"
	@echo "make reliability - fuzzing, hostile input, security, soak, faults and replica faults at full size (~15 min on 2 cores)"

# The versions the Docker image ships (requirements-docker.txt) are constraints here too: a fresh
# clone tests what ships, not whatever the package index holds that day (a newer accelerate once
# broke tests/unit/test_docker.py's check on a fresh machine).
$(VENV)/.installed: pyproject.toml Makefile requirements-docker.txt
	@start=$$(date +%s); \
	test -x $(PY) || $(PYTHON) -m venv $(VENV); \
	$(PIP) install -q --upgrade pip wheel setuptools && \
	$(PIP) install -q $(TORCH_SPEC) && \
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install -q -c requirements-docker.txt -e ".[$(EXTRAS)]" && \
	echo "install took $$(( $$(date +%s) - start )) s" && touch $@

install: $(VENV)/.installed

# The whole pipeline on the embedded default model; it ends by serving on 127.0.0.1:8000 until
# Ctrl-C.  PIPELINE_ARGS passes options through (e.g. PIPELINE_ARGS=--no-serve).
PIPELINE_ARGS ?=
run: install
	$(VENV)/bin/quantserve pipeline --out runs/default $(PIPELINE_ARGS)

test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The reliability and security suites at full size (`make test` runs them at the quick size):
# schemathesis fuzzing, hostile requests, security checks, a 64-client x 2-minute soak per engine,
# fault injection, a replica SIGKILLed under load and autoscaling 1 -> 2 -> 1 (Ray, the
# 'replicas' extra); then the figures as one table.
RELIABILITY_TESTS := tests/reliability/test_fuzz.py tests/reliability/test_hostile.py tests/reliability/test_security.py tests/reliability/test_soak.py tests/reliability/test_faults.py \
	tests/reliability/test_server_faults.py \
	tests/serve/test_replicas.py tests/serve/test_replicas_autoscale.py
reliability: install
	QUANTSERVE_RELIABILITY=full $(PY) -m pytest -q $(RELIABILITY_TESTS)
	$(PY) -m bench.reliability_table

clean:
	rm -rf $(VENV) .pytest_cache
