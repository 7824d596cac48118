package rmm

import (
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// tod builds a time of day.
func tod(h, m, s, us int) time.Duration {
	return time.Duration(h)*time.Hour + time.Duration(m)*time.Minute + time.Duration(s)*time.Second +
		time.Duration(us)*time.Microsecond
}

func TestEventActionString(t *testing.T) {
	assert.Equal(t, "allocate", ActionAllocate.String())
	assert.Equal(t, "free", ActionFree.String())
	assert.Equal(t, "allocate failure", ActionAllocateFailure.String())
	assert.Equal(t, "EventAction(0)", EventAction(0).String())
	assert.Equal(t, "EventAction(7)", EventAction(7).String())
}

// writerEvents and writerText are the same log as events and as the bytes librmm writes.
var writerEvents = []LogEvent{
	{Thread: 140212345678912, Time: tod(9, 41, 7, 15233), Action: ActionAllocate, Pointer: 0x7f3a2c000000, Size: 4096, Stream: 0},
	{Thread: 140212345678912, Time: tod(9, 41, 7, 15420), Action: ActionFree, Pointer: 0x7f3a2c000000, Size: 4096, Stream: 0},
	{Thread: 140212345678912, Time: tod(9, 41, 7, 16001), Action: ActionAllocateFailure, Pointer: 0, Size: 1099511627776, Stream: 0x2},
	{Thread: 0, Time: 0, Action: ActionAllocate, Pointer: 0, Size: 0, Stream: 0},
	{Thread: 7, Time: tod(23, 59, 59, 999999), Action: ActionAllocate, Pointer: 0x100, Size: 1, Stream: 0x7f9730003840},
	{Thread: 18446744073709551615, Time: tod(0, 0, 1, 1), Action: ActionFree, Pointer: 0xffffffffffffff00, Size: 9223372036854775807, Stream: 0x1},
}

const writerText = "Thread,Time,Action,Pointer,Size,Stream\n" +
	"140212345678912,09:41:07.015233,allocate,0x7f3a2c000000,4096,0\n" +
	"140212345678912,09:41:07.015420,free,0x7f3a2c000000,4096,0\n" +
	"140212345678912,09:41:07.016001,allocate failure,(nil),1099511627776,0x2\n" +
	"0,00:00:00.000000,allocate,(nil),0,0\n" +
	"7,23:59:59.999999,allocate,0x100,1,0x7f9730003840\n" +
	"18446744073709551615,00:00:01.000001,free,0xffffffffffffff00,9223372036854775807,0x1\n"

// withLines returns events with Line set as a reader of a file with one header line sets it.
func withLines(events []LogEvent) []LogEvent {
	out := make([]LogEvent, len(events))
	for i, e := range events {
		e.Line = i + 2
		out[i] = e
	}
	return out
}

func TestLogWriterExactBytes(t *testing.T) {
	var buf bytes.Buffer
	lw := NewLogWriter(&buf)
	for _, e := range writerEvents {
		require.NoError(t, lw.Write(e))
	}
	require.NoError(t, lw.Flush())
	require.Equal(t, writerText, buf.String())
}

func TestLogWriterTruncatesToMicroseconds(t *testing.T) {
	var buf bytes.Buffer
	lw := NewLogWriter(&buf)
	require.NoError(t, lw.Write(LogEvent{Time: 24*time.Hour - 1, Action: ActionFree, Pointer: 0xabc, Size: 3}))
	require.NoError(t, lw.Flush())
	require.Equal(t, LogHeader+"\n0,23:59:59.999999,free,0xabc,3,0\n", buf.String())
}

func TestLogWriterHeaderOnly(t *testing.T) {
	var buf bytes.Buffer
	require.NoError(t, NewLogWriter(&buf).Flush())
	require.Equal(t, "Thread,Time,Action,Pointer,Size,Stream\n", buf.String())
	events, err := ReadLog(&buf)
	require.NoError(t, err)
	require.Empty(t, events)
}

func TestLogWriterRejectsInvalidEvents(t *testing.T) {
	for name, e := range map[string]LogEvent{
		"zero action":       {Action: 0},
		"unknown action":    {Action: ActionAllocateFailure + 1},
		"negative size":     {Action: ActionAllocate, Size: -1},
		"negative time":     {Action: ActionFree, Time: -time.Microsecond},
		"time past the day": {Action: ActionFree, Time: 24 * time.Hour},
	} {
		t.Run(name, func(t *testing.T) {
			var buf bytes.Buffer
			lw := NewLogWriter(&buf)
			err := lw.Write(e)
			require.ErrorIs(t, err, ErrInvalidArgument)
			require.NoError(t, lw.Flush())
			require.Equal(t, LogHeader+"\n", buf.String(), "nothing may be written for a rejected event")
		})
	}
}

// logFailingWriter fails every write.
type logFailingWriter struct{ err error }

func (w logFailingWriter) Write(p []byte) (int, error) { return 0, w.err }

func TestLogWriterReportsWriteErrors(t *testing.T) {
	boom := errors.New("disk full")
	lw := NewLogWriter(logFailingWriter{boom})
	require.ErrorIs(t, lw.Flush(), boom)
	require.ErrorIs(t, lw.Write(writerEvents[0]), boom, "the error is sticky")
}

func TestLogRoundTrip(t *testing.T) {
	events, err := ReadLog(strings.NewReader(writerText))
	require.NoError(t, err)
	require.Equal(t, withLines(writerEvents), events)

	var buf bytes.Buffer
	lw := NewLogWriter(&buf)
	for _, e := range events {
		require.NoError(t, lw.Write(e))
	}
	require.NoError(t, lw.Flush())
	require.Equal(t, writerText, buf.String())
}

func gzipBytes(t testing.TB, b []byte) []byte {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	_, err := zw.Write(b)
	require.NoError(t, err)
	require.NoError(t, zw.Close())
	return buf.Bytes()
}

func TestLogReaderGzip(t *testing.T) {
	events, err := ReadLog(bytes.NewReader(gzipBytes(t, []byte(writerText))))
	require.NoError(t, err)
	require.Equal(t, withLines(writerEvents), events)
}

func TestLogReaderStreaming(t *testing.T) {
	lr, err := NewLogReader(strings.NewReader(writerText))
	require.NoError(t, err)
	for i, want := range withLines(writerEvents) {
		got, err := lr.Read()
		require.NoError(t, err, "event %d", i)
		require.Equal(t, want, got)
	}
	_, err = lr.Read()
	require.Equal(t, io.EOF, err)
	_, err = lr.Read()
	require.Equal(t, io.EOF, err)
}

func TestLogReaderOlderAndLooserForms(t *testing.T) {
	cases := []struct {
		name string
		text string
		want []LogEvent
	}{
		{
			name: "null pointers as 0x0 and 0, streams as 0x0 and decimal",
			text: LogHeader + "\n" +
				"5,01:02:03.000004,allocate failure,0x0,100,0x0\n" +
				"5,01:02:03.000005,allocate,0,0,140212345678912\n" +
				"5,01:02:03.000006,allocate,(nil),0,0\n",
			want: []LogEvent{
				{Thread: 5, Time: tod(1, 2, 3, 4), Action: ActionAllocateFailure, Size: 100, Line: 2},
				{Thread: 5, Time: tod(1, 2, 3, 5), Action: ActionAllocate, Stream: 140212345678912, Line: 3},
				{Thread: 5, Time: tod(1, 2, 3, 6), Action: ActionAllocate, Line: 4},
			},
		},
		{
			name: "pointer without 0x and in upper case, stream 0X",
			text: LogHeader + "\n1,00:00:00.000000,free,7F3A2C000000,8,0X7F00\n1,00:00:00.000000,free,0XAB,8,0x7f00\n",
			want: []LogEvent{
				{Thread: 1, Action: ActionFree, Pointer: 0x7f3a2c000000, Size: 8, Stream: 0x7f00, Line: 2},
				{Thread: 1, Action: ActionFree, Pointer: 0xab, Size: 8, Stream: 0x7f00, Line: 3},
			},
		},
		{
			name: "fewer, no and more fractional digits",
			text: LogHeader + "\n" +
				"1,00:00:01.5,allocate,0x100,1,0\n" +
				"1,12:34:56,allocate,0x200,1,0\n" +
				"1,00:00:00.123456789,allocate,0x300,1,0\n" +
				"1,23:59:59.9999999,allocate,0x400,1,0\n",
			want: []LogEvent{
				{Thread: 1, Time: 1500 * time.Millisecond, Action: ActionAllocate, Pointer: 0x100, Size: 1, Line: 2},
				{Thread: 1, Time: tod(12, 34, 56, 0), Action: ActionAllocate, Pointer: 0x200, Size: 1, Line: 3},
				{Thread: 1, Time: 123456 * time.Microsecond, Action: ActionAllocate, Pointer: 0x300, Size: 1, Line: 4},
				{Thread: 1, Time: tod(23, 59, 59, 999999), Action: ActionAllocate, Pointer: 0x400, Size: 1, Line: 5},
			},
		},
		{
			name: "columns in another order, an extra column, CRLF, byte-order mark, quotes, blank lines",
			text: "\ufeffStream,Size,Extra,Pointer,Action,Time,Thread\r\n" +
				"\r\n" +
				"0x10,256,\"x,\ny\",0x7f00,allocate,00:00:02.000003,42\r\n" +
				"\r\n" +
				"\"0\",\"256\",,\"0x7f00\",\"free\",\"00:00:02.000004\",\"42\"\r\n",
			want: []LogEvent{
				{Thread: 42, Time: tod(0, 0, 2, 3), Action: ActionAllocate, Pointer: 0x7f00, Size: 256, Stream: 0x10, Line: 3},
				{Thread: 42, Time: tod(0, 0, 2, 4), Action: ActionFree, Pointer: 0x7f00, Size: 256, Stream: 0, Line: 6},
			},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := ReadLog(strings.NewReader(c.text))
			require.NoError(t, err)
			require.Equal(t, c.want, got)
		})
	}
}

