package relay

import (
	"log/slog"
	"sync/atomic"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/pgerr"
)

// conns is the relay's pool with the rule for a half-open link: a link that
// goes silent (a peer gone without a FIN or RST, a frozen route) leaves
// every connection made over it silent too, and only a round trip that gets
// no answer in time tells. Whichever round trip finds that out (a claim, a
// mark, a lease renewal, a reap, the LISTEN connection's watch) closes the
// pool's connections (those in use when they are given back): otherwise the
// next round trips take the silent ones one after the other, each for its
// whole timeout (a claim's is 10 s), and a relay whose renewals or reaps
// time out keeps them for its claims. Fresh connections cost a dial each.
type conns struct {
	*pgxpool.Pool
	log *slog.Logger
	// resets counts the pool's resets: a round trip that timed out resets
	// the pool only if none did since it began (its connection was closed
	// with the others), so an incident resets it once, not once per round
	// trip that was waiting on it.
	resets atomic.Uint64
}

// roundTrip runs fn, one round trip or transaction on the pool, and drops
// the pool's connections when it timed out.
func (c *conns) roundTrip(fn func() error) error {
	gen := c.resets.Load()
	err := fn()
	if pgerr.TimedOut(err) {
		c.dropSilent(gen, "a round trip timed out")
	}
	return err
}

// dropSilent closes the pool's connections unless they were closed since
// generation gen began.
func (c *conns) dropSilent(gen uint64, why string) {
	if !c.resets.CompareAndSwap(gen, gen+1) {
		return
	}
	c.log.Info("closing the pool's connections: a half-open link may have left them silent", slog.String("why", why))
	c.Reset()
}
