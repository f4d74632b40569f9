// Package failpoint kills the process at a named point, for crash tests.
//
// Production code marks its dangerous points with Inject("relay.after-xadd").
// When the environment variable OUTBOX_FAILPOINT names that point, the
// process sends itself SIGKILL there: no deferred function runs, connections
// drop abruptly and open transactions roll back, exactly as in a real crash.
// "name:N" fires on the N-th time the point is reached. When the variable is
// unset, Inject costs one comparison.
//
// Error("relay.after-busy") marks a point where a failing round trip is
// worse than a crash: when armed, it returns an error once, on the N-th hit,
// and the process goes on running (the error path is what is tested).
//
// Kill points: relay.after-claim, relay.after-xadd, and of each consumer
// (package consumer, Config.Name) <name>.after-read and <name>.after-effect
// (fraud.after-read, fraud.after-effect, ledger.after-read,
// ledger.after-effect), and on the inbox path (package consumer/inbox)
// inbox.after-insert and inbox.before-commit. Error points:
// relay.after-busy.
//
// With OUTBOX_FAILPOINT_ACTION=stop a kill point stops the process instead
// (SIGSTOP: a VM pause, a long GC, swap, with every connection left open);
// continued (SIGCONT), it goes on from that point, as a stalled process
// that wakes up does.
//
// Fail points exist only in binaries built with -tags failpoint (the crash
// tests, the chaos suite and make demo build theirs so). Without the tag,
// Inject and Error are empty functions: a relay or consumer embedded in a
// service, or the outbox binary from make build, ignores OUTBOX_FAILPOINT.
package failpoint

// EnvVar is the environment variable that arms a fail point.
const EnvVar = "OUTBOX_FAILPOINT"

// ActionEnvVar, set to "stop", makes the armed kill point stop the process
// instead of killing it.
const ActionEnvVar = "OUTBOX_FAILPOINT_ACTION"