func TestLogReaderErrors(t *testing.T) {
	const h = LogHeader + "\n"
	const ok = "1,00:00:00.000000,allocate,0x100,256,0\n"
	cases := []struct {
		name   string
		text   string
		line   int
		column string
		msg    string
	}{
		{"empty input", "", 1, "", "no header"},
		{"blank input", "\n\n", 1, "", "no header"},
		{"missing column", "Thread,Time,Action,Pointer,Size\n" + ok, 1, "", "no Stream column"},
		{"misspelt column", "Thread,Time,Action,Pointer,size,Stream\n", 1, "", "no Size column"},
		{"repeated column", "Thread,Time,Action,Pointer,Size,Stream,Size\n", 1, "", "Size twice"},
		{"header not first", "\n\n" + ok, 3, "", "no Thread column"},
		{"too few fields", h + ok + "1,00:00:00.000000,free,0x100,256\n", 3, "", "5 fields, want 6"},
		{"too many fields", h + ok + ok + "1,00:00:00.000000,free,0x100,256,0,9\n", 4, "", "7 fields, want 6"},
		{"bad thread", h + "t1,00:00:00.000000,allocate,0x100,256,0\n", 2, "Thread", `"t1" is not a decimal thread id`},
		{"negative thread", h + "-1,00:00:00.000000,allocate,0x100,256,0\n", 2, "Thread", "thread id"},
		{"thread too large", h + "18446744073709551616,00:00:00.000000,allocate,0x100,256,0\n", 2, "Thread", "thread id"},
		{"hour 24", h + ok + "1,24:00:00.000000,allocate,0x100,256,0\n", 3, "Time", `"24:00:00.000000" is not a time of day`},
		{"minute 60", h + "1,00:60:00.000000,allocate,0x100,256,0\n", 2, "Time", "time of day"},
		{"second 60", h + "1,00:00:60.000000,allocate,0x100,256,0\n", 2, "Time", "time of day"},
		{"one-digit hour", h + "1,0:00:00.000000,allocate,0x100,256,0\n", 2, "Time", "time of day"},
		{"dot without digits", h + "1,00:00:00.,allocate,0x100,256,0\n", 2, "Time", "time of day"},
		{"ten fractional digits", h + "1,00:00:00.1234567890,allocate,0x100,256,0\n", 2, "Time", "time of day"},
		{"comma fraction", h + "1,\"00:00:00,5\",allocate,0x100,256,0\n", 2, "Time", "time of day"},
		{"letter in fraction", h + "1,00:00:00.12a,allocate,0x100,256,0\n", 2, "Time", "time of day"},
		{"date and time", h + "1,2026-11-30 00:00:00.000000,allocate,0x100,256,0\n", 2, "Time", "time of day"},
		{"empty time", h + "1,,allocate,0x100,256,0\n", 2, "Time", "time of day"},
		{"unknown action", h + ok + ok + ok + "1,00:00:00.000000,alloc,0x100,256,0\n", 5, "Action", `unknown action "alloc"`},
		{"action in capitals", h + "1,00:00:00.000000,Allocate,0x100,256,0\n", 2, "Action", "unknown action"},
		{"bad pointer", h + "1,00:00:00.000000,allocate,0x10g,256,0\n", 2, "Pointer", `"0x10g" is not a pointer`},
		{"bare 0x pointer", h + "1,00:00:00.000000,allocate,0x,256,0\n", 2, "Pointer", "not a pointer"},
		{"nil without parentheses", h + "1,00:00:00.000000,allocate,nil,256,0\n", 2, "Pointer", "not a pointer"},
		{"pointer too large", h + "1,00:00:00.000000,allocate,0x1ffffffffffffffff,256,0\n", 2, "Pointer", "not a pointer"},
		{"negative size", h + ok + "1,00:00:00.000000,allocate,0x100,-256,0\n", 3, "Size", "negative size -256"},
		{"size not a number", h + "1,00:00:00.000000,allocate,0x100,2k,0\n", 2, "Size", `"2k" is not a decimal byte count`},
		{"fractional size", h + "1,00:00:00.000000,allocate,0x100,1.5,0\n", 2, "Size", "not a decimal byte count"},
		{"empty size", h + "1,00:00:00.000000,allocate,0x100,,0\n", 2, "Size", "not a decimal byte count"},
		{"size too large", h + "1,00:00:00.000000,allocate,0x100,9223372036854775808,0\n", 2, "Size", "too large"},
		{"size overflowing 64 bits", h + "1,00:00:00.000000,allocate,0x100,99999999999999999999,0\n", 2, "Size", "too large"},
		{"bad stream", h + "1,00:00:00.000000,allocate,0x100,256,0xzz\n", 2, "Stream", `"0xzz" is not a stream handle`},
		{"negative stream", h + "1,00:00:00.000000,allocate,0x100,256,-1\n", 2, "Stream", "not a stream handle"},
		{"empty stream", h + "1,00:00:00.000000,allocate,0x100,256,\n", 2, "Stream", "not a stream handle"},
		{"bare quote", h + ok + "1,00:00:00.000000,allocate,0x1\"00,256,0\n", 3, "", "bare \""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := ReadLog(strings.NewReader(c.text))
			require.Error(t, err)
			require.ErrorIs(t, err, ErrMalformedLog)
			require.NotErrorIs(t, err, ErrInvalidArgument)
			var pe *LogParseError
			require.ErrorAs(t, err, &pe)
			assert.Equal(t, c.line, pe.Line, "line")
			assert.Equal(t, c.column, pe.Column, "column")
			assert.Contains(t, pe.Msg, c.msg)
			assert.Contains(t, err.Error(), fmt.Sprintf("line %d", c.line))
			if c.column != "" {
				assert.Contains(t, err.Error(), "column "+c.column)
			}
		})
	}
}

