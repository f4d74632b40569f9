package testsignal

import (
	"testing"
	"time"
)

func TestSignal(t *testing.T) {
	var s Signal[int]
	s.Send(1) // not initialized: dropped, never blocks
	if _, err := s.WaitFor(time.Millisecond, nil); err == nil {
		t.Fatal("WaitFor on a signal never initialized succeeded")
	}
	s.Init()
	for i := range buffered + 10 { // past the buffer: the oldest go
		s.Send(i)
	}
	if v, err := s.WaitFor(time.Second, nil); err != nil || v != 10 {
		t.Fatalf("first kept value %d (%v), want 10", v, err)
	}
	if v, err := s.WaitFor(time.Second, func(v int) bool { return v > 100 }); err != nil || v != 101 {
		t.Fatalf("WaitFor(> 100) = %d (%v), want 101", v, err)
	}
	s.Clear()
	if v, err := s.WaitFor(20*time.Millisecond, nil); err == nil {
		t.Fatalf("WaitFor after Clear returned %d, want a timeout", v)
	}
	go func() { time.Sleep(10 * time.Millisecond); s.Send(7) }()
	if v, err := s.WaitFor(5*time.Second, nil); err != nil || v != 7 {
		t.Fatalf("WaitFor = %d (%v), want 7 sent later", v, err)
	}
}
