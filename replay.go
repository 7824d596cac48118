package rmm

import (
	"bufio"
	"compress/gzip"
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/gormm/rmm/internal/errshape"
)

// LogHeader is the first line (without its newline) of RMM's CSV event log: the format librmm's
// logging_resource_adaptor writes and its replay benchmark reads. After the header comes one line
// per allocator event:
//
//	Thread,Time,Action,Pointer,Size,Stream
//	140212345678912,09:41:07.015233,allocate,0x7f3a2c000000,4096,0
//	140212345678912,09:41:07.015420,free,0x7f3a2c000000,4096,0
//	140212345678912,09:41:07.016001,allocate failure,(nil),1099511627776,0x7f3a30003840
//
// The columns:
//   - Thread: the OS thread id, decimal.
//   - Time: local wall-clock time of day, HH:MM:SS.uuuuuu (microseconds, no date; it wraps at
//     midnight).
//   - Action: "allocate", "free" or "allocate failure".
//   - Pointer: as C's %p prints it: 0x and lowercase hex without padding; a null pointer is
//     "(nil)". Failure lines carry a null pointer, and so does a zero-byte allocation.
//   - Size: the byte count the caller asked for (not rounded), decimal. A free repeats the size
//     of its allocation; a failure gives the size that could not be had.
//   - Stream: the CUstream handle: 0 for the default (null) stream, else 0x and lowercase hex.
//
// LogWriter writes exactly this. LogReader reads it and also the older forms: a null pointer as
// 0x0 or 0, and a stream as decimal.
const LogHeader = "Thread,Time,Action,Pointer,Size,Stream"

// ErrMalformedLog: an RMM CSV event log could not be parsed. The error is a *LogParseError that
// gives the line and what was wrong.
var ErrMalformedLog = errors.New("rmm: malformed event log")

// EventAction is what happened in one line of an event log.
type EventAction int

const (
	// ActionAllocate: an allocation succeeded ("allocate").
	ActionAllocate EventAction = iota + 1
	// ActionFree: a pointer was handed back ("free").
	ActionFree
	// ActionAllocateFailure: an allocation failed ("allocate failure"); the pointer is null.
	ActionAllocateFailure
)

const (
	actionAllocate        = "allocate"
	actionFree            = "free"
	actionAllocateFailure = "allocate failure"
)

// String returns the action as the log spells it: "allocate", "free" or "allocate failure";
// other values give "EventAction(n)".
func (a EventAction) String() string {
	switch a {
	case ActionAllocate:
		return actionAllocate
	case ActionFree:
		return actionFree
	case ActionAllocateFailure:
		return actionAllocateFailure
	}
	return "EventAction(" + strconv.Itoa(int(a)) + ")"
}

// LogEvent is one line of an RMM CSV event log.
type LogEvent struct {
	Thread  uint64        // OS thread id of the caller
	Time    time.Duration // time of day since midnight (local wall clock), microsecond resolution
	Action  EventAction   // allocate, free or allocate failure
	Pointer DevicePtr     // address allocated or freed; 0 (null) for failures and zero-byte allocations
	Size    int           // bytes the caller asked for (unrounded); the failed size for a failure
	Stream  uintptr       // CUstream handle; 0 for the default stream
	Line    int           // 1-based line in the file it was read from; 0 when not read from a file; LogWriter ignores it
}

// LogParseError says where and why an event log could not be parsed. It wraps ErrMalformedLog.
type LogParseError struct {
	File   string // the file name when read with ReadLogFile, else ""
	Line   int    // 1-based line number
	Column string // the column at fault ("Size", ...), or "" when the fault is the whole line
	Msg    string // what was wrong
}