func TestLogReaderContinuesAfterBadLine(t *testing.T) {
	text := LogHeader + "\n" +
		"1,00:00:00.000001,allocate,0x100,256,0\n" +
		"1,00:00:00.000002,allocate,0x200,-5,0\n" +
		"1,00:00:00.000003,free,0x100,256,0\n"
	events, err := ReadLog(strings.NewReader(text))
	require.ErrorIs(t, err, ErrMalformedLog)
	require.Equal(t, []LogEvent{{Thread: 1, Time: time.Microsecond, Action: ActionAllocate, Pointer: 0x100, Size: 256, Line: 2}}, events,
		"ReadLog returns the events before the error")

	lr, err := NewLogReader(strings.NewReader(text))
	require.NoError(t, err)
	e, err := lr.Read()
	require.NoError(t, err)
	require.Equal(t, 2, e.Line)
	_, err = lr.Read()
	var pe *LogParseError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, 3, pe.Line)
	e, err = lr.Read()
	require.NoError(t, err)
	require.Equal(t, LogEvent{Thread: 1, Time: 3 * time.Microsecond, Action: ActionFree, Pointer: 0x100, Size: 256, Line: 4}, e)
	_, err = lr.Read()
	require.Equal(t, io.EOF, err)
}

func TestLogReaderCorruptGzip(t *testing.T) {
	z := gzipBytes(t, []byte(writerText))
	z[len(z)-5] ^= 0xff // the stored length no longer matches
	_, err := ReadLog(bytes.NewReader(z))
	require.Error(t, err)
	require.NotErrorIs(t, err, ErrMalformedLog, "a corrupt gzip stream is an I/O error, not a malformed log")

	_, err = ReadLog(bytes.NewReader([]byte{0x1f, 0x8b, 0, 0}))
	require.Error(t, err)
	require.NotErrorIs(t, err, ErrMalformedLog)
}

