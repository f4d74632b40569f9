# The two commands of the README:
#   make demo   walk through settled TEDs end to end
#   make test   the whole test suite against real PostgreSQL and Redis
#   make chaos  the fault-injection suite (own throw-away servers; a few minutes)
#
# Servers for the demo: DATABASE_URL/REDIS_URL if set; else Docker Compose if a
# Docker engine answers (removed afterwards); else throw-away servers started
# by the demo itself from the local postgres and redis-server binaries.
# Servers for the tests: TEST_DATABASE_URL/TEST_REDIS_URL if set; else Docker
# through testcontainers; else the local binaries, in a temporary directory.

GO ?= go
COMPOSE_DATABASE_URL = postgres://postgres:postgres@localhost:5432/outbox?sslmode=disable
COMPOSE_REDIS_URL = redis://localhost:6379/0

.PHONY: demo test build vet fmt ci chaos charts bench-results

# The demo runs the outbox command built with fail points (scenario 2 kills
# a relay at one), as bin/outbox-demo. It is built with -trimpath as `make
# build` is, so that the two share the build cache: only the packages with
# fail points and the link differ.
demo:
	@echo "make demo: building bin/outbox-demo (the outbox command with fail points; a few minutes on a cold build cache)"
	@$(GO) build -trimpath -tags failpoint -o bin/outbox-demo ./cmd/outbox
	@if [ -z "$$DATABASE_URL$$REDIS_URL" ] && command -v docker >/dev/null 2>&1 && timeout 5 docker info >/dev/null 2>&1 \
	    && docker compose up -d --wait; then \
	  echo "Using Docker Compose (docker-compose.yml); it is removed afterwards."; \
	  DATABASE_URL='$(COMPOSE_DATABASE_URL)' REDIS_URL='$(COMPOSE_REDIS_URL)' bin/outbox-demo demo $(DEMO_FLAGS); \
	  rc=$$?; docker compose down -v >/dev/null 2>&1; exit $$rc; \
	else \
	  bin/outbox-demo demo $(DEMO_FLAGS); \
	fi

# make test runs the tests in two lanes side by side. The first runs every
# package, two test binaries at a time, the longest (conformance, relay, the
# module root) first. The second runs again, one binary at a time, the tests
# whose relays take their ownership from OUTBOX_RELAY_OWNERSHIP
# (internal/relaytest/ownership_tests.txt; a test that does and is not listed
# there fails), with the outbox relay command's default, auto (which leases
# partitions on the tests' fresh databases), where the first lane ran the
# library's (row claims, the card's); then the command's and the consumer's
# tests (internal/cli, consumer), so that the two lanes end about together.
# The second lane's output follows the first's.
# Tests marked parallel own their database and key prefix and spend most of
# their time waiting out their faults: four run at a time.
TEST_FLAGS = -race -count=1 -timeout 15m -parallel 4
OWNERSHIP_TESTS = ^($(shell grep '^Test' internal/relaytest/ownership_tests.txt | paste -sd'|' -))$$
# The outbox command with fail points, which tests run and kill
# (outboxtest.Binary), is built once, for every test binary.
test:
	$(GO) vet ./...
	$(GO) vet -tags failpoint ./internal/failpoint
	@bin_dir=$$(mktemp -d); trap 'rm -rf "$$bin_dir"' EXIT; \
	$(GO) build -tags failpoint -o "$$bin_dir/outbox" ./cmd/outbox || exit 1; \
	export OUTBOX_TEST_BINARY="$$bin_dir/outbox"; \
	second_log=$$(mktemp); \
	{ OUTBOX_RELAY_OWNERSHIP=auto $(GO) test $(TEST_FLAGS) -p 1 -run '$(OWNERSHIP_TESTS)' . ./relay ./internal/tracing; auto=$$?; \
	  $(GO) test $(TEST_FLAGS) -p 1 ./internal/cli ./consumer; rest=$$?; test $$auto -eq 0 && test $$rest -eq 0; } >"$$second_log" 2>&1 & second=$$!; \
	echo "$(GO) test $(TEST_FLAGS) -p 2 ./internal/conformance ./relay . ./... except ./internal/cli ./consumer  (beside it: OUTBOX_RELAY_OWNERSHIP=auto $(GO) test $(TEST_FLAGS) -p 1 -run <internal/relaytest/ownership_tests.txt> . ./relay ./internal/tracing, then $(GO) test $(TEST_FLAGS) -p 1 ./internal/cli ./consumer)"; \
	$(GO) test $(TEST_FLAGS) -p 2 ./internal/conformance ./relay . $$($(GO) list ./... | grep -vE '/(internal/cli|consumer)$$'); first=$$?; \
	wait $$second; second=$$?; \
	echo "the second lane (OUTBOX_RELAY_OWNERSHIP=auto: the tests of internal/relaytest/ownership_tests.txt; then ./internal/cli ./consumer):"; cat "$$second_log"; rm -f "$$second_log"; \
	test $$first -eq 0 && test $$second -eq 0

