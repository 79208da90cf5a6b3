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

.PHONY: train test test-slow test-jax-gpu-version tensorboard venv
venv: $(STAMP)
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e .
	rm -f $(VENV)/.installed-* && touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $(DEV_STAMP)

$(TB_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install -q -e '.[tensorboard]'
	touch $(TB_STAMP)

train: $(STAMP)
	$(VENV)/bin/python scripts/train_lm.py $(ARGS)

# The scalars of every run under $(LOGDIR) (default: the main job's), served on http://localhost:6006.
tensorboard: $(TB_STAMP)
	$(VENV)/bin/tensorboard --logdir $(LOGDIR) $(ARGS)

test: $(DEV_STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 $(ARGS)

test-slow: $(DEV_STAMP)
	$(VENV)/bin/python -m pytest -q -m slow $(ARGS)

# The suite under the JAX the GPU machines run (0.11.2, which needs Python 3.12), on CPU; not part of CI. The
# Hugging Face parity tests skip there (no torch). Example: make test-jax-gpu-version PY312=~/.pyenv/versions/3.12.1/bin/python3
PY312 ?= python3.12
VENV312 := .venv-jax011
$(VENV312)/.installed: pyproject.toml
	test -x $(VENV312)/bin/python || $(PY312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install -q "jax==0.11.2" -e . pytest pytest-xdist
	touch $@

test-jax-gpu-version: $(VENV312)/.installed
	$(VENV312)/bin/python -m pytest -q -n 2 $(ARGS)
