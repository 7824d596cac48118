package main

import (
	"bytes"
	"fmt"
	"image/color"
	"io"
	"math"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/gormm/rmm"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/text"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

// maxPlotPoints is the most points a line of -plot has: about one per pixel across the plot
// (1100 in the PNG), where the bundled traces have 70 000 to 220 000 events per pass. It keeps
// an SVG under about 100 KB.
const maxPlotPoints = 1200

// series is a value per event (live or reserved bytes after it), kept at a bounded number of
// points: the events are cut into buckets of per consecutive events, and each bucket keeps the
// largest value of its events, so that no peak is lost to the decimation.
type series struct {
	per int     // events per bucket
	max []int64 // the largest value of each bucket
}

// newSeries returns a series for events events (all passes) of at most points buckets.
func newSeries(events, points int) *series {
	per := max(1, (events+points-1)/max(points, 1))
	return &series{per: per, max: make([]int64, 0, (events+per-1)/per)}
}

// add records v for event k. Events come in order (a skipped one is counted in the next
// bucket's value).
func (s *series) add(k int, v int64) {
	b := k / s.per
	for len(s.max) <= b {
		s.max = append(s.max, v)
	}
	s.max[b] = max(s.max[b], v)
}

// peak returns the largest value recorded.
func (s *series) peak() int64 {
	var m int64
	for _, v := range s.max {
		m = max(m, v)
	}
	return m
}

// xAxis places the events of all passes on the plot's x axis.
type xAxis struct {
	label  string
	at     func(k int) float64 // x of event k of all passes (event k%n of pass k/n)
	end    float64             // x of the end of the last pass
	ticker plot.Ticker
}

// traceSeconds returns each event's time in seconds after the first event, when the trace's
// times of day are usable: one wrap at midnight is undone and steps back of up to a second
// (threads that read the clock before they took the log's lock) are held at the time before;
// a larger step back, or a trace whose times are all the same, gives ok false.
func traceSeconds(events []rmm.LogEvent) (secs []float64, ok bool) {
	if len(events) == 0 {
		return nil, false
	}
	secs = make([]float64, len(events))
	var offset time.Duration
	t0, prev := events[0].Time, events[0].Time
	for i, e := range events {
		t := e.Time + offset
		if t < prev {
			switch {
			case prev-t > 12*time.Hour:
				offset += 24 * time.Hour
				t += 24 * time.Hour
			case prev-t <= time.Second:
				t = prev
			default:
				return nil, false
			}
		}
		secs[i], prev = (t - t0).Seconds(), t
	}
	return secs, secs[len(secs)-1] > 0
}

// newXAxis returns the x axis for passes passes of events: the trace's time where it is usable
// (seconds, minutes or hours), the event's index in the log otherwise. Later passes follow the
// first one back to back.
func newXAxis(events []rmm.LogEvent, passes int) xAxis {
	n := len(events)
	back := ""
	if passes > 1 {
		back = fmt.Sprintf(", %d passes back to back", passes)
	}
	if secs, ok := traceSeconds(events); ok {
		span := secs[n-1]
		unit, name := 1.0, "s"
		switch total := span * float64(passes); {
		case total >= 2*3600:
			unit, name = 3600, "h"
		case total >= 10*60:
			unit, name = 60, "min"
		}
		return xAxis{
			label:  "time in the trace (" + name + ")" + back,
			at:     func(k int) float64 { return (float64(k/n)*span + secs[k%n]) / unit },
			end:    float64(passes) * span / unit,
			ticker: plot.DefaultTicks{},
		}
	}
	return xAxis{
		label:  "event (the trace's times are not usable)" + back,
		at:     func(k int) float64 { return float64(k) },
		end:    float64(n*passes - 1),
		ticker: countTicks{},
	}
}

// countTicks labels plot.DefaultTicks' ticks as counts: 50k, 1.5M.
type countTicks struct{}

func (countTicks) Ticks(min, max float64) []plot.Tick {
	ticks := plot.DefaultTicks{}.Ticks(min, max)
	for i, t := range ticks {
		if t.Label == "" {
			continue
		}
		switch v := t.Value; {
		case math.Abs(v) >= 1e6:
			ticks[i].Label = strconv.FormatFloat(v/1e6, 'f', -1, 64) + "M"
		case math.Abs(v) >= 1e3:
			ticks[i].Label = strconv.FormatFloat(v/1e3, 'f', -1, 64) + "k"
		}
	}
	return ticks
}

// byteTicks places ticks on a byte axis at multiples of a power of two, about four to seven of
// them, with labels in binary units ("512 MiB", "1.5 GiB") and a minor tick between them.
type byteTicks struct{}

func (byteTicks) Ticks(min, max float64) []plot.Tick {
	if !(max > min) {
		return []plot.Tick{{Value: min, Label: binaryBytes(min)}}
	}
	step := byteStep(min, max)
	var ticks []plot.Tick
	for v := math.Ceil(min/step) * step; v <= max; v += step {
		ticks = append(ticks, plot.Tick{Value: v, Label: binaryBytes(v)})
		if m := v + step/2; step >= 2 && m <= max {
			ticks = append(ticks, plot.Tick{Value: m})
		}
	}
	return ticks
}

// byteStep is the distance between byteTicks' labelled ticks: the power of two (at least 1) that
// cuts max-min in six parts or fewer.
func byteStep(min, max float64) float64 {
	return math.Max(1, math.Exp2(math.Ceil(math.Log2((max-min)/6))))
}

// plotFormat returns the format -plot writes, from the file's extension: svg or png.
func plotFormat(path string) (string, error) {
	switch ext := strings.ToLower(filepath.Ext(path)); ext {
	case ".svg", ".png":
		return ext[1:], nil
	}
	return "", fmt.Errorf("-plot %s: want a file name ending in .svg or .png", path)
}

// footprintOf gathers what -plot draws of the runs.
func footprintOf(path string, s *setup, runs []*replayRun, rp *replayer, live *series) *footprint {
	f := &footprint{
		title: filepath.Base(path) + ": live and reserved bytes",
		x:     newXAxis(rp.events, rp.passes),
		live:  live,
	}
	switch {
	case s.simulate.set:
		f.subtitle = fmt.Sprintf("replayed over %s of simulated memory (addresses only)", binaryBytes(float64(s.simulate.n)))
	case s.cudaErr != nil:
		f.subtitle = "replayed over host memory (no CUDA device)"
	default:
		f.subtitle = "replayed on " + s.where
	}
	for _, r := range runs {
		f.names = append(f.names, r.legend)
		f.reserved = append(f.reserved, r.series)
	}
	return f
}

// The colours of the reserved lines, one per resource (Tableau's 10), and of the live area.
var (
	lineColors = []color.RGBA{
		{0x1f, 0x77, 0xb4, 0xff}, {0xd6, 0x27, 0x28, 0xff}, {0x2c, 0xa0, 0x2c, 0xff},
		{0xff, 0x7f, 0x0e, 0xff}, {0x94, 0x67, 0xbd, 0xff}, {0x8c, 0x56, 0x4b, 0xff},
		{0xe3, 0x77, 0xc2, 0xff},
	}
	liveFill = color.RGBA{0xd9, 0xd9, 0xd9, 0xff}
	liveEdge = color.RGBA{0x70, 0x70, 0x70, 0xff}
)

// footprint is what -plot draws.
type footprint struct {
	title    string
	subtitle string
	x        xAxis
	live     *series
	reserved []*series // one per resource, nil where the resource does not say
	names    []string  // the resources, as the legend names them
}

// points returns s's buckets as a step line's points: each bucket's value from its first event
// on, the last one held to the end of the axis.
func (f *footprint) points(s *series) plotter.XYs {
	xys := make(plotter.XYs, 0, len(s.max)+1)
	for b, v := range s.max {
		if b > 0 && v == s.max[b-1] {
			continue // the step before holds it (reserved bytes change seldom)
		}
		xys = append(xys, plotter.XY{X: f.x.at(b * s.per), Y: float64(v)})
	}
	if len(s.max) > 0 {
		xys = append(xys, plotter.XY{X: f.x.end, Y: float64(s.max[len(s.max)-1])})
	}
	return xys
}

// plot lays the footprint out: live bytes as a grey area, each resource's reserved bytes as a
// coloured step line over it, the legend (with each line's peak) at the top left, in the
// headroom left above the highest line.
func (f *footprint) plot() (*plot.Plot, error) {
	p := plot.New()
	sans := func(st *text.Style, size float64) {
		st.Font.Variant = "Sans"
		st.Font.Size = vg.Points(size)
	}
	p.Title.Text = f.title
	if f.subtitle != "" {
		p.Title.Text += "\n" + f.subtitle
	}
	sans(&p.Title.TextStyle, 12)
	p.Title.Padding = vg.Points(8)
	p.X.Label.Text = f.x.label
	p.X.Tick.Marker = f.x.ticker
	p.Y.Label.Text = "memory"
	p.Y.Tick.Marker = byteTicks{}
	p.X.Min, p.X.Max = 0, f.x.end
	for _, a := range []*plot.Axis{&p.X, &p.Y} {
		sans(&a.Label.TextStyle, 10)
		sans(&a.Tick.Label, 9)
	}
	sans(&p.Legend.TextStyle, 9)
	grid := plotter.NewGrid()
	grid.Vertical.Color = color.Gray{0xe8}
	grid.Horizontal.Color = color.Gray{0xe8}
	grid.Horizontal.Width = vg.Points(0.6)
	grid.Vertical.Width = vg.Points(0.6)
	p.Add(grid)

	peakLive := f.live.peak()
	top := peakLive
	// The live bytes: an area under the reserved lines, and its edge over them, so that a peak
	// of live bytes where a reserved line rises (the growth it caused) still shows.
	livePts := f.points(f.live)
	area, err := plotter.NewLine(livePts)
	if err != nil {
		return nil, err
	}
	area.StepStyle = plotter.PostStep
	area.FillColor = liveFill
	area.Width = 0
	edge, err := plotter.NewLine(livePts)
	if err != nil {
		return nil, err
	}
	edge.StepStyle = plotter.PostStep
	edge.Color = liveEdge
	edge.Width = vg.Points(0.75)
	p.Add(area)
	p.Legend.Add(fmt.Sprintf("live (allocated by the trace), peak %s", shortBytes(peakLive)), area, edge)
	for i, s := range f.reserved {
		if s == nil {
			continue
		}
		l, err := plotter.NewLine(f.points(s))
		if err != nil {
			return nil, err
		}
		l.StepStyle = plotter.PostStep
		l.Color = lineColors[i%len(lineColors)]
		l.Width = vg.Points(1.6)
		p.Add(l)
		pk := s.peak()
		top = max(top, pk)
		p.Legend.Add(fmt.Sprintf("reserved by %s, peak %s (%.2f x live)", f.names[i], shortBytes(pk), float64(pk)/float64(max(peakLive, 1))), l)
	}
	p.Add(edge)
	// Room above the lines for the legend: a line of text is about 1/18 of the plot's height.
	// The axis ends at a labelled tick.
	p.Y.Min = 0
	p.Y.Max = float64(max(top, 1)) * (1.12 + 0.065*float64(len(f.names)+1))
	step := byteStep(0, p.Y.Max)
	p.Y.Max = math.Ceil(p.Y.Max/step) * step
	p.Legend.Top, p.Legend.Left = true, true
	p.Legend.XOffs, p.Legend.YOffs = vg.Points(8), vg.Points(-6)
	p.Legend.ThumbnailWidth = vg.Points(22)
	p.Legend.Padding = vg.Points(2)
	return p, nil
}

// Plot size: 8 x 4.5 inches, drawn at 150 dots per inch in a PNG.
const (
	plotWidth  = 8 * vg.Inch
	plotHeight = 4.5 * vg.Inch
	plotDPI    = 150
)

// write draws the footprint to w as format (svg or png).
func (f *footprint) write(w io.Writer, format string) error {
	p, err := f.plot()
	if err != nil {
		return err
	}
	var c vg.CanvasWriterTo
	switch format {
	case "svg":
		c = vgsvg.New(plotWidth, plotHeight)
	case "png":
		c = vgimg.PngCanvas{Canvas: vgimg.NewWith(vgimg.UseWH(plotWidth, plotHeight), vgimg.UseDPI(plotDPI))}
	default:
		return fmt.Errorf("cannot draw %s", format)
	}
	// A margin on the right and at the top, where the plot would otherwise touch the edge.
	p.Draw(draw.Crop(draw.New(c), vg.Points(4), -vg.Points(14), vg.Points(2), -vg.Points(6)))
	if format != "svg" {
		_, err = c.WriteTo(w)
		return err
	}
	// The SVG names the font it was laid out with (Liberation Sans, metrically the same as Arial):
	// let viewers without it take Arial or another sans-serif font rather than their default.
	var b bytes.Buffer
	if _, err := c.WriteTo(&b); err != nil {
		return err
	}
	_, err = w.Write(bytes.ReplaceAll(b.Bytes(), []byte("font-family:Liberation Sans;"), []byte("font-family:'Liberation Sans',Arial,Helvetica,sans-serif;")))
	return err
}
