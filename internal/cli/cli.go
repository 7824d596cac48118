// Package cli holds what the repository's commands share about errors and exit statuses: a bad
// command line exits 2, an error the flag package already printed is not printed again, -h exits
// 0.
package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
)

var (
	// ErrUsage marks a bad command line (exit status 2).
	ErrUsage = errors.New("usage")
	// ErrPrinted marks an error already written to stderr (the flag package writes a flag it
	// cannot parse, with the usage): Main does not write it again.
	ErrPrinted = errors.New("already printed")
)

// printedError is an error that was already written to stderr: it matches ErrPrinted, and what
// it wraps.
type printedError struct{ error }

// Printed returns err marked as already written to stderr.
func Printed(err error) error { return printedError{err} }

func (e printedError) Unwrap() []error { return []error{e.error, ErrPrinted} }

// Usagef returns a bad command line's error: "usage: " and the message, matching ErrUsage.
func Usagef(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrUsage, fmt.Sprintf(format, a...))
}

// Status is the exit status for a command's error: 0 for none (or -h), 2 for a bad command
// line, 1 for any other error.
func Status(err error) int {
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, ErrUsage):
		return 2
	}
	return 1
}

// Main runs run on the process's arguments, writes its error (unless -h or already printed) as
// "name: error" to stderr, and exits with status(err).
func Main(name string, run func(args []string, stdout, stderr io.Writer) error, status func(error) int) {
	err := run(os.Args[1:], os.Stdout, os.Stderr)
	if err != nil && !errors.Is(err, flag.ErrHelp) && !errors.Is(err, ErrPrinted) {
		fmt.Fprintln(os.Stderr, name+":", err)
	}
	os.Exit(status(err))
}