// Error reads "rmm: trace.csv:3: column Size: <what was wrong>: malformed event log" (or "line 3"
// where the log was not read from a file).
func (e *LogParseError) Error() string {
	var b strings.Builder
	b.WriteString(errshape.Prefix)
	if e.File != "" {
		b.WriteString(e.File)
		b.WriteString(":")
		b.WriteString(strconv.Itoa(e.Line))
	} else {
		b.WriteString("line ")
		b.WriteString(strconv.Itoa(e.Line))
	}
	if e.Column != "" {
		b.WriteString(": column ")
		b.WriteString(e.Column)
	}
	b.WriteString(": ")
	b.WriteString(e.Msg)
	b.WriteString(": ")
	b.WriteString(errshape.Trim(ErrMalformedLog))
	return b.String()
}

// Unwrap returns ErrMalformedLog.
func (e *LogParseError) Unwrap() error { return ErrMalformedLog }

// The columns a log must have, in the order LogWriter writes them.
const (
	colThread = iota
	colTime
	colAction
	colPointer
	colSize
	colStream
	numLogColumns
)

var logColumnNames = [numLogColumns]string{"Thread", "Time", "Action", "Pointer", "Size", "Stream"}

// LogReader reads an RMM CSV event log one event at a time. It is not safe for concurrent use.
type LogReader struct {
	csv     *csv.Reader
	cols    [numLogColumns]int // index of each column in a record
	nfields int                // fields per record, from the header
}

// NewLogReader reads the header of the event log in r and returns a reader of its events. Input
// that starts with the gzip magic bytes (1f 8b) is decompressed on the fly. Columns are found by
// their header names (Thread, Time, Action, Pointer, Size, Stream), in any order; other columns are
// ignored. A missing, empty or malformed header, or a missing or repeated column, returns a
// *LogParseError wrapping ErrMalformedLog; a read or decompression error is returned wrapped.
func NewLogReader(r io.Reader) (*LogReader, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	src := io.Reader(br)
	if magic, err := br.Peek(2); err == nil && magic[0] == 0x1f && magic[1] == 0x8b {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, errorf("reading gzip-compressed event log: %w", err)
		}
		src = zr
	}
	cr := csv.NewReader(src)
	cr.FieldsPerRecord = -1 // the field count is checked here, to name the line in our own words
	cr.ReuseRecord = true
	lr := &LogReader{csv: cr}

	header, err := cr.Read()
	if err != nil {
		if err == io.EOF {
			return nil, &LogParseError{Line: 1, Msg: "empty input: no header line (want " + LogHeader + ")"}
		}
		return nil, lr.readError(err)
	}
	line, _ := cr.FieldPos(0)
	for i := range lr.cols {
		lr.cols[i] = -1
	}
	for i, name := range header {
		if i == 0 {
			name = strings.TrimPrefix(name, "\ufeff") // a byte-order mark some editors add
		}
		for c, want := range logColumnNames {
			if name == want {
				if lr.cols[c] >= 0 {
					return nil, &LogParseError{Line: line, Msg: "header names column " + want + " twice"}
				}
				lr.cols[c] = i
			}
		}
	}
	for c, idx := range lr.cols {
		if idx < 0 {
			return nil, &LogParseError{Line: line, Msg: fmt.Sprintf("header has no %s column (header %q, want %s)", logColumnNames[c], strings.Join(header, ","), LogHeader)}
		}
	}
	lr.nfields = len(header)
	return lr, nil
}

// readError turns an error from the CSV reader into ours: a CSV syntax error becomes a
// *LogParseError, anything else (I/O, gzip) is wrapped.
func (lr *LogReader) readError(err error) error {
	var pe *csv.ParseError
	if errors.As(err, &pe) {
		return &LogParseError{Line: pe.Line, Msg: pe.Err.Error()}
	}
	return errorf("reading event log: %w", err)
}

