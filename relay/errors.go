package relay

import "github.com/tedbank/outbox/relay/broker"

// errBrokerDown marks publish errors that the whole pipeline shared.
var errBrokerDown = broker.ErrUnavailable

// pipelineDown reports whether every command of a pipeline failed with the
// same error although they went to different streams: whatever it says, that
// is the broker refusing writes, not a problem of each event. (The same error
// on one stream may be that stream's problem, e.g. WRONGTYPE.)
func pipelineDown(errs []error, streams []string) bool {
	if len(errs) < 2 || errs[0] == nil {
		return false
	}
	distinct := false
	for i, err := range errs[1:] {
		if err == nil || err.Error() != errs[0].Error() {
			return false
		}
		distinct = distinct || streams[i+1] != streams[0]
	}
	return distinct
}
