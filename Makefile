# Every target creates or reuses .venv itself, so a clean clone needs only python3 (3.11+) and make.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-$(shell $(PY) -c "import hashlib;print(hashlib.md5(open('pyproject.toml','rb').read()).hexdigest()[:8])")
ARGS ?=

.PHONY: train test test-slow venv
venv: $(STAMP)
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/python scripts/train_lm.py $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 $(ARGS)

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow $(ARGS)
