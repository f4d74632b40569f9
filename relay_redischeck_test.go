package outbox_test

import (
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/testenv"
	"github.com/tedbank/outbox/relay"
)

// The relay warns about a Redis that would lose published events on restart
// or eviction, and is quiet about one configured for durability.
func TestRedisDurabilityCheck(t *testing.T) {
	for _, c := range []struct {
		args  []string
		warns []string
	}{
		{[]string{"--appendonly", "no", "--maxmemory-policy", "allkeys-lru"}, []string{"appendonly", "allkeys-lru"}},
		{[]string{"--appendonly", "yes", "--maxmemory-policy", "noeviction"}, nil},
	} {
		srv, err := testenv.LocalRedis(t.Context(), testenv.Options{ExtraArgs: c.args})
		if err != nil {
			t.Fatal(err)
		}
		opt, _ := redis.ParseURL(srv.URL)
		rdb := redis.NewClient(opt)
		got := relay.CheckRedisDurability(t.Context(), rdb)
		_ = rdb.Close()
		_ = srv.Close()
		if len(got) != len(c.warns) {
			t.Fatalf("%v: warnings %q, want %d", c.args, got, len(c.warns))
		}
		for i, w := range c.warns {
			if !strings.Contains(got[i], w) {
				t.Errorf("%v: warning %q does not mention %q", c.args, got[i], w)
			}
		}
	}
}