// Read returns the next event, or io.EOF after the last. A line that cannot be parsed returns a
// *LogParseError (wrapping ErrMalformedLog) with its line number and the column at fault: wrong
// field count, a bad number, an unknown action, a bad time, a negative size. After such an error
// Read may be called again and continues with the next line. I/O and decompression errors are
// returned wrapped and end the log.
//
// Accepted forms: Thread decimal; Time HH:MM:SS with an optional fraction of 1 to 9 digits (kept
// to the microsecond, truncated); Action "allocate", "free" or "allocate failure"; Pointer hex
// with or without 0x, with "(nil)", "0x0" and "0" all meaning null; Size decimal, not negative;
// Stream 0x-prefixed hex or decimal.
func (lr *LogReader) Read() (LogEvent, error) {
	rec, err := lr.csv.Read()
	if err != nil {
		if err == io.EOF {
			return LogEvent{}, io.EOF
		}
		return LogEvent{}, lr.readError(err)
	}
	line, _ := lr.csv.FieldPos(0)
	if len(rec) != lr.nfields {
		return LogEvent{}, &LogParseError{Line: line, Msg: fmt.Sprintf("%d fields, want %d as in the header", len(rec), lr.nfields)}
	}
	e := LogEvent{Line: line}
	bad := func(col int, msg string) (LogEvent, error) {
		return LogEvent{}, &LogParseError{Line: line, Column: logColumnNames[col], Msg: msg}
	}

	s := rec[lr.cols[colThread]]
	if e.Thread, err = strconv.ParseUint(s, 10, 64); err != nil {
		return bad(colThread, fmt.Sprintf("%q is not a decimal thread id", s))
	}

	s = rec[lr.cols[colTime]]
	var ok bool
	if e.Time, ok = parseLogTime(s); !ok {
		return bad(colTime, fmt.Sprintf("%q is not a time of day HH:MM:SS.ffffff", s))
	}

	switch s = rec[lr.cols[colAction]]; s {
	case actionAllocate:
		e.Action = ActionAllocate
	case actionFree:
		e.Action = ActionFree
	case actionAllocateFailure:
		e.Action = ActionAllocateFailure
	default:
		return bad(colAction, fmt.Sprintf("unknown action %q (want allocate, free or allocate failure)", s))
	}

	s = rec[lr.cols[colPointer]]
	if e.Pointer, ok = parseLogPointer(s); !ok {
		return bad(colPointer, fmt.Sprintf("%q is not a pointer (0x hex or (nil))", s))
	}

	s = rec[lr.cols[colSize]]
	n, err := strconv.ParseUint(s, 10, 64)
	switch {
	case err == nil && n <= math.MaxInt:
		e.Size = int(n)
	case err == nil || errors.Is(err, strconv.ErrRange):
		return bad(colSize, fmt.Sprintf("size %s is too large", s))
	case len(s) > 1 && s[0] == '-' && isDecimal(s[1:]):
		return bad(colSize, fmt.Sprintf("negative size %s", s))
	default:
		return bad(colSize, fmt.Sprintf("%q is not a decimal byte count", s))
	}

	s = rec[lr.cols[colStream]]
	if e.Stream, ok = parseLogStream(s); !ok {
		return bad(colStream, fmt.Sprintf("%q is not a stream handle (0, 0x hex or decimal)", s))
	}
	return e, nil
}

// ReadAll reads the remaining events. It stops at the first error and returns the events read
// before it along with the error.
func (lr *LogReader) ReadAll() ([]LogEvent, error) {
	// Fill fixed-size chunks and join them once at the end: growing one slice by appending
	// copies it over and over, which costs more than parsing for a trace of 100k events.
	const chunkLen = 4096
	var chunks [][]LogEvent
	cur := make([]LogEvent, 0, chunkLen)
	var err error
	for {
		var e LogEvent
		if e, err = lr.Read(); err != nil {
			break
		}
		if len(cur) == chunkLen {
			chunks = append(chunks, cur)
			cur = make([]LogEvent, 0, chunkLen)
		}
		cur = append(cur, e)
	}
	if err == io.EOF {
		err = nil
	}
	if len(chunks) == 0 && len(cur) == 0 {
		return nil, err
	}
	events := make([]LogEvent, 0, len(chunks)*chunkLen+len(cur))
	for _, c := range chunks {
		events = append(events, c...)
	}
	return append(events, cur...), err
}

