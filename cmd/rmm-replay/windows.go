package main

import (
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/gormm/rmm"
)

// windowSampler measures -window's figures along the passes on one resource, from
// rmm.ReplayOptions.AfterEvent, which runs once per event, in the log's order and never
// concurrently: it needs no lock. AfterEvent runs inside the timed part of the replay, so between
// boundaries it does O(1) work per event (the live bytes and, where they are an atomic load away,
// the reserved bytes against the window's peaks); the clock, the reserved bytes of a resource
// that asks the driver for them, and a pool's Stats (O(streams log n)) are read at boundaries only.
type windowSampler struct {
	size     int // events per window (-window)
	events   int // events in one pass
	total    int // events over all passes
	t        *target
	peakEach bool         // read the reserved bytes after every event (cheap to read)
	countVMM bool         // an expandable pool: the driver calls made in each window
	vmm      rmm.VMMStats // the pool's VMMStats at the last boundary
	windows  []window
	cur      window
	// The clock was read at mark, after the event of index markAt (over all passes) in the
	// current pass; the events after it up to the next reading are the ones that time covers.
	mark   time.Time
	markAt int
}

// window is what -window reports of one window of events.
type window struct {
	first, events          int // the index of its first event over all passes in sequence, and its events
	firstPass, lastPass    int // from 0
	timed                  time.Duration
	timedEvents            int   // the events timed covers (not the first event of a pass)
	live, peakLive         int64 // the log's live bytes at the end, and the most over the window
	reserved, peakReserved int64 // the resource's reserved bytes at the end, and the most
	vmm                    *rmm.VMMStats
}

// newWindowSampler returns the sampler of windows of size events over passes passes of events
// events on t, whose pool (if any) has made the calls in vmm so far.
func newWindowSampler(size, events, passes int, t *target, vmm rmm.VMMStats) *windowSampler {
	return &windowSampler{size: size, events: events, total: events * passes, t: t,
		// The async pool's reserved bytes are a driver query; it never gives memory back during
		// the replay (its release threshold is unlimited), so its reserved bytes at a window's
		// end are its peak over the window.
		peakEach: t.async == nil,
		countVMM: t.countsVMM(), vmm: vmm}
}

// after is AfterEvent's work for event i of pass pass.
func (w *windowSampler) after(pass, i int, live int64) {
	k := pass*w.events + i
	c := &w.cur
	if c.events == 0 {
		c.first, c.firstPass = k, pass
	}
	c.events++
	c.peakLive = max(c.peakLive, live)
	if w.peakEach {
		c.peakReserved = max(c.peakReserved, w.t.reservedNow())
	}
	end := (k+1)%w.size == 0 || k+1 == w.total
	// The first event of a pass started inside rmm.Replay, at no time read here: the pass's
	// clock starts after it. Its last event stops it, as a window's last does.
	if i > 0 && (end || i == w.events-1) {
		c.timed += time.Since(w.mark)
		c.timedEvents += k - w.markAt
	}
	if end {
		w.close(pass, live)
	}
	if i == 0 || end {
		// Read after the boundary's work, so that the next window's time leaves it out.
		w.mark, w.markAt = time.Now(), k
	}
}

// close ends the current window after an event of pass pass, with live bytes live.
func (w *windowSampler) close(pass int, live int64) {
	c := w.cur
	c.lastPass, c.live = pass, live
	c.reserved = w.t.reservedNow()
	c.peakReserved = max(c.peakReserved, c.reserved)
	if w.countVMM {
		now := w.t.pool.Stats().VMM
		d := vmmSince(w.vmm, now)
		c.vmm, w.vmm = &d, now
	}
	w.windows = append(w.windows, c)
	w.cur = window{}
}

// nsPerEvent returns the window's wall time per timed event (0 when none was timed).
func (x *window) nsPerEvent() float64 {
	if x.timedEvents == 0 {
		return 0
	}
	return float64(x.timed.Nanoseconds()) / float64(x.timedEvents)
}

// reservedOverLive returns the window's peak reserved bytes over its peak live bytes (0 when
// either is unknown or zero).
func (x *window) reservedOverLive() float64 {
	if x.peakReserved <= 0 || x.peakLive <= 0 {
		return 0
	}
	return float64(x.peakReserved) / float64(x.peakLive)
}

