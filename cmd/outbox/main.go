// Command outbox runs the transactional outbox: schema migrations, the relay,
// the anti-fraud consumer, a TED load generator, a status view and a demo.
// Run "outbox help" for the commands.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/tedbank/outbox/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
