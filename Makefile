# memtui: `make demo` runs a real training with the viewer attached; `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
RUNTIME_STAMP := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed

# torch is the user's: the package does not depend on it, the tests and the demo need it. The
# pin is the CPU build here only because this machine's pip finds it on local disk; from PyPI on
# Linux the same pin is the CUDA build (~2.8 GB of wheels). TORCH_INDEX picks the index it comes
# from: `make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu` on a box without a GPU.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=

# the suite runs in one worker more than there are cores (its tests wait on trainings about a
# quarter of the time), a file's tests on one worker (its shared training starts once), the
# heaviest files first (those marked `heavy`); `make test PYTEST_WORKERS=` runs it in
# one process
PYTEST_WORKERS ?= -n $(shell echo $$(( $$(nproc) + 1 ))) --dist loadfile --no-loadscope-reorder

.PHONY: demo demo-no-tui test test-unit test-slow test-frameworks test-gpu gpu-wheels lint bench bench-gil bench-instructions bench-peer bench-tui bench-export bench-flood bench-hf bench-clients litgpt-venv screenshots docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# the runtime: torch (kept if the venv has one) and the package with its own dependencies only
# (what `make demo` needs); the test stamp adds the test and lint toolchain on top
$(RUNTIME_STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || \
		$(PIP) install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==$(TORCH_VERSION)
	$(PIP) install --quiet -e .
	touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP) pyproject.toml
	$(PIP) install --quiet -e ".[test]"
	touch $(STAMP)

ON_PATH = @echo "memtui is installed in $(VENV): run it as $(VENV)/bin/memtui, or 'source $(VENV)/bin/activate' first"

demo: $(RUNTIME_STAMP)
	$(ON_PATH)
	$(VENV)/bin/memtui demo

demo-no-tui: $(RUNTIME_STAMP)
	$(ON_PATH)
	$(VENV)/bin/memtui demo --no-tui

# the linters run beside pytest (they take one core for ~15 s while the suite leaves some
# idle), their output after the suite's; either failing fails the target
test: $(STAMP)
	@$(MAKE) --no-print-directory lint > .lint.log 2>&1 & lint=$$!; \
	$(PY) -m pytest -q $(PYTEST_WORKERS); suite=$$?; \
	wait $$lint; linted=$$?; cat .lint.log; rm -f .lint.log; \
	[ $$suite -eq 0 ] && [ $$linted -eq 0 ]

# transformers, accelerate and Lightning on top of the same venv (torch stays 2.13.0 CPU)
FRAMEWORKS_STAMP := $(VENV)/.installed-frameworks
$(FRAMEWORKS_STAMP): $(STAMP) pyproject.toml
	$(PIP) install --quiet -e ".[test,frameworks]" "torch==$$($(PY) -c 'import torch; print(torch.__version__.split("+")[0])')"
	touch $(FRAMEWORKS_STAMP)

# tests/clients runs third-party training scripts kept out of this repository: where their
# files are in tests/clients/upstream/ (tests/clients/README.md), what they need is installed
# too; without them those tests are skipped, each saying how to fetch its files
CLIENTS_STAMP := $(VENV)/.installed-clients
$(CLIENTS_STAMP): $(FRAMEWORKS_STAMP) pyproject.toml
	$(PIP) install --quiet -e ".[test,frameworks,clients]" "torch==$$($(PY) -c 'import torch; print(torch.__version__.split("+")[0])')"
	touch $(CLIENTS_STAMP)