func TestLogReaderReadError(t *testing.T) {
	boom := errors.New("connection reset")
	r := io.MultiReader(strings.NewReader(LogHeader+"\n"+"1,00:00:00.000000,allocate,0x100,256,0\n"), iotestErrReader{boom})
	events, err := ReadLog(r)
	require.ErrorIs(t, err, boom)
	require.NotErrorIs(t, err, ErrMalformedLog)
	require.Len(t, events, 1)
}

// iotestErrReader returns err on every read (testing/iotest.ErrReader, without the import).
type iotestErrReader struct{ err error }

func (r iotestErrReader) Read([]byte) (int, error) { return 0, r.err }

func TestReadLogFile(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.csv")
	require.NoError(t, os.WriteFile(good, []byte(writerText), 0o644))
	events, err := ReadLogFile(good)
	require.NoError(t, err)
	require.Equal(t, withLines(writerEvents), events)

	gz := filepath.Join(dir, "good.csv.gz")
	require.NoError(t, os.WriteFile(gz, gzipBytes(t, []byte(writerText)), 0o644))
	events, err = ReadLogFile(gz)
	require.NoError(t, err)
	require.Equal(t, withLines(writerEvents), events)

	bad := filepath.Join(dir, "bad.csv")
	require.NoError(t, os.WriteFile(bad, []byte(writerText+"1,00:00:00.000000,allocate,0x100,x,0\n"), 0o644))
	_, err = ReadLogFile(bad)
	var pe *LogParseError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, bad, pe.File)
	require.Equal(t, 8, pe.Line)
	require.Equal(t, "Size", pe.Column)
	require.Equal(t, "rmm: "+bad+":8: column Size: \"x\" is not a decimal byte count: malformed event log", err.Error())

	_, err = ReadLogFile(filepath.Join(dir, "missing.csv"))
	require.ErrorIs(t, err, fs.ErrNotExist)
}

// traceFacts are the figures of one trace, from testdata/traces/README.md.
type traceFacts struct {
	file                      string
	events                    int
	allocates, frees, failure int
	neverFreed                int
	neverFreedMiB             string // as the table prints it, one decimal
	peakLive                  int
	distinctSizes             int
	streams                   map[uintptr]int // events per stream
	threads                   int
	csvSHA256                 string // of the decompressed CSV
}

