# The quick start: `make bench` (the main job) and `make test` (the test suite), on a fresh machine.
# Both create .venv with torch 2.13.0 (the registry's default wheel for the platform; TORCH_PIP_ARGS passes
# pip another index, e.g. PyTorch's CPU-only one) and build zen in place on top of it.
PYTHON ?= python3
TORCH_PIP_ARGS ?=
VENV := .venv
PY := $(VENV)/bin/python
SOURCES := $(shell find csrc -type f) setup.py pyproject.toml

.PHONY: bench test cuda-check info clean

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PY) -m pip install -q setuptools wheel ninja numpy pytest hypothesis matplotlib tqdm
	touch $@

# --no-build-isolation: build against the torch installed above, never let pip resolve torch itself.
$(VENV)/.built: $(VENV)/.torch $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

bench: $(VENV)/.built
	$(PY) benchmarks/allreduce.py $(ARGS)

test: $(VENV)/.built
	$(PY) -m pytest -q tests $(ARGS)

cuda-check: $(VENV)/.built
	PYTHON=$(PY) bash benchmarks/compile_cuda.sh

info: $(VENV)/.built
	$(PY) -m zen.info

clean:
	rm -rf $(VENV) build *.egg-info zen/*.so
