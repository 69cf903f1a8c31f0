# Two commands on a fresh clone: `make run` and `make test`. Both build .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: run test test-fast bench bench-compare soak clean sysdeps gpu-check

# Mooncake's binaries link against these; installed when missing and we may (root with apt), checked on
# every run/test (a dpkg query), not only when the venv is built.
APT_PKGS := libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1

sysdeps:
	@if command -v dpkg >/dev/null && ! dpkg -s $(APT_PKGS) >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PKGS) >/dev/null; \
		else echo "note: Mooncake (L3 backend) needs: apt-get install $(APT_PKGS)"; fi; fi

$(STAMP): pyproject.toml setup.py storage/_tokens.c storage/_hashing.c storage/l3/_fileio.c actors/_routing.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# Dynamo's KV router, a consumer of the KV-event wire strata did not write (tests/interop): in a directory
	# of its own and without its dependencies, whose pin would cap pydantic for the whole venv.
	$(BIN)/python -m pip install -q --no-deps --target $(VENV)/interop 'ai-dynamo-runtime==1.6.1' \
		|| echo "note: ai-dynamo-runtime did not install: tests/interop skip"
	touch $(STAMP)

run: sysdeps $(STAMP)
	$(BIN)/strata serve

# The float-sensitive tests (marked `numerics`, judged by tests/numerics.py) run again under other CPUs'
# ATen code paths, so one machine checks what an AVX2-only or a pre-AVX2 CPU computes (Ray workers inherit
# the variable). The CI soak is left out of these reruns: 4 minutes each, and the judge it relies on is
# itself a numerics test (tests/reliability/test_verify.py) run on every path. So is the per-family
# cluster test (2-3 minutes): the same families' tokens through the same engine paths (L1, L2, L3, P/D)
# are checked on every path by tests/models/test_families_vs_hf.py. So are the multi-node and HTTP
# end-to-end modules (a cluster of their own each, 20-30 s to start): their tokens come from the engine
# paths (L1, L2, L3, P/D transfer) that tests/unit, tests/l3, tests/transfer and tests/models check on
# every ATen path; what they add is the plumbing around them, which the native run checks. The same goes
# for the transfer tests over HTTP (test_transfer_actors.py checks the backends' tokens on every path), the
# EPLB actor's outputs across placements (tests/unit/test_moe_slots.py on every path) and the sampling of
# the bad-input cluster (tests/unit/test_sampler.py), and the EP worker served over HTTP (its group's tokens,
# before, during and after rebalances, are checked on every ATen path by tests/ep/test_ep_group.py).
NUMERICS_CAPS ?= avx2 default

# The reruns under each capability run side by side (each in its own process, its Ray clusters on their
# own free ports and temp dirs): they are mostly single-threaded and wait on process starts, so the two
# together take little more than one. Each one's output is printed whole once both are done.
NUMERICS_IGNORE := --ignore=tests/reliability/test_soak.py --ignore=tests/models/test_family_clusters.py \
	--ignore=tests/multinode --ignore=tests/e2e --ignore=tests/transfer/test_transfer_http.py \
	--ignore=tests/transfer/test_transfer_http_mooncake.py --ignore=tests/actors/test_eplb_actor.py \
	--ignore=tests/reliability/test_bad_input.py --ignore=tests/ep/test_ep_cluster.py

test: sysdeps $(STAMP)
	$(BIN)/python -m pytest -q --durations=30 $(PYTEST_ARGS)
	@logs=$$(mktemp -d); \
	for cap in $(NUMERICS_CAPS); do \
		( ATEN_CPU_CAPABILITY=$$cap $(BIN)/python -m pytest -q -m numerics $(NUMERICS_IGNORE) $(PYTEST_ARGS) \
			> $$logs/$$cap.log 2>&1; echo $$? > $$logs/$$cap.rc ) & \
	done; wait; rc=0; \
	for cap in $(NUMERICS_CAPS); do \
		echo "== numerics tests under ATEN_CPU_CAPABILITY=$$cap"; cat $$logs/$$cap.log; \
		[ "$$(cat $$logs/$$cap.rc)" = 0 ] || { echo "== numerics tests FAILED under ATEN_CPU_CAPABILITY=$$cap"; rc=1; }; \
	done; rm -rf $$logs; exit $$rc

test-fast: sysdeps $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: sysdeps $(STAMP)
	$(BIN)/python -m bench.engine

bench-compare: sysdeps $(STAMP)
	$(BIN)/python -m bench.compare --quick

# The GPU check (bench/gpu_check.py): kernels, engine and tiers on CUDA with figures against the hardware.
# It runs on the GPU machine's own python3 and torch (nothing installed: no venv, no internet there), and
# here on the venv's when there is one (its GPU parts then skip; GPU_CHECK_DEVICE=cpu runs them on the CPU).
#   make gpu-check [GPU_CHECK_PARTS=kernels,engine] [GPU_CHECK_OUT=dir] [GPU_CHECK_FAMILIES=llama,gemma3]
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
gpu-check:
	$(GPU_PY) -m bench.gpu_check $(if $(GPU_CHECK_PARTS),--parts $(GPU_CHECK_PARTS)) \
		$(if $(GPU_CHECK_OUT),--out $(GPU_CHECK_OUT)) $(if $(GPU_CHECK_FAMILIES),--families $(GPU_CHECK_FAMILIES)) \
		$(if $(GPU_CHECK_DEVICE),--device $(GPU_CHECK_DEVICE))

# The long soak (tests/reliability/soak.py) on its own local cluster: make soak DURATION=30m [SOAK_ARGS=--faults all]
DURATION ?= 30m
SOAK_ARGS ?=
soak: sysdeps $(STAMP)
	$(BIN)/python -m tests.reliability.soak --duration $(DURATION) $(SOAK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
