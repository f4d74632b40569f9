//go:build !failpoint

package failpoint

// Enabled: this binary was built with -tags failpoint.
const Enabled = false

// Inject does nothing: fail points are compiled out.
func Inject(string) {}

// Error returns nil: fail points are compiled out.
func Error(string) error { return nil }