var traceTable = []traceFacts{
	{
		file: "resnet50_train_b64_fp32.csv.gz", events: 69901, allocates: 34952, frees: 34949, failure: 0,
		neverFreed: 3, neverFreedMiB: "65.0", peakLive: 10891909120, distinctSizes: 132,
		streams: map[uintptr]int{0: 69741, 0x2d033d60: 160}, threads: 1,
		csvSHA256: "ac004aedb133c40a3d0a31694d69aac3660e104ea4ae0dd34b2b09752785ed85",
	},
	{
		file: "gpt2s_train_adamw_seq512_bf16.csv.gz", events: 112051, allocates: 56027, frees: 56024, failure: 0,
		neverFreed: 3, neverFreedMiB: "65.0", peakLive: 8113058504, distinctSizes: 45,
		streams: map[uintptr]int{0: 112051}, threads: 1,
		csvSHA256: "72ef7c7fea76bf55f86f513bdc7559a87f2850b15501bf677d0a7344db03d7dc",
	},
	{
		file: "bert_base_infer_dynamic_fp16.csv.gz", events: 80602, allocates: 40296, frees: 40294, failure: 12,
		neverFreed: 2, neverFreedMiB: "33.0", peakLive: 3076346368, distinctSizes: 819,
		streams: map[uintptr]int{0: 80602}, threads: 1,
		csvSHA256: "b54240680649e8fd5722666f588b78fc2e3209507c67b2cd48b7dd363e8bcc64",
	},
	{
		file: "cupy_fft_linalg_2threads.csv.gz", events: 110156, allocates: 55078, frees: 55078, failure: 0,
		neverFreed: 0, neverFreedMiB: "0.0", peakLive: 618135910, distinctSizes: 9512,
		streams: map[uintptr]int{0x7f9730003840: 56808, 0x7f972cd265b0: 53348}, threads: 2,
		csvSHA256: "6464fb2bab5d496a136c5140ce6f4412c1e88bc893260005b2f0be53a17b2d66",
	},
	{
		file: "vit_b16_train_ckpt_b128_bf16.csv.gz", events: 100636, allocates: 50320, frees: 50316, failure: 0,
		neverFreed: 4, neverFreedMiB: "66.0", peakLive: 3068767896, distinctSizes: 43,
		streams: map[uintptr]int{0: 100636}, threads: 1,
		csvSHA256: "abe6ef4424f78c39143c343ba86f30c4ca6312aa6d18fad1e727d4e44b6e1611",
	},
	{
		file: "gpt2m_lora_varlen_bf16.csv.gz", events: 113131, allocates: 56567, frees: 56564, failure: 0,
		neverFreed: 3, neverFreedMiB: "65.0", peakLive: 22386776456, distinctSizes: 103,
		streams: map[uintptr]int{0: 113131}, threads: 1,
		csvSHA256: "c8a28e5c46fd7b8b295b3f3883f1a3218f15a557a3a8e69b086060e24fcdd0d8",
	},
	{
		file: "gpt2_generate_varbatch_fp16.csv.gz", events: 216300, allocates: 108151, frees: 108149, failure: 0,
		neverFreed: 2, neverFreedMiB: "33.0", peakLive: 1072926488, distinctSizes: 920,
		streams: map[uintptr]int{0: 216300}, threads: 1,
		csvSHA256: "7c66a61aebc5ea5a1f3c36ade5da2213ebbdb0b7036116e61c6d1bd9d68f8051",
	},
	{
		file: "torch_3streams_resnet18_encoder_fp16.csv.gz", events: 110244, allocates: 55124, frees: 55120, failure: 0,
		neverFreed: 4, neverFreedMiB: "66.0", peakLive: 381724160, distinctSizes: 168,
		streams: map[uintptr]int{0: 392, 0xb2229d0: 2760, 0xac9c3f0: 58514, 0xb0b9190: 48578}, threads: 1,
		csvSHA256: "9463ad72f73596c1957af90cb4c01a9051c0adb3fb28f45963ec343695d12620",
	},
	{
		file: "unet_diffusion_multiscale_bf16.csv.gz", events: 101057, allocates: 50530, frees: 50527, failure: 0,
		neverFreed: 3, neverFreedMiB: "65.0", peakLive: 5483610971, distinctSizes: 284,
		streams: map[uintptr]int{0: 101057}, threads: 1,
		csvSHA256: "524dffd23c1d0e55876f5d9a50e98bc131baec6280b6b3971336bd7147362ea9",
	},
	{
		file: "moe_top2_train_bf16.csv.gz", events: 102781, allocates: 51392, frees: 51389, failure: 0,
		neverFreed: 3, neverFreedMiB: "65.0", peakLive: 6918709928, distinctSizes: 2668,
		streams: map[uintptr]int{0: 102781}, threads: 1,
		csvSHA256: "104439b556fe669d89270ef1011feda8e9bf41ef82c21d9d3ba18fea9a35b9d7",
	},
	{
		file: "fasterrcnn_r50fpn_train_varsize_bf16.csv.gz", events: 102243, allocates: 51123, frees: 51120, failure: 0,
		neverFreed: 3, neverFreedMiB: "65.0", peakLive: 5173386177, distinctSizes: 3548,
		streams: map[uintptr]int{0: 102243}, threads: 1,
		csvSHA256: "52b8dff96a7976bf74a29fd027feec35e999ae4c80b1a9b4b82dd7635687e0e8",
	},
	{
		file: "lstm_ctc_varlen_fp32.csv.gz", events: 100082, allocates: 50042, frees: 50040, failure: 0,
		neverFreed: 2, neverFreedMiB: "64.0", peakLive: 9705602296, distinctSizes: 4003,
		streams: map[uintptr]int{0: 100082}, threads: 1,
		csvSHA256: "a7702da86a44f8a01aea1395e2f4b150ba8cff7b29a4982ac2f60394b18069a3",
	},
	{
		file: "cupy_ndimage_sparse_1stream.csv.gz", events: 110118, allocates: 55059, frees: 55059, failure: 0,
		neverFreed: 0, neverFreedMiB: "0.0", peakLive: 2711677746, distinctSizes: 4987,
		streams: map[uintptr]int{0x16426be0: 110118}, threads: 1,
		csvSHA256: "4ef57145955b1649819a8cebf81644ad22c9ed9cdf06fea6bf09a3d21a09709e",
	},
	{
		file: "t5_seq2seq_dynpad_bf16.csv.gz", events: 112084, allocates: 56043, frees: 56041, failure: 0,
		neverFreed: 2, neverFreedMiB: "64.0", peakLive: 39892013988, distinctSizes: 688,
		streams: map[uintptr]int{0: 112084}, threads: 1,
		csvSHA256: "deb2ea7d6a3c631c13a12ed199ca93a6742589e699d38c7e3fdd424e46f9ece8",
	},
	{
		file: "gnn_mpnn_varsize_fp32.csv.gz", events: 100377, allocates: 50190, frees: 50187, failure: 0,
		neverFreed: 3, neverFreedMiB: "65.0", peakLive: 25604129332, distinctSizes: 2805,
		streams: map[uintptr]int{0: 100377}, threads: 1,
		csvSHA256: "ee1f9bb1859576f207e9a0412fd30a1735420c209d8e88f7fcd96f745f13a440",
	},
	{
		file: "vae_decode_varres_fp16.csv.gz", events: 100010, allocates: 50005, frees: 50005, failure: 0,
		neverFreed: 0, neverFreedMiB: "0.0", peakLive: 7866829721, distinctSizes: 479,
		streams: map[uintptr]int{0: 100010}, threads: 1,
		csvSHA256: "e1c5f6833f25ff2d59ee0e333e1ff08fac31427561483f303694bb6a656a0a6c",
	},
	{
		file: "dit_varres_train_accum_bf16.csv.gz", events: 101641, allocates: 50822, frees: 50819, failure: 0,
		neverFreed: 3, neverFreedMiB: "65.0", peakLive: 2777260872, distinctSizes: 94,
		streams: map[uintptr]int{0: 101641}, threads: 1,
		csvSHA256: "760944a646cfd295edeb6fff31bd7d740c1eb342ed6b3d1f5d644b0fca437735",
	},
	{
		file: "speech_encdec_greedy_varlen_fp16.csv.gz", events: 107924, allocates: 53963, frees: 53961, failure: 0,
		neverFreed: 2, neverFreedMiB: "33.0", peakLive: 245213208, distinctSizes: 201,
		streams: map[uintptr]int{0: 107924}, threads: 1,
		csvSHA256: "5ed30cc6ab51d4800cb8b93d0898bfb79dc4a60013d6060943a82caa9df09f18",
	},
	{
		file: "video3d_r2p1d_train_varclip_bf16.csv.gz", events: 100585, allocates: 50294, frees: 50291, failure: 0,
		neverFreed: 3, neverFreedMiB: "65.0", peakLive: 2813632804, distinctSizes: 362,
		streams: map[uintptr]int{0: 100585}, threads: 1,
		csvSHA256: "2570183e773dfe44855c9c92a468e856a4b6e15906576f15cc4f5ebc5a854367",
	},
	{
		file: "dlrm_sparse_train_varbatch_fp32.csv.gz", events: 100441, allocates: 50222, frees: 50219, failure: 0,
		neverFreed: 3, neverFreedMiB: "65.0", peakLive: 910894520, distinctSizes: 5071,
		streams: map[uintptr]int{0: 100441}, threads: 1,
		csvSHA256: "371141cd1124c4c5842c4bd0bdc34ab4309fdb3e8ab12ec04e994391a7dedafa",
	},
	{
		file: "bert_base_mlm_accum_eval_varlen_bf16.csv.gz", events: 104689, allocates: 52346, frees: 52343, failure: 0,
		neverFreed: 3, neverFreedMiB: "65.0", peakLive: 7419071632, distinctSizes: 605,
		streams: map[uintptr]int{0: 104689}, threads: 1,
		csvSHA256: "b3415c050963541e535b6f8c1c7f5387eadce32e50cd7ce86d8810ce43d7c4b4",
	},
	{
		file: "segformer_mit_train_varcrop_2streams_bf16.csv.gz", events: 101147, allocates: 50575, frees: 50572, failure: 0,
		neverFreed: 3, neverFreedMiB: "65.0", peakLive: 17125317976, distinctSizes: 371,
		streams: map[uintptr]int{0: 100717, 0x3bdbde00: 430}, threads: 1,
		csvSHA256: "0a9f92499e178bc54a03e1f9f9502072ef734a57fcd889d23477e98046509147",
	},
	{
		file: "llm_serve_4streams_kvcache_fp16.csv.gz", events: 110612, allocates: 55310, frees: 55302, failure: 0,
		neverFreed: 8, neverFreedMiB: "132.0", peakLive: 824295840, distinctSizes: 168,
		streams: map[uintptr]int{0: 296, 0x1d2170f0: 27750, 0x1d25e1d0: 27522, 0x1d22aa30: 27482, 0x1d24f8b0: 27562}, threads: 1,
		csvSHA256: "268ded80651440132654ad7a85fc46252d1f7e92db18d98f835712a2408c6351",
	},
	{
		file: "cupy_signal_3streams_1thread.csv.gz", events: 110052, allocates: 55026, frees: 55026, failure: 0,
		neverFreed: 0, neverFreedMiB: "0.0", peakLive: 1621257168, distinctSizes: 267,
		streams: map[uintptr]int{0xa54eec0: 75172, 0xa542600: 18396, 0xa5424a0: 16484}, threads: 1,
		csvSHA256: "d9f557be4c0aae3e71b64c92bcf9e2059f4b20b3fd4b866cc856c92e01167f54",
	},
	{
		file: "gpt_ema_sidestream_train_bf16.csv.gz", events: 110023, allocates: 55014, frees: 55009, failure: 0,
		neverFreed: 5, neverFreedMiB: "98.0", peakLive: 11906382600, distinctSizes: 106,
		streams: map[uintptr]int{0: 103103, 0xf4a5b70: 6920}, threads: 1,
		csvSHA256: "4e473b06e419b0989b608fd4be215b8a7feb9a582de0fc5010062fb46df9775e",
	},
}

