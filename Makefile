# The quick start: `make bench` (the main job) and `make test` (the test suite), on a fresh machine.
# Both create .venv with torch 2.13.0 (the registry's default wheel for the platform; TORCH_PIP_ARGS passes
# pip another index, e.g. PyTorch's CPU-only one) and build zen in place on top of it.
PYTHON ?= python3
TORCH_PIP_ARGS ?=
VENV := .venv
PY := $(VENV)/bin/python
SOURCES := $(shell find csrc -type f) setup.py pyproject.toml

.PHONY: bench test examples fuzz results sanitize cuda-check info clean

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PY) -m pip install -q setuptools wheel ninja numpy pytest hypothesis matplotlib tqdm
	touch $@

# --no-build-isolation: build against the torch installed above, never let pip resolve torch itself.
$(VENV)/.built: $(VENV)/.torch $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

# The examples' frameworks, pinned (examples/requirements.txt: Lightning, Accelerate), into the test environment.
# The constraint keeps pip from replacing torch (2.13.0+cpu satisfies torch==2.13.0).
$(VENV)/.examples: $(VENV)/.torch examples/requirements.txt
	echo torch==2.13.0 > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q -r examples/requirements.txt -c $(VENV)/torch-constraint.txt
	$(PY) -c "import torch; v = torch.__version__; assert v.split('+')[0] == '2.13.0', 'pip replaced torch: ' + v"
	touch $@

bench: $(VENV)/.built
	$(PY) benchmarks/allreduce.py $(ARGS)

test: $(VENV)/.built $(VENV)/.examples
	$(PY) -m pytest -q tests $(ARGS)

# The fuzz tests with fresh seeds, round after round, for FUZZ_SECONDS (CI runs them derandomised, in make test).
FUZZ_SECONDS ?= 600
fuzz: $(VENV)/.built
	end=$$(( $$(date +%s) + $(FUZZ_SECONDS) )); round=0; \
	while [ $$(date +%s) -lt $$end ]; do round=$$((round + 1)); echo "fuzz round $$round"; \
	  ZEN_HYPOTHESIS=fuzz $(PY) -m pytest -q -p no:cacheprovider tests/test_fuzz.py $(ARGS) || exit 1; done

# Each script of examples/ through its launcher (torchrun, Lightning's, accelerate launch), with its check.
examples: $(VENV)/.built $(VENV)/.examples
	$(PY) -m pytest -q tests/test_examples.py $(ARGS)

# Every results/ file whose command needs no root, then the pages' blocks from results/ (benchmarks/report.py).
# The emulated-cluster files (sweep_*, rows_*, train_*) need root: benchmarks/README.md gives their commands. Each .txt
# is the command's printed table, moved into results/ only when the command succeeds. It times calls for some
# minutes: run it on an otherwise idle machine.
MEMORY_ARGS := --world 4 --sizes 4M --densities 0.001,0.01,0.1
PLANNER_ARGS := --embedding 106545x128 --batch-tokens 2048 --world 8 --bandwidth 1gbit --latency 50us

results: $(VENV)/.built
	mkdir -p results/tmp
	$(PY) benchmarks/allreduce.py --world 4 --json results/bench_loopback_4.json > results/tmp/bench_loopback_4.txt
	mv results/tmp/bench_loopback_4.txt results/bench_loopback_4.txt
	$(PY) benchmarks/sparse_embedding.py --world 2 --json results/sparse_embedding_2.json > results/tmp/sparse_embedding_2.txt
	mv results/tmp/sparse_embedding_2.txt results/sparse_embedding_2.txt
	$(PY) benchmarks/sparse_embedding.py --world 4 --json results/sparse_embedding_4.json > results/tmp/sparse_embedding_4.txt
	mv results/tmp/sparse_embedding_4.txt results/sparse_embedding_4.txt
	$(PY) benchmarks/hook_overhead.py --world 2 --json results/hook_overhead_2.json > results/tmp/hook_overhead_2.txt
	mv results/tmp/hook_overhead_2.txt results/hook_overhead_2.txt
	$(PY) benchmarks/hook_overhead.py --world 4 --json results/hook_overhead_4.json > results/tmp/hook_overhead_4.txt
	mv results/tmp/hook_overhead_4.txt results/hook_overhead_4.txt
	for opt in adamw sgd; do for w in 2 4; do \
	  variants=plain,zen,zen-global,zen/0.1/ramp50; \
	  [ $$opt = adamw ] && variants=plain,zen,zen-global,zen/0.05/ramp50,zen/0.1/ramp50,zen/0.25/ramp50; \
	  $(PY) benchmarks/dense_model.py --world $$w --steps 200 --optimizer $$opt --eval-every 50 --variants $$variants \
	    --json results/topk_$${opt}_$$w.json > results/tmp/topk_$${opt}_$$w.txt && \
	  mv results/tmp/topk_$${opt}_$$w.txt results/topk_$${opt}_$$w.txt || exit 1; done; done
	$(PY) benchmarks/kernels.py --json results/kernels_cpu.json > results/tmp/kernels_cpu.txt
	mv results/tmp/kernels_cpu.txt results/kernels_cpu.txt
	{ echo '$$ python benchmarks/memory.py $(MEMORY_ARGS)'; echo; $(PY) benchmarks/memory.py $(MEMORY_ARGS); } > results/tmp/memory.txt
	mv results/tmp/memory.txt results/memory.txt
	$(PY) benchmarks/faults.py --json results/faults.json > results/tmp/faults.txt
	mv results/tmp/faults.txt results/faults.txt
	$(PY) benchmarks/soak.py --calls 3000 --json results/soak.json > results/tmp/soak.txt
	mv results/tmp/soak.txt results/soak.txt
	{ echo '$$ python -m zen.planner $(PLANNER_ARGS)'; $(PY) -m zen.planner $(PLANNER_ARGS); } > results/tmp/planner_example.txt
	mv results/tmp/planner_example.txt results/planner_example.txt
	$(PY) benchmarks/report.py

# AddressSanitizer + UBSan over the CPU kernels' tests, with the date and commit, into results/sanitize.txt.
# Not in `make results` or CI: the instrumented build alone takes most of half an hour on 2 cores.
sanitize: $(VENV)/.built
	mkdir -p results/tmp
	{ echo '$$ bash benchmarks/sanitize.sh'; echo "date: $$(date -u +%Y-%m-%d)"; \
	  echo "commit: $$(git rev-parse --short HEAD)$$(git diff --quiet HEAD -- csrc zen tests || echo +changes)"; \
	  PYTHON=$(PY) bash benchmarks/sanitize.sh 2>&1; } > results/tmp/sanitize.txt
	mv results/tmp/sanitize.txt results/sanitize.txt
	$(PY) benchmarks/report.py

cuda-check: $(VENV)/.built
	PYTHON=$(PY) bash benchmarks/compile_cuda.sh

info: $(VENV)/.built
	$(PY) -m zen.info

clean:
	rm -rf $(VENV) build *.egg-info zen/*.so
