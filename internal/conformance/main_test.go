package conformance

import (
	"testing"

	"github.com/tedbank/outbox/internal/outboxtest"
)

// Real servers, found or started by internal/outboxtest; never a mock.
func TestMain(m *testing.M) { outboxtest.Main(m) }