test-frameworks: $(FRAMEWORKS_STAMP) $(if $(wildcard tests/clients/upstream/*),$(CLIENTS_STAMP))
	$(PY) -m pytest -q -m frameworks tests/frameworks tests/clients

# the client corpus's unchanged scripts under `memtui run` beside the same scripts with the
# explicit lines (the clients whose files are in tests/clients/upstream/; ~7 min on 2 cores)
bench-clients: $(FRAMEWORKS_STAMP) $(if $(wildcard tests/clients/upstream/*),$(CLIENTS_STAMP))
	$(PY) benchmarks/run_vs_explicit.py --table

# litgpt's `pretrain` (tests/clients/test_litgpt_pretrain.py) pins huggingface-hub<1.4, which the
# shared venv's transformers refuses: it runs in a venv of its own, with the same torch, litgpt and
# litdata at the client's pins, Lightning, and memtui editable (the test is skipped, naming this
# target, while the venv is absent)
LITGPT_VENV ?= .venv-litgpt
LITGPT_VERSION ?= 0.5.13
LITDATA_VERSION ?= 0.2.76
LITGPT_STAMP := $(LITGPT_VENV)/.installed
$(LITGPT_STAMP): pyproject.toml
	$(PYTHON) -m venv $(LITGPT_VENV)
	$(LITGPT_VENV)/bin/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==$(TORCH_VERSION)
	$(LITGPT_VENV)/bin/python -m pip install --quiet "torch==$(TORCH_VERSION)" litgpt==$(LITGPT_VERSION) litdata==$(LITDATA_VERSION) "lightning>=2.6.1" tokenizers psutil pytest -e .
	# litdata pulls PyPI's torchvision, whose operators were built for another torch build: it
	# breaks every import of torchmetrics (Lightning's); litgpt's text pretraining never uses it
	$(LITGPT_VENV)/bin/python -m pip uninstall --quiet --yes torchvision
	touch $(LITGPT_STAMP)

litgpt-venv: $(LITGPT_STAMP)

bench-hf: $(FRAMEWORKS_STAMP)
	$(PY) benchmarks/hf_overhead.py

# the unit tests alone: no process started, no socket to another process (about 25 s)
test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# the real CUDA paths (tests/gpu): on a machine with a CUDA device and a CUDA build of torch
# (the CPU build above sees none, and they are skipped, each with the reason)
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests/gpu

# the wheels tests/gpu/run_on_device.sh installs on a CUDA machine whose python3 has torch and
# nothing else of memtui's (no network there): the package's dependencies and the test runner's
# (pytest, pytest-timeout), for CPython $(GPU_PYTHON) on x86-64 Linux, at the versions this venv
# runs where it has them, into $(GPU_WHEELS)/ (git-ignored: copy it there beside the working
# tree); memtui itself runs from the repository (PYTHONPATH)
GPU_WHEELS ?= .whl
GPU_PYTHON ?= 3.12
GPU_PLATFORMS := $(foreach n,17 24 27 28 31 34 35,--platform manylinux_2_$(n)_x86_64) \
	--platform manylinux2014_x86_64
gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PIP) list --format=freeze --exclude-editable > $(GPU_WHEELS).constraints
	$(PIP) download --quiet --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp $(GPU_PLATFORMS) --constraint $(GPU_WHEELS).constraints \
		--dest $(GPU_WHEELS) $$($(PY) -c 'from pip._vendor import tomli; \
			print(" ".join(tomli.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))') \
		pytest pytest-timeout
	rm -f $(GPU_WHEELS).constraints
	@du -sh $(GPU_WHEELS); ls $(GPU_WHEELS)

lint: $(STAMP)
	$(VENV)/bin/ruff check memtui tests benchmarks screenshots docs/hooks.py
	$(VENV)/bin/ruff format --check memtui tests benchmarks screenshots docs/hooks.py
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

bench: $(STAMP)
	$(PY) benchmarks/hook_overhead.py
	$(PY) benchmarks/auto_overhead.py
	$(PY) benchmarks/hook_cputime.py
	$(PY) benchmarks/hook_ranks.py

# whether the hook's threads delay the training thread through the GIL (5 ms vs 0.5 ms switch
# interval, nanoGPT-shaped loop and a pure-Python worst case), and what their wake-ups do
bench-gil: $(STAMP)
	$(PY) benchmarks/hook_cputime.py --switch-intervals-ms 5,0.5
	$(PY) benchmarks/hook_gil.py --profile

bench-instructions: $(STAMP)
	$(PY) benchmarks/hook_instructions.py

# the plain loop bare, with memtui and with TraceML (`pip install traceml-ai` into .venv first;
# without it, bare and memtui only)
bench-peer: $(STAMP)
	$(PY) benchmarks/peer_overhead.py

bench-tui: $(STAMP)
	$(PY) benchmarks/tui_cpu.py --size 120x40
	$(PY) benchmarks/tui_cpu.py --size 60x50
	$(PY) benchmarks/tui_ranks.py

# `memtui export` watching the same 64 replayed ranks, scraped every 15 s as Prometheus would;
# then with 10, 100 and 1,000 registered runs (live, hung, dead, silent), scraped every second
bench-export: $(STAMP)
	$(PY) benchmarks/tui_ranks.py --exporter --seconds 60 --rounds 5
	$(PY) benchmarks/export_fleet.py

# a flood of each of a run's sockets for 5 minutes, the training watched 5 minutes more: its
# RSS before, during and after, its steps (about 65 minutes)
bench-flood: $(STAMP)
	$(PY) benchmarks/control_flood.py

screenshots: $(STAMP)
	$(PY) screenshots/export_screenshots.py

# the documentation site: docs/ and mkdocs.yml into build/site, every warning an error (a broken
# link or anchor, a page left out of the nav, a docstring mkdocstrings cannot read); it needs the
# package and the docs extra, not torch
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(PY) pyproject.toml
	$(PIP) install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(LITGPT_VENV) .pytest_cache .mypy_cache .ruff_cache
