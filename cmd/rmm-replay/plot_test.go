package main

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"image"
	"image/color"
	_ "image/png"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gormm/rmm"
	"github.com/stretchr/testify/require"
)

// Each bucket of a decimated series holds the largest value of its events, so the series keeps
// the true maximum wherever it falls, and it never has more buckets than asked.
func TestSeriesKeepsMaxPerBucket(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	for _, tc := range []struct{ events, points int }{
		{1, 1}, {10, 3}, {1000, 1000}, {1000, 7}, {110156, 1200}, {220312, 1200}, {5, 1200},
	} {
		vals := make([]int64, tc.events)
		for i := range vals {
			vals[i] = rng.Int64N(1 << 40)
		}
		// One sharp peak at a random event, as a trace's highest allocation.
		at := rng.IntN(tc.events)
		vals[at] = 1 << 50
		s := newSeries(tc.events, tc.points)
		for k, v := range vals {
			s.add(k, v)
		}
		require.LessOrEqual(t, len(s.max), tc.points, "%+v", tc)
		require.Equal(t, int64(1<<50), s.peak(), "%+v: the peak at event %d survives", tc, at)
		require.Equal(t, int64(1<<50), s.max[at/s.per], "%+v: in its own bucket", tc)
		for b := range s.max {
			want := int64(0)
			for k := b * s.per; k < min((b+1)*s.per, tc.events); k++ {
				want = max(want, vals[k])
			}
			require.Equal(t, want, s.max[b], "%+v: bucket %d", tc, b)
		}
	}
	// A hand-made case: buckets of 3 events.
	s := newSeries(8, 3)
	for k, v := range []int64{5, 9, 1, 2, 2, 7, 0, 4} {
		s.add(k, v)
	}
	require.Equal(t, 3, s.per)
	require.Equal(t, []int64{9, 7, 4}, s.max)
}

// The byte axis ticks at powers of two with binary-unit labels.
func TestByteTicks(t *testing.T) {
	labels := func(min, max float64) (major []string, minor int) {
		for _, tk := range (byteTicks{}).Ticks(min, max) {
			if tk.Label == "" {
				minor++
			} else {
				major = append(major, tk.Label)
			}
		}
		return major, minor
	}
	const gib = 1 << 30
	major, minor := labels(0, 2.3*gib)
	require.Equal(t, []string{"0", "512 MiB", "1 GiB", "1.5 GiB", "2 GiB"}, major)
	require.Equal(t, 5, minor, "256 MiB, 768 MiB, ... 2.25 GiB")
	major, _ = labels(0, 1.9*gib)
	require.Equal(t, []string{"0", "512 MiB", "1 GiB", "1.5 GiB"}, major)
	major, _ = labels(0, 1.2*gib)
	require.Equal(t, []string{"0", "256 MiB", "512 MiB", "768 MiB", "1 GiB"}, major)
	major, _ = labels(0, 21*gib)
	require.Equal(t, []string{"0", "4 GiB", "8 GiB", "12 GiB", "16 GiB", "20 GiB"}, major)
	major, _ = labels(0, 3000)
	require.Equal(t, []string{"0", "512 B", "1 KiB", "1.5 KiB", "2 KiB", "2.5 KiB"}, major)
	major, _ = labels(0, 0)
	require.Equal(t, []string{"0"}, major)

}

func TestCountTicks(t *testing.T) {
	var got []string
	for _, tk := range (countTicks{}).Ticks(0, 220000) {
		if tk.Label != "" {
			got = append(got, tk.Label)
		}
	}
	require.Equal(t, []string{"0", "100k", "200k"}, got)
}

func logAt(times ...string) []rmm.LogEvent {
	var b strings.Builder
	b.WriteString(rmm.LogHeader + "\n")
	for i, tm := range times {
		b.WriteString("0," + tm + ",allocate,0x" + string(rune('1'+i)) + "000,256,0\n")
	}
	events, err := rmm.ReadLog(strings.NewReader(b.String()))
	if err != nil {
		panic(err)
	}
	return events
}

