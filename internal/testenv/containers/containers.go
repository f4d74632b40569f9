// Package containers gives internal/testenv its Docker step: importing it
// lets testenv.Postgres and testenv.Redis start a container through
// testcontainers-go when no URL is set and a Docker engine answers. The test
// helpers import it (internal/outboxtest); the outbox command does not, so
// the product binary links neither testcontainers nor the Docker client.
package containers

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/testcontainers/testcontainers-go"
	tclog "github.com/testcontainers/testcontainers-go/log"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
	tcredis "github.com/testcontainers/testcontainers-go/modules/redis"
	"github.com/testcontainers/testcontainers-go/wait"

	"github.com/tedbank/outbox/internal/testenv"
)

// dockerHealthTimeout bounds the check that a Docker engine answers.
const dockerHealthTimeout = 5 * time.Second

func init() { testenv.UseDocker(dockerPostgres, dockerRedis, dockerNATS) }

func dockerPostgres(ctx context.Context, opt testenv.Options) (_ *testenv.Server, err error) {
	logger := tcLogger(opt)
	if err := dockerHealthy(ctx, logger); err != nil {
		return nil, err
	}
	defer recoverPanic(&err)

	opt.Logf("testenv: starting docker container", "image", testenv.PostgresImage)
	args := append([]string{"-c", "max_connections=300"}, opt.ExtraArgs...)
	ctr, err := tcpostgres.Run(ctx, testenv.PostgresImage,
		tcpostgres.WithDatabase("postgres"),
		tcpostgres.WithUsername("postgres"),
		tcpostgres.WithPassword("postgres"),
		tcpostgres.BasicWaitStrategies(),
		testcontainers.WithCmdArgs(args...),
		testcontainers.WithLogger(logger),
	)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("start %s: %w", testenv.PostgresImage, err), testcontainers.TerminateContainer(ctr))
	}
	u, err := ctr.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		return nil, errors.Join(fmt.Errorf("connection string of %s: %w", testenv.PostgresImage, err), testcontainers.TerminateContainer(ctr))
	}
	return testenv.NewServer(u, testenv.SourceDocker, func() error { return testcontainers.TerminateContainer(ctr) }), nil
}

func dockerRedis(ctx context.Context, opt testenv.Options) (_ *testenv.Server, err error) {
	logger := tcLogger(opt)
	if err := dockerHealthy(ctx, logger); err != nil {
		return nil, err
	}
	defer recoverPanic(&err)

	opt.Logf("testenv: starting docker container", "image", testenv.RedisImage)
	args := append([]string{"--appendonly", "yes", "--maxmemory-policy", "noeviction"}, opt.ExtraArgs...)
	ctr, err := tcredis.Run(ctx, testenv.RedisImage,
		testcontainers.WithCmdArgs(args...),
		testcontainers.WithLogger(logger),
	)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("start %s: %w", testenv.RedisImage, err), testcontainers.TerminateContainer(ctr))
	}
	u, err := ctr.ConnectionString(ctx)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("connection string of %s: %w", testenv.RedisImage, err), testcontainers.TerminateContainer(ctr))
	}
	return testenv.NewServer(u, testenv.SourceDocker, func() error { return testcontainers.TerminateContainer(ctr) }), nil
}

func dockerNATS(ctx context.Context, opt testenv.Options) (_ *testenv.Server, err error) {
	logger := tcLogger(opt)
	if err := dockerHealthy(ctx, logger); err != nil {
		return nil, err
	}
	defer recoverPanic(&err)

	opt.Logf("testenv: starting docker container", "image", testenv.NATSImage)
	ctr, err := testcontainers.GenericContainer(ctx, testcontainers.GenericContainerRequest{
		ContainerRequest: testcontainers.ContainerRequest{
			Image:        testenv.NATSImage,
			Cmd:          append([]string{"-js"}, opt.ExtraArgs...),
			ExposedPorts: []string{"4222/tcp"},
			WaitingFor:   wait.ForListeningPort("4222/tcp"),
		},
		Started: true,
		Logger:  logger,
	})
	if err != nil {
		return nil, errors.Join(fmt.Errorf("start %s: %w", testenv.NATSImage, err), testcontainers.TerminateContainer(ctr))
	}
	endpoint, err := ctr.PortEndpoint(ctx, "4222/tcp", "nats")
	if err != nil {
		return nil, errors.Join(fmt.Errorf("address of %s: %w", testenv.NATSImage, err), testcontainers.TerminateContainer(ctr))
	}
	return testenv.NewServer(endpoint, testenv.SourceDocker, func() error { return testcontainers.TerminateContainer(ctr) }), nil
}

// dockerHealthy reports whether testcontainers can reach a Docker engine. It
// returns within dockerHealthTimeout, and turns the panics testcontainers
// raises on some machines without Docker (e.g. "rootless Docker not found")
// into errors.
func dockerHealthy(ctx context.Context, logger tclog.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, dockerHealthTimeout)
	defer cancel()

	result := make(chan error, 1) // buffered: the goroutine never blocks if we gave up
	go func() {
		var err error
		defer func() { result <- err }()
		defer recoverPanic(&err)

		p, err := testcontainers.ProviderDefault.GetProvider(testcontainers.WithLogger(logger))
		if err != nil {
			err = fmt.Errorf("no container provider: %w", err)
			return
		}
		defer p.Close()
		if err = p.Health(ctx); err != nil {
			err = fmt.Errorf("docker engine not reachable: %w", err)
		}
	}()

	select {
	case err := <-result:
		return err
	case <-ctx.Done():
		return fmt.Errorf("docker engine not reachable: %w", ctx.Err())
	}
}

// recoverPanic turns a panic into an error stored in *err.
func recoverPanic(err *error) {
	if r := recover(); r != nil {
		*err = fmt.Errorf("testcontainers panicked: %v", r)
	}
}

// tcLogger routes testcontainers' log output to opt.Log, or nowhere.
func tcLogger(opt testenv.Options) tclog.Logger {
	if opt.Log == nil {
		return tclog.NewNoopLogger()
	}
	return logFunc(opt.Log)
}

type logFunc func(msg string, args ...any)

func (f logFunc) Printf(format string, v ...any) {
	f("testcontainers: " + strings.TrimSpace(fmt.Sprintf(format, v...)))
}
