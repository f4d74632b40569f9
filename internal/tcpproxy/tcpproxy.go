// Package tcpproxy is a TCP proxy on the loopback interface that can cut or
// blackhole the connections through it, to make a server unavailable (or
// half-open) for one client without touching the server itself. The demo and
// the fault tests use it.
package tcpproxy

import (
	"errors"
	"io"
	"net"
	"sync"
)

// Proxy forwards connections from Addr to a target address.
type Proxy struct {
	ln     net.Listener
	target string

	mu     sync.Mutex
	down   bool
	conns  map[*link]struct{}
	closed bool
}

type link struct {
	client, server net.Conn
	frozen         chan struct{}
	freezeOnce     sync.Once
}

// Start listens on 127.0.0.1 (a free port) and forwards to target.
func Start(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, conns: map[*link]struct{}{}}
	go p.accept()
	return p, nil
}

// Addr is the address clients connect to.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Port is the port clients connect to.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// Down closes every connection and refuses new ones (they are accepted and
// closed at once) until Up: the server looks unavailable.
func (p *Proxy) Down() {
	p.mu.Lock()
	p.down = true
	links := p.links()
	p.mu.Unlock()
	for _, l := range links {
		l.close()
	}
}

// Up forwards new connections again.
func (p *Proxy) Up() {
	p.mu.Lock()
	p.down = false
	p.mu.Unlock()
}

// Freeze blackholes every open connection: bytes are swallowed in both
// directions and nothing is closed, like a peer that vanished without a
// FIN or RST. New connections are forwarded normally.
func (p *Proxy) Freeze() {
	p.mu.Lock()
	links := p.links()
	p.mu.Unlock()
	for _, l := range links {
		l.freezeOnce.Do(func() { close(l.frozen) })
	}
}

// Close stops the proxy and closes every connection.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	links := p.links()
	p.mu.Unlock()
	for _, l := range links {
		l.close()
	}
	return p.ln.Close()
}

func (p *Proxy) links() []*link {
	out := make([]*link, 0, len(p.conns))
	for l := range p.conns {
		out = append(out, l)
	}
	return out
}

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		down := p.down || p.closed
		p.mu.Unlock()
		if down {
			_ = c.Close()
			continue
		}
		go p.serve(c)
	}
}

func (p *Proxy) serve(c net.Conn) {
	s, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = c.Close()
		return
	}
	l := &link{client: c, server: s, frozen: make(chan struct{})}
	p.mu.Lock()
	if p.down || p.closed {
		// Down (or Close) ran while this connection was being set up: it
		// did not see the link, which would outlive the outage.
		p.mu.Unlock()
		l.close()
		return
	}
	p.conns[l] = struct{}{}
	p.mu.Unlock()
	var wg sync.WaitGroup
	wg.Go(func() { l.pipe(s, c) })
	wg.Go(func() { l.pipe(c, s) })
	wg.Wait()
	p.mu.Lock()
	delete(p.conns, l)
	p.mu.Unlock()
}

func (l *link) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		select {
		case <-l.frozen:
			// Blackholed: keep reading (and dropping) until closed.
			if err != nil {
				l.close()
				return
			}
			continue
		default:
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				l.close()
				return
			}
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				l.close()
				return
			}
			l.close()
			return
		}
	}
}

func (l *link) close() {
	_ = l.client.Close()
	_ = l.server.Close()
}