# The fault-injection suite (internal/chaos): 5,000 TEDs while relays,
# consumers, PostgreSQL and Redis are killed, cut and blackholed. It starts
# its own PostgreSQL and Redis from the local binaries. CI runs the short
# version in four settings (.ci/run): make chaos CHAOS_FLAGS='-chaos.n 4500 -chaos.short'.
# Replay a run's fault schedule with CHAOS_FLAGS='-chaos.seed N'. On a local
# Redis Cluster (3 masters + 3 replicas, --min-replicas 1, 16 partitions):
# CHAOS_FLAGS='-chaos.cluster' (add -chaos.min-replicas 0 to see the loss).
# Relays owning partitions instead of claiming rows: -chaos.ownership partitions
# (-chaos.ownership auto: the relays' default, which chooses partitions there).
# On NATS JetStream (relays and consumers with --broker nats, the server's own
# faults): CHAOS_FLAGS='-chaos.nats'.
# CHAOS_RUN picks the suite's tests: TestRelayAfterHalfOpenPostgres takes none
# of the flags (one relay claiming rows, one Redis), so .ci/run runs it with
# its first setting only (CHAOS_RUN=TestChaos for the others; make expands a
# '$' in the value: write '$$').
CHAOS_RUN ?= ^(TestChaos|TestRelayAfterHalfOpenPostgres)$$
chaos:
	$(GO) test -count=1 -v -timeout 20m -run '$(CHAOS_RUN)' ./internal/chaos -chaos $(CHAOS_FLAGS)

# The charts of docs/charts (ratios.svg, latency.svg, failover.svg), drawn
# from the committed results of 'outbox bench --json' (docs/charts/results.jsonl);
# a test fails when they no longer match. 'make bench-results' measures the
# results again on the servers of DATABASE_URL and REDIS_URL (about ten
# minutes on 2 cores; each case in a fresh database), then draws them.
charts:
	$(GO) run ./cmd/outbox bench chart --in docs/charts/results.jsonl --out docs/charts

bench-results: build
	@echo "make bench-results: measuring (about ten minutes); results in docs/charts/results.jsonl"
	{ bin/outbox bench drain --n 50000 --runs 3 --json && \
	  bin/outbox bench drain --n 50000 --runs 3 --ownership rows --json && \
	  bin/outbox bench latency --rate 200 --n 2000 --runs 3 --json && \
	  bin/outbox bench consume --n 100000 --runs 3 --json && \
	  bin/outbox bench consume --n 100000 --runs 3 --effect inbox --json && \
	  bin/outbox bench writers --writers 32 --modes off,idle --duration 6s --runs 3 --json && \
	  bin/outbox bench failover --json; } > docs/charts/results.jsonl.new
	mv docs/charts/results.jsonl.new docs/charts/results.jsonl
	$(MAKE) charts

# The product binary, bin/outbox: no fail points, no Docker client, stripped
# of its symbol table and DWARF (panics still print full stack traces); and
# the README's example consumer, bin/billing.
build:
	$(GO) build -trimpath -ldflags='-s -w' -o bin/ ./cmd/outbox ./docs/examples/billing

vet:
	$(GO) vet ./...

fmt:
	gofmt -w .

ci:
	bash .ci/run
