# Every target creates or reuses .venv itself, so a clean clone needs only python3 (3.11+) and make. `make train`
# installs only what training needs; the test targets add the `dev` extra (pytest, and torch + transformers for the
# Hugging Face parity tests); `make tensorboard` adds the viewer.
PY ?= python3
VENV := .venv
HASH := $(shell $(PY) -c "import hashlib;print(hashlib.md5(open('pyproject.toml','rb').read()).hexdigest()[:8])")
STAMP := $(VENV)/.installed-$(HASH)
DEV_STAMP := $(VENV)/.installed-dev-$(HASH)
TB_STAMP := $(VENV)/.installed-tensorboard-$(HASH)
ARGS ?=
LOGDIR ?= workdir/tensorboard
# ACCEL=cuda (NVIDIA GPUs, CUDA 13) or ACCEL=tpu: `make train` / `make test` also install that build of JAX
# (pyproject's extra of the name), e.g. `make train ACCEL=cuda`. Unset: JAX for the CPU.
ACCEL ?=
$(if $(filter-out cuda tpu,$(ACCEL)),$(error ACCEL=$(ACCEL); expected cuda, tpu or nothing (JAX for the CPU)))
ACCEL_STAMP := $(if $(ACCEL),$(VENV)/.installed-$(ACCEL)-$(HASH))

.PHONY: train test test-slow test-jax-gpu-version test-tpu test-gpu-compile tensorboard venv
venv: $(STAMP)
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e .
	rm -f $(VENV)/.installed-* && touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $(DEV_STAMP)

$(VENV)/.installed-cuda-$(HASH) $(VENV)/.installed-tpu-$(HASH): $(STAMP)
	$(VENV)/bin/python -m pip install -q -e '.[$(ACCEL)]'
	touch $@

$(TB_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install -q -e '.[tensorboard]'
	touch $(TB_STAMP)

train: $(STAMP) $(ACCEL_STAMP)
	$(VENV)/bin/python scripts/train_lm.py $(ARGS)

# The scalars of every run under $(LOGDIR) (default: the main job's), served on http://localhost:6006.
tensorboard: $(TB_STAMP)
	$(VENV)/bin/tensorboard --logdir $(LOGDIR) $(ARGS)

test: $(DEV_STAMP) $(ACCEL_STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 $(ARGS)

test-slow: $(DEV_STAMP)
	$(VENV)/bin/python -m pytest -q -m slow $(ARGS)

# The suite under the JAX the GPU machines run (0.11.2, which needs Python 3.12), on CPU; not part of CI. The
# Hugging Face parity tests skip there (no torch). Example: make test-jax-gpu-version PY312=~/.pyenv/versions/3.12.1/bin/python3
# python3.12 on the PATH, else pyenv's 3.12 (this machine's).
PY312 ?= $(shell command -v python3.12 >/dev/null 2>&1 && python3.12 --version >/dev/null 2>&1 && echo python3.12 || ls -d $$HOME/.pyenv/versions/3.12*/bin/python3 2>/dev/null | tail -1)
VENV312 := .venv-jax011
$(VENV312)/.installed: pyproject.toml
	test -x $(VENV312)/bin/python || $(PY312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install -q "jax==0.11.2" -e . pytest pytest-xdist
	touch $@

test-jax-gpu-version: $(VENV312)/.installed
	$(VENV312)/bin/python -m pytest -q -n 2 $(ARGS)

# The TPU compile tier: the real Mosaic and XLA:TPU compilers on compile-only TPU devices (no TPU needed), through
# jax[tpu] (libtpu) at the JAX version the project pins; runs the tests marked `tpu`. Not part of CI (minutes).
JAX_VERSION ?= 0.10.2
VENV_TPU := .venv-tpu
TPU_ENV := TPU_SKIP_MDS_QUERY=1 TPU_ACCELERATOR_TYPE=v5p-8 TPU_WORKER_HOSTNAMES=localhost ALLOW_MULTIPLE_LIBTPU_LOAD=1
$(VENV_TPU)/.installed-$(HASH): pyproject.toml
	test -x $(VENV_TPU)/bin/python || $(PY) -m venv $(VENV_TPU)
	$(VENV_TPU)/bin/python -m pip install -q "jax[tpu]==$(JAX_VERSION)" -e . pytest pytest-xdist
	rm -f $(VENV_TPU)/.installed-* && touch $@

test-tpu: $(VENV_TPU)/.installed-$(HASH)
	$(TPU_ENV) $(VENV_TPU)/bin/python -m pytest -q -m tpu $(ARGS)

# The Hopper compile tier: Pallas's Triton kernels lowered by JAX 0.11.2 for an abstract H100 and compiled by the
# triton package's NVIDIA backend to sm_90a cubins (ptxas reports registers and spills); no GPU needed. Runs the
# tests marked `gpu_compile` under Python 3.12 (the cuda plugin: the Mosaic GPU kernels compiled by XLA for a
# compile-only H100, kernels/mosaic_gpu_compile.py; cuDNN's library, so that XLA compiles cuDNN's fused attention
# for a compile-only GPU too). Not part of CI.
VENV_GPU := .venv-gpu-compile
$(VENV_GPU)/.installed-$(HASH): pyproject.toml
	test -x $(VENV_GPU)/bin/python || $(PY312) -m venv $(VENV_GPU)
	$(VENV_GPU)/bin/python -m pip install -q "jax==0.11.2" "jax-cuda13-plugin==0.11.2" "jax-cuda13-pjrt==0.11.2" "triton==3.9.0" \
		"nvidia-cudnn-cu13>=9.12.0.46,<10.0" -e . pytest
	rm -f $(VENV_GPU)/.installed-* && touch $@

test-gpu-compile: $(VENV_GPU)/.installed-$(HASH)
	$(VENV_GPU)/bin/python -m pytest -q -m gpu_compile $(ARGS)
