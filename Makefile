# The two commands a new user runs: `make demo` and `make test`. Each sets up .venv first.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test lint bench-zo-step bench-centralized bench-scale bench-federated bench-flower

setup:
	@bash scripts/setup_env.sh

demo: setup
	$(VENV)/bin/zofed finetune --config configs/demo.yaml --out runs/demo-$$(date +%Y%m%d-%H%M%S) $(ARGS)

test: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/pytest -q

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks

bench-zo-step: setup
	$(PY) benchmarks/zo_step.py

bench-centralized: setup
	$(PY) benchmarks/centralized_sst2.py

bench-scale: setup
	$(PY) benchmarks/scale.py

bench-federated: setup
	$(PY) benchmarks/federated.py

bench-flower: setup
	$(PY) benchmarks/flower.py
