package bench

import (
	"bufio"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
)

// The memory figure of drain and consume is the peak resident set (VmHWM) of
// the whole harness process (relays or consumers, pools, the Go runtime, and
// the harness's own bookkeeping) over the timed phase: before it, freed memory
// is returned to the kernel and the high-water mark is reset to the current
// RSS by writing 5 to /proc/self/clear_refs (Linux). Without /proc the figures
// are left out.

// startRSS returns the mark to fill a Result from after the timed phase.
func startRSS() (before int64, ok bool) {
	debug.FreeOSMemory()
	if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
		return 0, false
	}
	rss, _, ok := procStatus()
	return rss, ok
}

// stopRSS sets the Result's memory figures when startRSS succeeded.
func stopRSS(r *Result, before int64, ok bool) {
	if !ok {
		return
	}
	if _, hwm, ok := procStatus(); ok {
		r.PeakRSSKB, r.RSSBeforeKB = ptr(hwm), ptr(before)
	}
}

// procStatus reads VmRSS and VmHWM (kB) from /proc/self/status.
func procStatus() (rss, hwm int64, ok bool) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	var got int
	for sc.Scan() {
		k, v, found := strings.Cut(sc.Text(), ":")
		if !found || (k != "VmRSS" && k != "VmHWM") {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err != nil {
			return 0, 0, false
		}
		if k == "VmRSS" {
			rss = n
		} else {
			hwm = n
		}
		got++
	}
	return rss, hwm, got == 2
}