// TestReadTraces reads every committed trace and checks it against the figures published with it;
// then writes the events back and checks the bytes equal the original CSV exactly.
func TestReadTraces(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	files, err := filepath.Glob(filepath.Join("testdata", "traces", "*.csv.gz"))
	require.NoError(t, err)
	require.Len(t, files, len(traceTable), "every trace in testdata/traces has a row in the table")
	for _, facts := range traceTable {
		t.Run(strings.TrimSuffix(facts.file, ".csv.gz"), func(t *testing.T) {
			// One stream with failed allocations; two threads (the CuPy recorder); five streams.
			shortTraces(t, strings.TrimSuffix(facts.file, ".csv.gz"), "bert_base_infer_dynamic_fp16", "cupy_fft_linalg_2threads", "llm_serve_4streams_kvcache_fp16")
			t.Parallel()
			path := filepath.Join("testdata", "traces", facts.file)
			events, err := ReadLogFile(path)
			require.NoError(t, err)
			require.Len(t, events, facts.events)

			var allocs, frees, failures int
			live := map[DevicePtr]int{}
			var starts []DevicePtr // the live allocations' pointers, sorted
			var liveBytes, peak int
			sizes := map[int]bool{}
			streams := map[uintptr]int{}
			threads := map[uint64]bool{}
			// Plain comparisons in the loop over ~100,000 events: testify's reflection there took
			// most of the test's time under -race.
			for i, e := range events {
				if e.Line != i+2 {
					t.Fatalf("event %d has line %d, want %d", i, e.Line, i+2)
				}
				if i == 0 && e.Time != 0 {
					t.Fatalf("line %d: time %v; traces are rebased to start at midnight", e.Line, e.Time)
				}
				if i > 0 && e.Time < events[i-1].Time {
					t.Fatalf("line %d: time %v goes back from %v", e.Line, e.Time, events[i-1].Time)
				}
				streams[e.Stream]++
				threads[e.Thread] = true
				switch e.Action {
				case ActionAllocate:
					allocs++
					sizes[e.Size] = true
					if _, dup := live[e.Pointer]; dup {
						t.Fatalf("line %d allocates a live pointer", e.Line)
					}
					// No overlap with the live allocation below it or the one above it.
					k, _ := slices.BinarySearch(starts, e.Pointer)
					if k > 0 && starts[k-1]+DevicePtr(live[starts[k-1]]) > e.Pointer {
						t.Fatalf("line %d allocates %#x, inside the live allocation at %#x", e.Line, uintptr(e.Pointer), uintptr(starts[k-1]))
					}
					if k < len(starts) && e.Pointer+DevicePtr(e.Size) > starts[k] {
						t.Fatalf("line %d allocates %#x+%d, over the live allocation at %#x", e.Line, uintptr(e.Pointer), e.Size, uintptr(starts[k]))
					}
					starts = slices.Insert(starts, k, e.Pointer)
					live[e.Pointer] = e.Size
					liveBytes += e.Size
					peak = max(peak, liveBytes)
				case ActionFree:
					frees++
					size, ok := live[e.Pointer]
					if !ok {
						t.Fatalf("line %d frees a pointer that is not live", e.Line)
					}
					if size != e.Size {
						t.Fatalf("line %d frees %d bytes of a %d-byte allocation", e.Line, e.Size, size)
					}
					delete(live, e.Pointer)
					k, _ := slices.BinarySearch(starts, e.Pointer)
					starts = slices.Delete(starts, k, k+1)
					liveBytes -= size
				case ActionAllocateFailure:
					failures++
					if e.Pointer != 0 {
						t.Fatalf("line %d: a failure has pointer %#x, want null", e.Line, uintptr(e.Pointer))
					}
				default:
					t.Fatalf("line %d: action %v", e.Line, e.Action)
				}
			}
			assert.Equal(t, facts.allocates, allocs, "allocates")
			assert.Equal(t, facts.frees, frees, "frees")
			assert.Equal(t, facts.failure, failures, "failures")
			assert.Equal(t, facts.neverFreed, len(live), "never freed")
			assert.Equal(t, facts.neverFreedMiB, fmt.Sprintf("%.1f", float64(liveBytes)/(1<<20)), "never-freed MiB")
			assert.Equal(t, facts.peakLive, peak, "peak live bytes")
			assert.Equal(t, facts.distinctSizes, len(sizes), "distinct sizes")
			assert.Equal(t, facts.streams, streams, "events per stream")
			assert.Equal(t, facts.threads, len(threads), "threads")

			// The writer reproduces the file byte for byte.
			z, err := os.ReadFile(path)
			require.NoError(t, err)
			zr, err := gzip.NewReader(bytes.NewReader(z))
			require.NoError(t, err)
			orig, err := io.ReadAll(zr)
			require.NoError(t, err)
			sum := sha256.Sum256(orig)
			require.Equal(t, facts.csvSHA256, hex.EncodeToString(sum[:]), "the committed trace is the published one")
			var out bytes.Buffer
			lw := NewLogWriter(&out)
			for _, e := range events {
				if err := lw.Write(e); err != nil {
					t.Fatalf("writing line %d: %v", e.Line, err)
				}
			}
			require.NoError(t, lw.Flush())
			require.True(t, bytes.Equal(orig, out.Bytes()), "rewritten log differs from the original")
		})
	}
}

