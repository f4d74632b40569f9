package dlq_test

import (
	"testing"

	"github.com/tedbank/outbox/internal/outboxtest"
)

func TestMain(m *testing.M) { outboxtest.Main(m) }
