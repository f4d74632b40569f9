package tcpproxy

import (
	"bufio"
	"net"
	"testing"
	"time"
)

func echoServer(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

func roundTrip(c net.Conn, timeout time.Duration) error {
	_ = c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	_, err := bufio.NewReader(c).ReadString('\n')
	return err
}

func TestProxyForwardsCutsAndFreezes(t *testing.T) {
	p, err := Start(echoServer(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()

	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	if err := roundTrip(c, time.Second); err != nil {
		t.Fatalf("forwarding: %v", err)
	}

	p.Down()
	if err := roundTrip(c, time.Second); err == nil {
		t.Fatal("connection survived Down")
	}
	if c2, err := net.Dial("tcp", p.Addr()); err == nil {
		if err := roundTrip(c2, time.Second); err == nil {
			t.Fatal("new connection served while down")
		}
	}
	p.Up()
	c3, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	if err := roundTrip(c3, time.Second); err != nil {
		t.Fatalf("after Up: %v", err)
	}

	p.Freeze()
	err = roundTrip(c3, 300*time.Millisecond)
	if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
		t.Fatalf("frozen connection: err %v, want a timeout (no reply, no close)", err)
	}
	c4, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	if err := roundTrip(c4, time.Second); err != nil {
		t.Fatalf("new connection after Freeze: %v", err)
	}
}

// A connection accepted just before Down, and still being set up when it
// ran, is closed too: Down did not see its link, which would have carried
// traffic through the whole outage (a relay test's database outage missed
// one of the relay's connections now and then).
func TestConnectionSetUpDuringDownIsClosed(t *testing.T) {
	p, err := Start(echoServer(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	client, accepted := net.Pipe()
	t.Cleanup(func() { _ = client.Close() })
	p.Down() // after accept() let the connection through, before serve() registered it
	go p.serve(accepted)
	if err := roundTrip(client, 2*time.Second); err == nil {
		t.Fatal("a connection set up while the proxy went down still reaches the server")
	}
}