// FuzzLogReader: the reader never panics; every event it accepts is valid, and writing the
// accepted events and reading them back gives the same events.
func FuzzLogReader(f *testing.F) {
	f.Add([]byte(writerText))
	f.Add([]byte(LogHeader + "\n5,01:02:03.4,allocate failure,0x0,100,0x0\n5,01:02:03,allocate,0,0,140212345678912\n"))
	f.Add([]byte("\ufeffStream,Size,Extra,Pointer,Action,Time,Thread\r\n0x10,256,\"x,\ny\",0x7f00,allocate,00:00:02.000003,42\r\n"))
	f.Add([]byte(LogHeader + "\n1,00:00:00.000000,allocate,0x100,-256,0\n1,24:00:00.000000,free,0x100,256,0\n1,00:00:00.000000,free,0x1\"00,256,0\n"))
	f.Add([]byte("Thread,Time,Action,Pointer,Size\n"))
	f.Add([]byte(""))
	f.Add(gzipBytes(f, []byte(writerText)))
	if z, err := os.ReadFile(filepath.Join("testdata", "traces", "bert_base_infer_dynamic_fp16.csv.gz")); err == nil {
		if zr, err := gzip.NewReader(bytes.NewReader(z)); err == nil {
			head := make([]byte, 4096)
			n, _ := io.ReadFull(zr, head)
			f.Add(head[:n])
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		lr, err := NewLogReader(bytes.NewReader(data))
		if err != nil {
			return
		}
		var accepted []LogEvent
		lastLine := 0
		for {
			e, err := lr.Read()
			if err == io.EOF {
				break
			}
			if err != nil {
				var pe *LogParseError
				if !errors.As(err, &pe) {
					break // I/O or gzip error: the log ends here
				}
				require.ErrorIs(t, err, ErrMalformedLog)
				require.Greater(t, pe.Line, lastLine, "error lines go forward")
				lastLine = pe.Line
				continue
			}
			require.Greater(t, e.Line, lastLine, "event lines go forward")
			lastLine = e.Line
			require.True(t, e.Action >= ActionAllocate && e.Action <= ActionAllocateFailure, "action %v", e.Action)
			require.GreaterOrEqual(t, e.Size, 0)
			require.True(t, e.Time >= 0 && e.Time < 24*time.Hour && e.Time%time.Microsecond == 0, "time %v", e.Time)
			accepted = append(accepted, e)
		}

		var out bytes.Buffer
		lw := NewLogWriter(&out)
		for _, e := range accepted {
			require.NoError(t, lw.Write(e))
		}
		require.NoError(t, lw.Flush())
		written := out.String()
		again, err := ReadLog(&out)
		require.NoError(t, err, "re-reading the rewritten log")
		require.Equal(t, len(accepted), len(again))
		for i := range accepted {
			want := accepted[i]
			want.Line = i + 2
			require.Equal(t, want, again[i])
		}
		// Writing again gives the same bytes.
		var out2 bytes.Buffer
		lw = NewLogWriter(&out2)
		for _, e := range again {
			require.NoError(t, lw.Write(e))
		}
		require.NoError(t, lw.Flush())
		require.Equal(t, written, out2.String())
	})
}

func BenchmarkReadLog(b *testing.B) {
	z, err := os.ReadFile(filepath.Join("testdata", "traces", "gpt2s_train_adamw_seq512_bf16.csv.gz"))
	require.NoError(b, err)
	b.SetBytes(int64(len(z)))
	b.ReportAllocs()
	var n int
	for b.Loop() {
		events, err := ReadLog(bytes.NewReader(z))
		if err != nil {
			b.Fatal(err)
		}
		n = len(events)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/event")
}

func BenchmarkLogWriter(b *testing.B) {
	lw := NewLogWriter(io.Discard)
	e := writerEvents[4]
	b.ReportAllocs()
	for b.Loop() {
		if err := lw.Write(e); err != nil {
			b.Fatal(err)
		}
	}
}
