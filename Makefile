# rpma: the two set-up commands are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
FEATURES ?= --all-features
SCRATCH ?= $(CURDIR)/scratch

.PHONY: all deps build test host-test vm-test tsan lint fmt demo bench reliability clean

all: build

deps:
	@bash scripts/install-deps.sh

build: deps
	$(CARGO) build --workspace $(FEATURES)

fmt:
	$(CARGO) fmt --all

# The import structure: no circle between files, no import against a layer rule
# (scripts/layers.toml, docs/architecture.md "Layers"); the checker's own tests first.
lint: deps
	$(CARGO) fmt --all --check
	@python3 scripts/layers_test.py
	python3 scripts/layers.py
	$(CARGO) clippy --workspace --all-targets $(FEATURES) -- -D warnings

# Everything CI runs: dependencies, formatting, lints, a build with all features, every test:
# the host's (with the concurrency tests under ThreadSanitizer), then the VM lab's (the real
# stack: Soft-RoCE, DAX, the kernel's block clients; docs/testing.md). RPMA_SKIP_VM=1 skips the
# VM part, loudly, for machines without qemu.
test: host-test
	@if [ "$${RPMA_SKIP_VM:-}" = 1 ]; then \
	  echo "*** RPMA_SKIP_VM=1: the VM lab did NOT run: the rdma transport, real DAX and the" >&2; \
	  echo "*** kernel's nbd/md/nvme clients are untested in this run (docs/testing.md)" >&2; \
	else \
	  $(MAKE) --no-print-directory vm-test; \
	fi

host-test: lint
	$(CARGO) build --workspace $(FEATURES)
	$(CARGO) test --workspace $(FEATURES)
	@bash scripts/tsan.sh

# The VM lab alone: boots Debian kernels under qemu on this machine's userspace and runs the
# device tests there (scripts/vm-test.sh; set-up by scripts/vm-setup.sh).
vm-test: deps
	@CARGO="$(CARGO)" FEATURES="$(FEATURES)" bash scripts/vm-test.sh

# The concurrency tests of the shared-memory paths under ThreadSanitizer (scripts/tsan.sh,
# docs/reliability.md "Race detection"), in a build of their own (build/tsan): a few minutes
# from scratch on two CPUs, about one when built. TSAN_ARGS="--at REV" runs the race test
# against an older commit's fabric.
tsan: deps
	@bash scripts/tsan.sh $(TSAN_ARGS)

demo: deps
	@bash scripts/demo.sh

# The benchmarks side by side, medians (bench/README.md). Long: run it by hand, not in CI.
# BENCH_ARGS=--quick: under three minutes once built.
bench: deps
	@bash bench/run.sh $(BENCH_ARGS)

# The long reliability run (docs/reliability.md): at least 200 crash cycles under the power-loss
# simulation, the long link-fault and load runs, 10 minutes of fuzzing per target. `make test`
# runs the short versions. RELIABILITY_ARGS: see scripts/reliability.sh --help.
reliability: deps
	@bash scripts/reliability.sh $(RELIABILITY_ARGS)

clean:
	$(CARGO) clean
	rm -rf $(SCRATCH)
