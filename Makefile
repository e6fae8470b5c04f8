# Two commands do everything on a fresh machine (they build their own virtualenv):
#   make simulate   build, then run the main job: `mmcache simulate` with its defaults
#   make test       build, then every check CI runs
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.deps-installed

.PHONY: build simulate test test-rust test-python lint typecheck bench clean

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

test: lint test-rust typecheck test-python

bench: build
	$(VENV)/bin/mmcache bench
	$(PY) benches/bench_caches.py

clean:
	rm -rf $(VENV) target
