package testenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// NATSImage is the image of the Docker step of NATS, run with JetStream.
const NATSImage = "nats:2-alpine"

var natsKind = kind{
	name:       "NATS (JetStream)",
	exampleURL: "nats://127.0.0.1:4222",
	image:      NATSImage,
	aptPackage: "nats-server",
	ping:       pingNATS,
	docker:     func() Starter { return dockerNATS },
	local:      LocalNATS,
}

// NATS returns a NATS server with JetStream: from opt.EnvVar, else a Docker
// container, else a local nats-server process.
func NATS(ctx context.Context, opt Options) (*Server, error) {
	return find(ctx, opt, natsKind)
}

// LocalNATS starts a fresh nats-server with JetStream (from PATH, /usr/sbin,
// /usr/bin or /usr/local/bin) on a free port, its store in a new temporary
// directory. The caller owns the server (Stop, Kill and Start restart it on
// its port with its store) and must Close it.
func LocalNATS(ctx context.Context, opt Options) (_ *Server, err error) {
	bin, err := findBinary("nats-server", "/usr/sbin", "/usr/bin", "/usr/local/bin")
	if err != nil {
		return nil, err
	}
	dir, err := makeTempDir("testenv-nats-", nil)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = os.RemoveAll(dir)
		}
	}()
	return startOnFreePort(ctx, opt, server{
		name: "nats-server", bin: bin, dir: dir, logFile: "nats.log",
		stopSignal: syscall.SIGTERM,
		args: func(port int) []string {
			return append([]string{"-a", "127.0.0.1", "-p", strconv.Itoa(port), "-js", "-sd", dir}, opt.ExtraArgs...)
		},
		url:  func(port int) string { return fmt.Sprintf("nats://127.0.0.1:%d", port) },
		ping: pingNATS,
	})
}

// pingNATS connects to u and asks JetStream for the account's information:
// a server without JetStream does not do.
func pingNATS(ctx context.Context, u string) error {
	nc, err := nats.Connect(u, nats.Timeout(time.Second), nats.MaxReconnects(0))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	if _, err := js.AccountInfo(ctx); err != nil {
		if errors.Is(err, jetstream.ErrJetStreamNotEnabled) {
			return fmt.Errorf("JetStream is not enabled (start nats-server with -js): %w", err)
		}
		return err
	}
	return nil
}