// ReadLog reads a whole event log (plain or gzip-compressed) from r. On a malformed line it
// returns the events before it and a *LogParseError wrapping ErrMalformedLog.
func ReadLog(r io.Reader) ([]LogEvent, error) {
	lr, err := NewLogReader(r)
	if err != nil {
		return nil, err
	}
	return lr.ReadAll()
}

// ReadLogFile reads the event log in the named file (plain or gzip-compressed). A parse error is a
// *LogParseError naming the file and line.
func ReadLogFile(path string) ([]LogEvent, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, errorf("reading event log: %w", err)
	}
	defer f.Close()
	events, err := ReadLog(f)
	if err != nil {
		var pe *LogParseError
		if errors.As(err, &pe) {
			pe.File = path
		} else {
			err = errorf("%s: %w", path, err)
		}
	}
	return events, err
}

// parseLogTime parses HH:MM:SS with an optional fraction of 1 to 9 digits into the time since
// midnight, truncated to the microsecond.
func parseLogTime(s string) (time.Duration, bool) {
	if len(s) < 8 || s[2] != ':' || s[5] != ':' {
		return 0, false
	}
	two := func(i int) (int, bool) {
		a, b := s[i], s[i+1]
		if a < '0' || a > '9' || b < '0' || b > '9' {
			return 0, false
		}
		return int(a-'0')*10 + int(b-'0'), true
	}
	h, ok1 := two(0)
	m, ok2 := two(3)
	sec, ok3 := two(6)
	if !ok1 || !ok2 || !ok3 || h > 23 || m > 59 || sec > 59 {
		return 0, false
	}
	d := time.Duration(h)*time.Hour + time.Duration(m)*time.Minute + time.Duration(sec)*time.Second
	frac := s[8:]
	if frac == "" {
		return d, true
	}
	if frac[0] != '.' || len(frac) < 2 || len(frac) > 10 {
		return 0, false
	}
	ns := 0
	for i := 1; i < 10; i++ {
		ns *= 10
		if i < len(frac) {
			c := frac[i]
			if c < '0' || c > '9' {
				return 0, false
			}
			ns += int(c - '0')
		}
	}
	return d + time.Duration(ns).Truncate(time.Microsecond), true
}

// isDecimal reports whether s is one or more ASCII digits.
func isDecimal(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return s != ""
}

// parseLogPointer parses a pointer as librmm's replay reader does (base 16, 0x optional) and
// accepts "(nil)" for null.
func parseLogPointer(s string) (DevicePtr, bool) {
	if s == "(nil)" {
		return 0, true
	}
	h := s
	if len(h) > 2 && h[0] == '0' && (h[1] == 'x' || h[1] == 'X') {
		h = h[2:]
	}
	v, err := strconv.ParseUint(h, 16, strconv.IntSize)
	if err != nil {
		return 0, false
	}
	return DevicePtr(v), true
}

// parseLogStream parses a stream handle: 0x-prefixed hex as librmm writes it, or decimal as
// older logs have it.
func parseLogStream(s string) (uintptr, bool) {
	base := 10
	if len(s) > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X') {
		s, base = s[2:], 16
	}
	v, err := strconv.ParseUint(s, base, strconv.IntSize)
	if err != nil {
		return 0, false
	}
	return uintptr(v), true
}

// LogWriter writes an RMM CSV event log byte for byte as librmm's logging_resource_adaptor does.
// It buffers: call Flush when done. It is not safe for concurrent use (LoggingResourceAdaptor
// serialises its own calls).
type LogWriter struct {
	w   *bufio.Writer
	buf []byte
}

