package trainer

import (
	"fmt"
)

// ErrorKind says what went wrong with a trainer call, and so whether the
// step may be retried.
type ErrorKind int

const (
	// Died: the trainer process exited or was killed (also when this side
	// killed it because the call's context ended: the error then wraps the
	// context's), or its reply pipe reached end of file. Retryable: the
	// next call restarts it from the last checkpoint and replays.
	Died ErrorKind = iota + 1
	// Refused: the trainer replied ok:false; the message carries its own
	// error text. Not retryable.
	Refused
	// Protocol: a reply frame broke PROTOCOL.md; the message names the
	// frame (op and id) and the field, never the field's contents. The
	// trainer is killed (the conversation cannot be resynchronised). Not
	// retryable.
	Protocol
	// BadInput: an invalid Spec or request, or a request the run's state
	// cannot take (a train that skips an iteration). Not retryable.
	BadInput
	// Lost: a restart cannot restore the run: the checkpoint LATEST names
	// is missing or unreadable, or a journal line's rollouts file is gone.
	// The message names the iterations and paths. Not retryable.
	Lost
	// Timeout: the trainer did not start, answer hello and load its
	// checkpoint within Spec.StartTimeout. Retryable.
	Timeout
	// IO: this side's own files (the log, the journal, LATEST, the
	// checkpoint directory) could not be read or written. Retryable.
	IO
)

var kindNames = map[ErrorKind]string{
	Died: "died", Refused: "refused", Protocol: "protocol", BadInput: "bad input",
	Lost: "lost", Timeout: "timeout", IO: "io",
}

func (k ErrorKind) String() string {
	if s, ok := kindNames[k]; ok {
		return s
	}
	return fmt.Sprintf("ErrorKind(%d)", int(k))
}

// Retryable reports whether a later call may succeed where this one
// failed.
func (k ErrorKind) Retryable() bool { return k == Died || k == Timeout || k == IO }

// Error is every error the Manager returns.
type Error struct {
	Kind ErrorKind
	// Msg is the whole message: context, then the cause once.
	Msg string
	// Err is the cause where there is one (a context's error, a file
	// system error); already part of Msg.
	Err error
}

func (e *Error) Error() string { return e.Msg }
func (e *Error) Unwrap() error { return e.Err }

// errorf builds an *Error whose message is the formatted context followed
// by cause's text (when cause is not nil).
func errorf(kind ErrorKind, cause error, format string, args ...any) *Error {
	msg := fmt.Sprintf(format, args...)
	if cause != nil {
		msg += ": " + cause.Error()
	}
	return &Error{Kind: kind, Msg: msg, Err: cause}
}

// within prefixes an *Error's message with more context, keeping its
// kind; any other error becomes an IO error.
func within(err error, format string, args ...any) error {
	if err == nil {
		return nil
	}
	ctx := fmt.Sprintf(format, args...)
	if e, ok := err.(*Error); ok {
		return &Error{Kind: e.Kind, Msg: ctx + ": " + e.Msg, Err: e.Err}
	}
	return errorf(IO, err, "%s", ctx)
}
