package main

import (
	"fmt"
	"io"
	"strings"

	"github.com/gormm/rmm"
)

// vmmJSON is what an expandable pool asked of the driver (rmm.VMMStats) over a span of the replay,
// in -json: the calls made in it, and two levels as they stand at its end, the address space
// reserved and the stitched ranges kept mapped. Its fields are rmm.VMMStats's, so that one
// converts to the other.
type vmmJSON struct {
	Creates         int `json:"creates"`
	Maps            int `json:"maps"`
	SetAccess       int `json:"set_access"`
	Unmaps          int `json:"unmaps"`
	Releases        int `json:"releases"`
	Reserves        int `json:"reserves"`
	AddressFrees    int `json:"address_frees"`
	AddressReserved int `json:"address_reserved_bytes"`
	StitchedRanges  int `json:"stitched_ranges"`
	StitchedKept    int `json:"stitched_kept"`
	StitchedEvicted int `json:"stitched_evicted"`
}

// countsVMM reports whether the report gives the driver calls of the resource: an expandable
// pool's (librmm's pool makes none).
func (t *target) countsVMM() bool { return t.pool != nil && t.pool.Kind() != rmm.PlainPool }

// vmmSince returns the calls made between two of a pool's VMMStats, with the levels (the address
// space reserved, the stitched ranges kept) of the later one.
func vmmSince(before, after rmm.VMMStats) rmm.VMMStats {
	return rmm.VMMStats{
		Creates:         after.Creates - before.Creates,
		Maps:            after.Maps - before.Maps,
		SetAccess:       after.SetAccess - before.SetAccess,
		Unmaps:          after.Unmaps - before.Unmaps,
		Releases:        after.Releases - before.Releases,
		Reserves:        after.Reserves - before.Reserves,
		AddressFrees:    after.AddressFrees - before.AddressFrees,
		AddressReserved: after.AddressReserved,
		StitchedRanges:  after.StitchedRanges - before.StitchedRanges,
		StitchedKept:    after.StitchedKept,
		StitchedEvicted: after.StitchedEvicted - before.StitchedEvicted,
	}
}

// vmmText describes the calls of a span in the text report; stitching: the pool stitches, so
// that its stitched ranges are worth a clause.
func vmmText(v rmm.VMMStats, stitching bool) string {
	s := fmt.Sprintf("%d creates, %d maps, %d set-access, %d unmaps, %d releases", v.Creates, v.Maps, v.SetAccess, v.Unmaps, v.Releases)
	if stitching {
		s += fmt.Sprintf("; %d stitched (kept %d, evicted %d)", v.StitchedRanges, v.StitchedKept, v.StitchedEvicted)
	}
	return s + "; " + shortBytes(int64(v.AddressReserved)) + " address space"
}

// vmmLines returns the text report's lines of a pool's driver calls: one per pass, led by the
// pass's number where there are several; none for a resource without them.
func (r *replayRun) vmmLines() []string {
	var lines []string
	digits := len(fmt.Sprint(len(r.vmmPasses)))
	for i, v := range r.vmmPasses {
		l := vmmText(v, r.kind == rmm.StitchingPool)
		if len(r.vmmPasses) > 1 {
			l = fmt.Sprintf("pass %*d: %s", digits, i+1, l)
		}
		lines = append(lines, l)
	}
	return lines
}

// writeVMM writes the driver calls of the runs that have them under the label "driver calls",
// each line indented by indent (the label's width); with names, each run's lines follow its name.
func writeVMM(w io.Writer, runs []*replayRun, names bool) {
	const label = "driver calls     "
	width := 0
	for _, r := range runs {
		if len(r.vmmPasses) > 0 {
			width = max(width, len(r.name))
		}
	}
	first := true
	for _, r := range runs {
		for i, l := range r.vmmLines() {
			lead := strings.Repeat(" ", len(label))
			if first {
				lead, first = label, false
			}
			if names {
				name := ""
				if i == 0 {
					name = r.name
				}
				lead += fmt.Sprintf("%-*s  ", width, name)
			}
			fmt.Fprintf(w, "%s%s\n", lead, l)
		}
	}
}