// windowJSON is one window of -window in -json, in the order of the windows. Its events are
// [first_event, first_event+events) of the passes' events in sequence (pass p's event i is
// (p-1)*events+i), from pass first_pass to last_pass (from 1). ns_per_event is its wall time over
// timed_events: all its events but the first event of a pass, which starts before the replay's
// clock can be read (0 when none is timed). Bytes are at the window's end and at most over it;
// reserved_over_live is the peak reserved over the peak live bytes. vmm: an expandable pool's
// driver calls made in the window, with the address space and stitched ranges kept at its end.
type windowJSON struct {
	FirstEvent        int      `json:"first_event"`
	Events            int      `json:"events"`
	FirstPass         int      `json:"first_pass"`
	LastPass          int      `json:"last_pass"`
	TimedEvents       int      `json:"timed_events"`
	NsPerEvent        float64  `json:"ns_per_event"`
	LiveBytes         int64    `json:"live_bytes"`
	PeakLiveBytes     int64    `json:"peak_live_bytes"`
	ReservedBytes     int64    `json:"reserved_bytes"`
	PeakReservedBytes int64    `json:"peak_reserved_bytes"`
	ReservedOverLive  float64  `json:"reserved_over_live,omitempty"`
	VMM               *vmmJSON `json:"vmm,omitempty"`
}

func (x *window) json() windowJSON {
	j := windowJSON{FirstEvent: x.first, Events: x.events, FirstPass: x.firstPass + 1, LastPass: x.lastPass + 1,
		TimedEvents: x.timedEvents, NsPerEvent: x.nsPerEvent(), LiveBytes: x.live, PeakLiveBytes: x.peakLive,
		ReservedBytes: x.reserved, PeakReservedBytes: x.peakReserved, ReservedOverLive: x.reservedOverLive()}
	if x.vmm != nil {
		v := vmmJSON(*x.vmm)
		j.VMM = &v
	}
	return j
}

// writeWindows writes the table of -window for one run: a row per window.
func writeWindows(w io.Writer, r *replayRun, size int, several bool) {
	on := ""
	if several {
		on = " on " + r.name
	}
	vmm := len(r.vmmPasses) > 0
	stitching := vmm && r.kind == rmm.StitchingPool
	fmt.Fprintf(w, "windows of %d events%s: live and reserved bytes at each window's end and their peaks over it,\n", size, on)
	fmt.Fprint(w, "reserved/live of the peaks, ns/event without the first event of each pass")
	if vmm {
		fmt.Fprint(w, "; the pool's driver\ncalls made in the window, and the stitched ranges kept and address space reserved at its end")
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "window\tpass\tevents\tns/event\tlive\tpeak live\treserved\tpeak reserved\treserved/live\t")
	if vmm {
		fmt.Fprintf(tw, "creates\tmaps\tunmaps\treleases\t")
		if stitching {
			fmt.Fprintf(tw, "stitched\tevicted\tkept\t")
		}
		fmt.Fprintf(tw, "address space\t")
	}
	fmt.Fprintln(tw)
	dash := func(s string, ok bool) string {
		if !ok {
			return "-"
		}
		return s
	}
	for i := range r.windows {
		x := &r.windows[i]
		pass := fmt.Sprint(x.firstPass + 1)
		if x.lastPass != x.firstPass {
			pass = fmt.Sprintf("%d-%d", x.firstPass+1, x.lastPass+1)
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t", i+1, pass, x.events,
			dash(fmt.Sprintf("%.0f", x.nsPerEvent()), x.timedEvents > 0),
			shortBytes(x.live), shortBytes(x.peakLive), dash(shortBytes(x.reserved), x.peakReserved > 0),
			dash(shortBytes(x.peakReserved), x.peakReserved > 0), dash(fmt.Sprintf("%.3f", x.reservedOverLive()), x.reservedOverLive() > 0))
		if v := x.vmm; v != nil {
			fmt.Fprintf(tw, "%d\t%d\t%d\t%d\t", v.Creates, v.Maps, v.Unmaps, v.Releases)
			if stitching {
				fmt.Fprintf(tw, "%d\t%d\t%d\t", v.StitchedRanges, v.StitchedEvicted, v.StitchedKept)
			}
			fmt.Fprintf(tw, "%s\t", shortBytes(int64(v.AddressReserved)))
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
}
