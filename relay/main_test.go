package relay_test

import (
	"testing"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
)

// The relay's specifications, on a real PostgreSQL and a real Redis
// (internal/outboxtest finds or starts them). A test whose relays take
// their ownership from OUTBOX_RELAY_OWNERSHIP (relaytest's RelayConfig) runs
// twice in make test: with the library's default ownership (row claims) and
// with the outbox relay command's (auto: partition leases on a fresh
// database); internal/relaytest/ownership_tests.txt lists them. The tests of
// one ownership set it themselves. End-to-end tests
// with anti-fraud and the outbox binary are at the module root.
func TestMain(m *testing.M) { outboxtest.MainWithExamples(m, "example.relay.") }

// fixture is one test's database, Redis key prefix and helpers.
type fixture struct{ *relaytest.Fixture }

func newFixture(t *testing.T) *fixture { return &fixture{relaytest.New(t)} }
