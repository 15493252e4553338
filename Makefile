# The two commands a new user runs: `make demo` and `make test`. Each sets up .venv first.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo demo-centralized test lint bench-zo-step bench-centralized bench-scale bench-flower bench-client-memory bench-calibrate bench-ranking bench-instruction bench-recipe-ablation bench-robustness bench-gradient-concentration

setup:
	@bash scripts/setup_env.sh

DEMO_OUT := runs/demo-$(shell date +%Y%m%d-%H%M%S)

# The main job: a federated zofed run on the built-in model and data, then its plots.
demo: setup
	$(VENV)/bin/zofed run configs/federated_demo.yaml --out $(DEMO_OUT) $(ARGS)
	$(VENV)/bin/zofed report $(DEMO_OUT) --out $(DEMO_OUT)/report

# Centralized ZO fine-tuning of the same model on the same data.
demo-centralized: setup
	$(VENV)/bin/zofed finetune configs/demo.yaml --out runs/demo-centralized-$$(date +%Y%m%d-%H%M%S) $(ARGS)

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

bench-flower: setup
	$(PY) benchmarks/flower.py

bench-client-memory: setup
	$(PY) benchmarks/client_memory.py

bench-calibrate: setup
	$(PY) benchmarks/calibrate.py

bench-ranking: setup
	$(PY) benchmarks/ranking.py --phase tune

# Instruction tuning on federated Dolly/Alpaca at equal client compute (ROUGE-L): each row's step size tuned on
# validation loss, then the finals at the chosen points; ARGS e.g. --jobs 2 --threads 1
bench-instruction: setup
	$(PY) benchmarks/instruction.py --phase tune $(ARGS) && $(PY) benchmarks/instruction.py $(ARGS)

# zofed's two components in the weights recipe on the demo's federation, 3 seeds (about an hour on one thread)
bench-recipe-ablation: setup
	$(PY) benchmarks/recipe_ablation.py

# zofed's defenses against lying clients and the accuracy privacy costs (docs/security.md); ARGS as above
bench-robustness: setup
	$(PY) benchmarks/robustness.py $(ARGS)

# The client-compute rule (src/zofed/fl/cost.py) against measured step times on SmolLM2-135M, one thread by default
# (writes docs/results/cost_model.json and .md); ARGS e.g. --threads 2
.PHONY: bench-cost-model
bench-cost-model: setup
	$(PY) benchmarks/cost_model.py $(ARGS)

# How concentrated the top-4 norm gains' squared gradient is, coordinate by coordinate (about a minute)
bench-gradient-concentration: setup
	$(PY) benchmarks/gradient_concentration.py