// NewLogWriter returns a writer of an event log to w and writes the header line (LogHeader) into
// its buffer. An error writing to w is returned by the next Write or Flush.
func NewLogWriter(w io.Writer) *LogWriter {
	lw := &LogWriter{w: bufio.NewWriterSize(w, 64<<10), buf: make([]byte, 0, 128)}
	lw.w.WriteString(LogHeader + "\n")
	return lw
}

// Write appends one line for e: thread decimal, time HH:MM:SS.uuuuuu (truncated to the
// microsecond), the action, the pointer as C's %p ("(nil)" for 0, else 0x and lowercase hex), the
// size decimal, and the stream (0, else 0x and lowercase hex). e.Line is not written. An unknown
// action, a negative size or a time outside [0, 24h) returns an error wrapping ErrInvalidArgument
// and writes nothing. Errors from the underlying writer are sticky and returned here and by Flush.
func (lw *LogWriter) Write(e LogEvent) error {
	if err := checkLogEvent(e); err != nil {
		return err
	}
	lw.buf = appendLogLine(lw.buf[:0], e)
	_, err := lw.w.Write(lw.buf)
	return err
}

// Flush writes any buffered lines to the underlying writer.
func (lw *LogWriter) Flush() error { return lw.w.Flush() }

// checkLogEvent reports why e cannot be written, or nil.
func checkLogEvent(e LogEvent) error {
	switch {
	case e.Action < ActionAllocate || e.Action > ActionAllocateFailure:
		return errorf("LogWriter.Write: unknown action %v: %w", e.Action, ErrInvalidArgument)
	case e.Size < 0:
		return errorf("LogWriter.Write: negative size %d: %w", e.Size, ErrInvalidArgument)
	case e.Time < 0 || e.Time >= 24*time.Hour:
		return errorf("LogWriter.Write: time %v is not a time of day in [0, 24h): %w", e.Time, ErrInvalidArgument)
	}
	return nil
}

// appendLogLine appends e's line, newline included, to b. e must have passed checkLogEvent.
func appendLogLine(b []byte, e LogEvent) []byte {
	b = strconv.AppendUint(b, e.Thread, 10)
	b = append(b, ',')
	b = appendLogTime(b, e.Time)
	b = append(b, ',')
	b = append(b, e.Action.String()...)
	b = append(b, ',')
	if e.Pointer == 0 {
		b = append(b, "(nil)"...)
	} else {
		b = append(b, "0x"...)
		b = strconv.AppendUint(b, uint64(e.Pointer), 16)
	}
	b = append(b, ',')
	b = strconv.AppendInt(b, int64(e.Size), 10)
	b = append(b, ',')
	if e.Stream == 0 {
		b = append(b, '0')
	} else {
		b = append(b, "0x"...)
		b = strconv.AppendUint(b, uint64(e.Stream), 16)
	}
	return append(b, '\n')
}

// appendLogTime appends d, a time of day in [0, 24h), as HH:MM:SS.uuuuuu.
func appendLogTime(b []byte, d time.Duration) []byte {
	us := int64(d / time.Microsecond)
	frac := us % 1e6
	sec := us / 1e6
	h, m, s := sec/3600, sec/60%60, sec%60
	b = append(b, byte('0'+h/10), byte('0'+h%10), ':', byte('0'+m/10), byte('0'+m%10), ':',
		byte('0'+s/10), byte('0'+s%10), '.')
	for div := int64(1e5); div > 0; div /= 10 {
		b = append(b, byte('0'+frac/div%10))
	}
	return b
}

// timeOfDay returns t's wall-clock time since midnight in t's location, to the microsecond.
func timeOfDay(t time.Time) time.Duration {
	h, m, s := t.Clock()
	return time.Duration(h)*time.Hour + time.Duration(m)*time.Minute + time.Duration(s)*time.Second +
		(time.Duration(t.Nanosecond()) / time.Microsecond * time.Microsecond)
}
