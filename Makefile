# The two commands of the README:
#   make demo   walk through settled TEDs end to end
#   make test   the whole test suite against real PostgreSQL and Redis
#
# Servers: DATABASE_URL/REDIS_URL (demo) and TEST_DATABASE_URL/TEST_REDIS_URL
# (tests) if set; else Docker through testcontainers if an engine answers;
# else throw-away servers started from the local postgres and redis-server
# binaries in a temporary directory (apt-get install postgresql redis-server).

GO ?= go

.PHONY: demo test build vet fmt ci

demo:
	$(GO) run ./cmd/outbox demo

test:
	$(GO) vet ./...
	$(GO) test -race -count=1 ./...

build:
	$(GO) build -o bin/outbox ./cmd/outbox

vet:
	$(GO) vet ./...

fmt:
	gofmt -w .

ci:
	bash .ci/run
