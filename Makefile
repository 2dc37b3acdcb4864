# rpma: the two set-up commands are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
FEATURES ?= --all-features
SCRATCH ?= $(CURDIR)/scratch

.PHONY: all deps build test tsan lint fmt demo bench reliability clean

all: build

deps:
	@bash scripts/install-deps.sh

build: deps
	$(CARGO) build --workspace $(FEATURES)

fmt:
	$(CARGO) fmt --all

lint: deps
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets $(FEATURES) -- -D warnings

# Everything CI runs: dependencies, formatting, lints, a build with all features, every test,
# and the concurrency tests under ThreadSanitizer.
test: lint
	$(CARGO) build --workspace $(FEATURES)
	$(CARGO) test --workspace $(FEATURES)
	@bash scripts/tsan.sh

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
