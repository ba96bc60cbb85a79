# codepool — the two commands a new operator needs are `make run` and
# `make test`. Everything else is a step of those, or a long run of its own.

SHELL := /bin/bash
CARGO ?= cargo
BIN := target/debug/codepool
RELEASE_BIN := target/release/codepool
NEXTEST := $(shell $(CARGO) nextest --version >/dev/null 2>&1 && echo yes)

.PHONY: check help services deploy-tools browser services-stop cluster cluster-stop cluster-sharded build run test test-unit chaos chaos-cluster bench lint fmt clean

help:
	@echo "make run       set up local servers, build, import fixtures/codes.csv, dispatch sample purchases, show grants"
	@echo "make test      set up local servers and run the whole test suite"
	@echo "make chaos     the long chaos test (kills, flushes, restarts) and ten minutes of the checker"
	@echo "make check     the seeded checker alone: SEED=N replays a seed's mix, SECS=N runs longer (default 45)"
	@echo "make bench     side-by-side benchmarks (claim strategies, dispatcher, HTTP API, import, sequences)"
	@echo "make services  install and start MongoDB, Redis and RabbitMQ on 127.0.0.1 (idempotent)"
	@echo "make browser   install Debian's chromium and chromedriver for the console's browser tests (idempotent)"
	@echo "make cluster   a 3-member replica set, a 3-node RabbitMQ cluster and a 3-master Redis Cluster (prints CODEPOOL_*)"
	@echo "make cluster-sharded  a config server, two shards and a mongos (needs mongos on PATH); the exactly-once tests through it"
	@echo "make chaos-cluster  the long failover test on the cluster (repeated faults)"
	@echo "make lint      cargo fmt --check and clippy -D warnings (without and with the failpoints feature)"

services:
	@bash scripts/services.sh

# Debian's chromium and chromedriver, for the console's browser tests.
browser:
	@bash scripts/browser.sh

services-stop:
	@bash scripts/services.sh stop

# promtool, prometheus and systemd-analyze, for the suite's checks of deploy/
deploy-tools:
	@bash scripts/deploy-tools.sh

cluster:
	@bash scripts/cluster.sh start

cluster-stop:
	@bash scripts/cluster.sh stop

# A sharded MongoDB (config server, two shards, mongos) and the exactly-once
# tests through it; needs mongos on PATH, and says so when it is missing.
# Not part of `make test`: the suite proves readiness without a mongos.
cluster-sharded:
	@bash scripts/cluster-sharded.sh

build:
	$(CARGO) build --locked -p codepool

run: services build
	@bash scripts/demo.sh $(BIN)

# One build for the whole suite (nextest builds every test binary in one
# cargo invocation, including the codepool binary the tests spawn).
# Every unit test, the integration suite and the sequence tests first; then
# the chaos test, which restarts the shared servers and so runs alone; then
# the failover test, which starts the replicated servers (scripts/cluster.sh,
# idempotent, ports apart) and kills their members; the cluster is stopped
# after it, pass or fail, so no server of this checkout outlives `make test`.
# The suite's failpoints are compiled into the test build only.
FAILPOINTS := --features codepool/failpoints
TEST_TARGETS := --workspace --lib --bins --test suite --test generators $(FAILPOINTS)
# The seeded checker (tests/suite/checker.rs) runs four codepool processes
# and kills them: it runs alone, after the rest, from the same build.
CHECKER := checker::
SECS ?= 45
CHECK_ENV = CODEPOOL_CHECK_SECS=$(SECS) $(if $(SEED),CODEPOOL_CHECK_SEED=$(SEED))
test: services deploy-tools browser
ifeq ($(NEXTEST),yes)
	$(CARGO) nextest run --locked $(TEST_TARGETS) --no-fail-fast -E 'not test(/^$(CHECKER)/)'
	$(CHECK_ENV) $(CARGO) nextest run --locked -p codepool $(FAILPOINTS) --test suite --no-capture -E 'test(/^$(CHECKER)/)'
	$(CARGO) nextest run --locked -p codepool $(FAILPOINTS) --test chaos
	$(CARGO) nextest run --locked -p codepool $(FAILPOINTS) --test failover --no-capture; s=$$?; bash scripts/cluster.sh stop >/dev/null 2>&1; exit $$s
else
	$(CARGO) test --locked $(TEST_TARGETS) --no-fail-fast -- --skip $(CHECKER)
	$(CHECK_ENV) $(CARGO) test --locked -p codepool $(FAILPOINTS) --test suite $(CHECKER) -- --nocapture
	$(CARGO) test --locked -p codepool $(FAILPOINTS) --test chaos
	$(CARGO) test --locked -p codepool $(FAILPOINTS) --test failover -- --nocapture; s=$$?; bash scripts/cluster.sh stop >/dev/null 2>&1; exit $$s
endif

# The checker alone: `make check SEED=123` replays seed 123's mix;
# `make check SECS=600` runs it for ten minutes.
check: services
	$(CHECK_ENV) $(CARGO) test --locked -p codepool $(FAILPOINTS) --test suite $(CHECKER) -- --nocapture

chaos: services
	CODEPOOL_CHAOS=full $(CARGO) test --locked --release -p codepool --test chaos -- --nocapture
	CODEPOOL_CHECK_SECS=$${CHAOS_CHECK_SECS:-600} $(if $(SEED),CODEPOOL_CHECK_SEED=$(SEED)) $(CARGO) test --locked --release -p codepool --test suite $(CHECKER) -- --nocapture

chaos-cluster: cluster
	CODEPOOL_FAILOVER=full $(CARGO) test --locked --release -p codepool --test failover -- --nocapture

bench: services
	@bash scripts/bench.sh

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings
	$(CARGO) clippy --locked --workspace --all-targets $(FAILPOINTS) -- -D warnings

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
