package consumer

import (
	"testing"

	"github.com/tedbank/outbox/internal/outboxtest"
)

// The tests run on a real Redis, and the inbox's on a real PostgreSQL
// (internal/outboxtest finds or starts them; never a mock).
func TestMain(m *testing.M) { outboxtest.MainWithExamples(m, "example.consumer.") }
