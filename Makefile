# Every target is self-contained on a fresh machine: it creates .venv when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO := demo

.PHONY: install test demo bench lint clean

install: $(STAMP)

# torch==2.13.0 (CPU) lies on these machines' disk; install it first unless a torch is present,
# so the resolver never pulls a multi-GB CUDA build for the `torch>=2.6` requirement.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

demo: $(STAMP)
	$(VENV)/bin/python bench/demo.py --out $(DEMO)

bench: $(STAMP)
	$(PY) bench/tokenize.py
	$(PY) bench/pack.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(DEMO) runs .pytest_cache
