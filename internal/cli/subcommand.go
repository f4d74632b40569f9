package cli

// The admin command groups (outbox dead, outbox fraud dlq) dispatch to their
// subcommands here; the work itself is in package admin (and admin/dlq).

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
)

// subcommand is one verb of a command group such as 'outbox dead'.
type subcommand struct {
	name, summary string
	run           func(ctx context.Context, e *env, args []string) error
}

// dispatch runs the subcommand args[0] of the group parent.
func (e *env) dispatch(ctx context.Context, parent string, subs []subcommand, args []string) error {
	names := make([]string, len(subs))
	for i, s := range subs {
		names[i] = s.name
	}
	quoted := make([]string, len(names))
	for i, n := range names {
		quoted[i] = "'" + parent + " " + n + "'"
	}
	want := strings.Join(quoted, " or ")
	e.cmd = parent
	if len(args) == 0 {
		return usagef("missing subcommand: want %s", want)
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		fmt.Fprintf(e.stderr, "usage: outbox %s <%s> [flags]\n\n", parent, strings.Join(names, "|"))
		for _, s := range subs {
			fmt.Fprintf(e.stderr, "  %-6s %s\n", s.name, s.summary)
		}
		fmt.Fprintf(e.stderr, "\nRun 'outbox %s <subcommand> -h' for its flags.\n", parent)
		return flag.ErrHelp
	}
	for _, s := range subs {
		if s.name == args[0] {
			return s.run(ctx, e, args[1:])
		}
	}
	return usagef("unknown subcommand %q: want %s", args[0], want)
}

// parseWithArgs is parse for commands that take positional arguments: flags
// may come before, between or after them. Everything after "--" is positional.
func (e *env) parseWithArgs(fs *flag.FlagSet, args []string) ([]string, error) {
	fs.SetOutput(io.Discard)
	var pos []string
	for {
		err := fs.Parse(args)
		if errors.Is(err, flag.ErrHelp) {
			fs.SetOutput(e.stderr)
			fs.Usage()
			return nil, err
		}
		if err != nil {
			return nil, usageError{err.Error()}
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		if used := len(args) - len(rest); used > 0 && args[used-1] == "--" {
			return append(pos, rest...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

func usageLine(fs *flag.FlagSet, line string) {
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: %s\n\nflags:\n", line)
		fs.PrintDefaults()
	}
}
