package redisbroker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/relay/broker"
)

type netErr struct{}

func (netErr) Error() string   { return "i/o timeout" }
func (netErr) Timeout() bool   { return true }
func (netErr) Temporary() bool { return true }

var _ net.Error = netErr{}

type redisErr string

func (e redisErr) Error() string { return string(e) }
func (redisErr) RedisError()     {}

func TestBrokerUnavailable(t *testing.T) {
	for err, want := range map[error]bool{
		netErr{}: true,
		io.EOF:   true,
		fmt.Errorf("wrapped: %w", io.ErrUnexpectedEOF):                                                              true,
		redisErr("OOM command not allowed when used memory > 'maxmemory'"):                                          true,
		redisErr("READONLY You can't write against a read only replica."):                                           true,
		redisErr("LOADING Redis is loading the dataset in memory"):                                                  true,
		&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}:                                             true,
		redisErr("ERR max number of clients reached"):                                                               true,
		redisErr("MOVED 3999 127.0.0.1:6381"):                                                                       true,
		redisErr("NOREPLICAS Not enough good replicas to write."):                                                   true,
		redisErr("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk"): true,
		errors.New("a message that merely says connection refused"):                                                 false,
		redisErr("WRONGTYPE Operation against a key holding the wrong kind of value"):                               false,
		redisErr("ERR invalid stream ID"):                                                                           false,
	} {
		if got := unavailable(err); got != want {
			t.Errorf("unavailable(%q) = %v, want %v", err, got, want)
		}
	}
}

// A publish that may have reached Redis (a lost reply, replicas that did
// not confirm) starts its redelivery window; one that never left the client
// or that Redis refused does not.
func TestMaybeSent(t *testing.T) {
	b := &Broker{}
	for err, want := range map[error]bool{
		nil: false,
		&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}: false,
		&net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}:   true,
		redis.ErrPoolTimeout: false,
		redis.ErrClosed:      false,
		redisErr("OOM command not allowed when used memory > 'maxmemory'"): false,
		redisErr("MOVED 3999 127.0.0.1:6381"):                              false,
		context.DeadlineExceeded:                                           true,
		fmt.Errorf("%w: %w", broker.ErrUnavailable, ErrNotReplicated):      true,
		fmt.Errorf("%w: %w", broker.ErrUnavailable, netErr{}):              true,
	} {
		if got := b.MaybeSent(err); got != want {
			t.Errorf("MaybeSent(%v) = %v, want %v", err, got, want)
		}
	}
}
