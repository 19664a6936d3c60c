# Every target is self-contained on a fresh machine: it creates .venv when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO := demo

.PHONY: install test demo bench lint clean

install: $(STAMP)

# torch==2.13.0 (CPU) lies on these machines' disk; install it first unless a torch is present,
# so the resolver never pulls a multi-GB CUDA build for the `torch>=2.8` requirement.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

# Two test processes (pytest-xdist), a whole test file to each at a time (module fixtures are built once): most
# files run one Python thread, so a 2-core machine does twice the work; TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) tests

# The whole pipeline on an embedded corpus (Python's standard library + a BPE tokenizer trained
# here): tokenize -> pack -> inspect -> a few training steps (2 ranks: on 2 GPUs when there are, else on the CPU).
demo: $(STAMP)
	rm -rf $(DEMO)
	$(PY) -m xprep.prep.demo $(DEMO)
	$(VENV)/bin/xprep tokenize $(DEMO)/corpus/code.jsonl -o $(DEMO)/code --tokenizer $(DEMO)/tokenizer
	$(VENV)/bin/xprep tokenize $(DEMO)/corpus/chat.jsonl -o $(DEMO)/chat --tokenizer $(DEMO)/tokenizer
	$(VENV)/bin/xprep inspect $(DEMO)/chat
	$(VENV)/bin/xprep pack $(DEMO)/code@0.7 $(DEMO)/chat@0.3 -o $(DEMO)/packed --method multipack --seq-len 1024 \
		--cp-size 2 --overlong split --split 95,5
	$(VENV)/bin/xprep inspect $(DEMO)/packed
	$(VENV)/bin/xtrain run $(DEMO)/packed --model tiny --steps 20 --micro-batch-size 1 --global-batch-size 2 --lr 3e-3 --warmup 2 --sampler random \
		--eval-every 10 --eval-bins 16 --nproc-per-node 2 --cp 2 --output $(DEMO)/runs/demo \
		--device $$($(PY) -c 'import torch; print("cuda" if torch.cuda.device_count() >= 2 else "cpu")') \
		$$($(PY) -c 'import tensorboard' 2>/dev/null && echo --log tensorboard)
	$(VENV)/bin/xprep inspect $(DEMO)/runs/demo

bench: $(STAMP)
	$(PY) -m bench.tokenize
	$(PY) -m bench.pack
	$(PY) -m bench.train
	$(PY) -m bench.parallel
	$(PY) -m bench.chunk
	$(PY) -m bench.blend
	$(PY) -m bench.html
	$(PY) -m bench.distributed
	$(PY) -m bench.stream
	$(PY) -m bench.gpu

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(DEMO) runs .pytest_cache