// The trace's times give the x axis where they can: a wrap at midnight is undone, a small step
// back is held, a large one (or no time passing) falls back to the event index.
func TestTraceSeconds(t *testing.T) {
	secs, ok := traceSeconds(logAt("00:00:00.000000", "00:00:01.500000", "00:00:01.200000", "00:00:03.000000"))
	require.True(t, ok)
	require.Equal(t, []float64{0, 1.5, 1.5, 3}, secs)
	secs, ok = traceSeconds(logAt("23:59:59.000000", "00:00:01.000000"))
	require.True(t, ok)
	require.Equal(t, []float64{0, 2}, secs)
	_, ok = traceSeconds(logAt("10:00:00.000000", "09:00:00.000000"))
	require.False(t, ok, "an hour back")
	_, ok = traceSeconds(logAt("10:00:00.000000", "10:00:00.000000"))
	require.False(t, ok, "no time passes")

	x := newXAxis(logAt("00:00:00.000000", "00:00:01.000000", "00:00:04.000000"), 2)
	require.Equal(t, "time in the trace (s), 2 passes back to back", x.label)
	require.Equal(t, []float64{0, 1, 4, 4, 5, 8}, []float64{x.at(0), x.at(1), x.at(2), x.at(3), x.at(4), x.at(5)})
	require.Equal(t, 8.0, x.end)
	x = newXAxis(logAt("10:00:00.000000", "10:00:00.000000", "10:00:00.000000"), 1)
	require.Equal(t, "event (the trace's times are not usable)", x.label)
	require.Equal(t, 2.0, x.at(2))
	require.Equal(t, "time in the trace (min)", newXAxis(logAt("00:00:00.000000", "00:12:00.000000"), 1).label)
}

// The series -plot draws are the figures the report gives: the live series peaks at the trace's
// peak live bytes, the reserved one at the resource's peak reserved bytes.
func TestReplaySamplesMatchReport(t *testing.T) {
	events, err := rmm.ReadLogFile(cupy)
	require.NoError(t, err)
	s := &setup{cudaErr: rmm.ErrNoDevice, simulate: sizeFlag{n: 16 << 30, set: true}}
	rp := &replayer{events: events, passes: 2, stderr: io.Discard}
	for _, name := range []string{mrPlain, mrSystem} { // the expandable pool's: TestReplayPlotSVG
		if name == mrSystem {
			s.simulate = sizeFlag{}
		}
		tg, err := s.build(name)
		require.NoError(t, err)
		live, reserved := newSeries(2*len(events), maxPlotPoints), newSeries(2*len(events), maxPlotPoints)
		r, err := rp.replay(tg, "", live, reserved)
		require.NoError(t, err)
		require.Zero(t, r.failures)
		require.LessOrEqual(t, len(live.max), maxPlotPoints)
		require.Greater(t, len(live.max), maxPlotPoints*9/10)
		require.Equal(t, r.results[0].PeakLiveBytes, live.peak(), name)
		require.Equal(t, r.reserved, reserved.peak(), name)
		require.Same(t, reserved, r.series)
		if name == mrSystem {
			require.Equal(t, live.max, reserved.max, "system holds exactly what is live")
		}
	}
}

// svgTexts parses an SVG as XML and returns its root element's name and the text of its
// <text> elements.
func svgTexts(t *testing.T, data []byte) (root string, texts []string) {
	t.Helper()
	d := xml.NewDecoder(bytes.NewReader(data))
	inText := false
	for {
		tok, err := d.Token()
		if err == io.EOF {
			break
		}
		require.NoError(t, err, "the SVG is well-formed XML")
		switch tk := tok.(type) {
		case xml.StartElement:
			if root == "" {
				root = tk.Name.Local
			}
			inText = tk.Name.Local == "text"
		case xml.CharData:
			if inText {
				texts = append(texts, strings.TrimSpace(string(tk)))
			}
		case xml.EndElement:
			inText = false
		}
	}
	return root, texts
}

