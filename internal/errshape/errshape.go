// Package errshape makes the errors of module github.com/gormm/rmm in their one shape,
//
//	rmm: Op: what went wrong: cause
//
// with "rmm: " once, at the start, however deep the wrapping: an rmm error wrapped in another
// drops its own leading "rmm: ", as os.PathError and net.OpError name the operation once and
// leave their cause's text as it is. Package rmm, callocator and the commands use it.
package errshape

import (
	"fmt"
	"strings"
)

// Prefix starts every error message of the module, once.
const Prefix = "rmm: "

// Errorf is fmt.Errorf for the module's errors: it writes Prefix in front of the formatted text,
// and formats each error among args without its own leading Prefix. The errors given to %w are
// wrapped as fmt.Errorf wraps them (errors.Is and errors.As see them as they are; errors.Unwrap
// gives the one error of a single %w).
func Errorf(format string, args ...any) error {
	for i, a := range args {
		if e, ok := a.(error); ok {
			args[i] = causeText{e}
		}
	}
	err := fmt.Errorf(format, args...)
	msg := Prefix + err.Error()
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return &wrapError{msg, unCause(u.Unwrap())}
	case interface{ Unwrap() []error }:
		errs := u.Unwrap() // fmt's own copy
		for i := range errs {
			errs[i] = unCause(errs[i])
		}
		return &wrapErrors{msg, errs}
	}
	return &wrapErrors{msg: msg}
}

// Trim returns an error's text without its leading Prefix: the text of a cause.
func Trim(err error) string { return strings.TrimPrefix(err.Error(), Prefix) }

// causeText formats an error as the cause in another error's message.
type causeText struct{ err error }

func (c causeText) Error() string { return Trim(c.err) }

func unCause(err error) error {
	if c, ok := err.(causeText); ok {
		return c.err
	}
	return err
}

// wrapError is Errorf's error for a message that wraps one error; wrapErrors for none or several.
type wrapError struct {
	msg string
	err error
}

func (e *wrapError) Error() string { return e.msg }
func (e *wrapError) Unwrap() error { return e.err }

type wrapErrors struct {
	msg  string
	errs []error
}

func (e *wrapErrors) Error() string   { return e.msg }
func (e *wrapErrors) Unwrap() []error { return e.errs }
