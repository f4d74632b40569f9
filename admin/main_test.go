package admin_test

import (
	"testing"

	"github.com/tedbank/outbox/internal/outboxtest"
)

// The tests run on a real PostgreSQL and a real Redis (internal/outboxtest
// finds or starts them; never a mock).
func TestMain(m *testing.M) { outboxtest.Main(m) }