func TestReplayPlotSVG(t *testing.T) {
	out := filepath.Join(t.TempDir(), "footprint.svg")
	var stdout, stderr bytes.Buffer
	err := run([]string{"-json", "-simulate", "16GiB", "-mr", "plain,expandable", "-plot", out, cupy}, &stdout, &stderr)
	require.NoError(t, err, stderr.String())
	// Standard output has the JSON only.
	var list []replayJSON
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &list), stdout.String())
	require.Len(t, list, 2)
	data, err := os.ReadFile(out)
	require.NoError(t, err)
	require.Less(t, len(data), 150_000, "small enough to keep in a repository")
	root, texts := svgTexts(t, data)
	require.Equal(t, "svg", root)
	for _, want := range []string{
		"cupy_fft_linalg_2threads.csv.gz: live and reserved bytes",
		"replayed over 16 GiB of simulated memory (addresses only)",
		"live (allocated by the trace), peak 589.5 MiB",
		"reserved by plain (librmm's pool), peak 1.471 GiB (2.56 x live)",
		"reserved by expandable pool, peak 736.0 MiB (1.25 x live)",
		"time in the trace (s)", "memory", "512 MiB", "1 GiB", "1.5 GiB",
	} {
		require.Contains(t, texts, want)
	}
	require.Contains(t, string(data), "font-family:'Liberation Sans',Arial,Helvetica,sans-serif;")
}

func TestReplayPlotPNG(t *testing.T) {
	out := filepath.Join(t.TempDir(), "footprint.PNG")
	var stdout, stderr bytes.Buffer
	require.NoError(t, run([]string{"-simulate", "16GiB", "-plot", out, cupy}, &stdout, &stderr), stderr.String())
	f, err := os.Open(out)
	require.NoError(t, err)
	defer f.Close()
	img, format, err := image.Decode(f)
	require.NoError(t, err)
	require.Equal(t, "png", format)
	require.Equal(t, image.Rect(0, 0, 1200, 675), img.Bounds(), "8 x 4.5 inches at 150 dpi")
	// The encoder writes an opaque picture as 8-bit RGB, which decodes to *image.RGBA.
	rgba, ok := img.(*image.RGBA)
	require.True(t, ok, "%T", img)
	colors := map[color.RGBA]int{}
	b := img.Bounds()
	for i := 0; i+3 < len(rgba.Pix); i += 4 {
		colors[color.RGBA{rgba.Pix[i], rgba.Pix[i+1], rgba.Pix[i+2], rgba.Pix[i+3]}]++
	}
	require.Greater(t, len(colors), 20, "not a blank picture")
	require.Greater(t, colors[color.RGBA{0xff, 0xff, 0xff, 0xff}], b.Dx()*b.Dy()/2, "a white background")
	require.Greater(t, colors[lineColors[0]], 500, "the reserved line in the first resource's colour")
	require.Greater(t, colors[liveFill], 5000, "the live area")
}

// A bad -plot name is a usage error found before the trace is read: nothing is replayed and no
// file is made.
func TestReplayPlotBadName(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"x.gif", "x.pdf", "x", "x.svg.txt"} {
		var stdout, stderr bytes.Buffer
		path := filepath.Join(dir, name)
		err := run([]string{"-plot", path, "no-such-trace.csv"}, &stdout, &stderr)
		require.ErrorIs(t, err, errUsage, name)
		require.Equal(t, 2, exitStatus(err))
		require.Equal(t, "usage: -plot "+path+": want a file name ending in .svg or .png", err.Error())
		require.Empty(t, stdout.String(), "nothing replayed")
		require.NoFileExists(t, path)
	}
	// A file that cannot be made fails before the replay too.
	var stdout, stderr bytes.Buffer
	path := filepath.Join(dir, "no-such-dir", "x.svg")
	err := run([]string{"-simulate", "16GiB", "-plot", path, cupy}, &stdout, &stderr)
	require.ErrorContains(t, err, "-plot: open "+path+": no such file or directory")
	require.Equal(t, 1, exitStatus(err))
	require.Empty(t, stdout.String(), "nothing replayed")
}
