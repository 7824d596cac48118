package rmm

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	"github.com/google/pprof/profile"
)

// MemorySite is the device memory allocated from one call site, as estimated from a memory
// profile: the line of the program that made the allocations (the innermost frame outside this
// package, so that the site of a [Uvector] is the line that called [NewUvector]), with the sums over
// the profile's samples whose stacks pass through it first there.
type MemorySite struct {
	Function string // package-qualified, as runtime.Frame.Function (e.g. "main.loadBatch")
	File     string
	Line     int

	InUseObjects int64 // allocations not yet freed
	InUseBytes   int64
	AllocObjects int64 // allocations made, freed or not
	AllocBytes   int64
}

// String names the site as [Profiler] names a block: "<file>:<line>(<function>)".
func (s MemorySite) String() string {
	return fmt.Sprintf("%s:%d(%s)", s.File, s.Line, s.Function)
}

// Format prints the site's name (String) for %v and %s; %+v adds its figures ("<site>: in use
// 2 allocations, 4096 bytes; allocated 5, 10240 bytes"), %#v the Go syntax of the struct.
func (s MemorySite) Format(f fmt.State, verb rune) {
	switch {
	case verb == 'v' && f.Flag('#'):
		type plain MemorySite // without Format
		g := fmt.Sprintf("%#v", plain(s))
		fmt.Fprint(f, "rmm.MemorySite"+g[strings.IndexByte(g, '{'):])
	case verb == 'v' && f.Flag('+'):
		fmt.Fprintf(f, "%s: in use %d allocations, %d bytes; allocated %d, %d bytes", s, s.InUseObjects, s.InUseBytes, s.AllocObjects, s.AllocBytes)
	case verb == 'v' || verb == 's':
		fmt.Fprint(f, s.String())
	default:
		fmt.Fprintf(f, "%%!%c(rmm.MemorySite=%s)", verb, s.String())
	}
}

// memorySiteOrders are the orders of MemorySites, by sample type.
var memorySiteOrders = map[string]func(MemorySite) int64{
	"inuse_space":   func(s MemorySite) int64 { return s.InUseBytes },
	"inuse_objects": func(s MemorySite) int64 { return s.InUseObjects },
	"alloc_space":   func(s MemorySite) int64 { return s.AllocBytes },
	"alloc_objects": func(s MemorySite) int64 { return s.AllocObjects },
}

// MemorySites sums a memory profile (MemoryProfileResourceAdaptor.Profile, or one read back with
// profile.Parse; Go's own heap profiles work too) by call site and returns the sites in
// descending order of orderedBy: "inuse_space" (also for ""), "inuse_objects", "alloc_space" or
// "alloc_objects"; sites that tie are ordered by function, file and line. Another orderedBy, or a
// profile without those four sample types, returns an error wrapping [ErrInvalidArgument].
func MemorySites(p *profile.Profile, orderedBy string) ([]MemorySite, error) {
	if orderedBy == "" {
		orderedBy = "inuse_space"
	}
	key, ok := memorySiteOrders[orderedBy]
	if !ok {
		return nil, errorf("MemorySites: cannot order by %q (inuse_space, inuse_objects, alloc_space or alloc_objects): %w", orderedBy, ErrInvalidArgument)
	}
	var idx [4]int
	for i, name := range []string{"inuse_objects", "inuse_space", "alloc_objects", "alloc_space"} {
		idx[i] = slices.IndexFunc(p.SampleType, func(t *profile.ValueType) bool { return t.Type == name })
		if idx[i] < 0 {
			return nil, errorf("MemorySites: the profile has no sample type %s: %w", name, ErrInvalidArgument)
		}
	}
	type siteKey struct {
		function, file string
		line           int64
	}
	sites := map[siteKey]*MemorySite{}
	for _, s := range p.Sample {
		k, ok := memorySiteOf(s)
		if !ok {
			continue
		}
		site, ok := sites[siteKey{k.Function.Name, k.Function.Filename, k.Line}]
		if !ok {
			site = &MemorySite{Function: k.Function.Name, File: k.Function.Filename, Line: int(k.Line)}
			sites[siteKey{k.Function.Name, k.Function.Filename, k.Line}] = site
		}
		site.InUseObjects += s.Value[idx[0]]
		site.InUseBytes += s.Value[idx[1]]
		site.AllocObjects += s.Value[idx[2]]
		site.AllocBytes += s.Value[idx[3]]
	}
	out := make([]MemorySite, 0, len(sites))
	for _, s := range sites {
		out = append(out, *s)
	}
	slices.SortFunc(out, func(a, b MemorySite) int {
		return cmp.Or(cmp.Compare(key(b), key(a)), strings.Compare(a.Function, b.Function), strings.Compare(a.File, b.File), cmp.Compare(a.Line, b.Line))
	})
	return out, nil
}

// memorySiteOf returns the line of sample s's site: the innermost outside this package, or the
// outermost when all are inside it.
func memorySiteOf(s *profile.Sample) (profile.Line, bool) {
	var last profile.Line
	found := false
	for _, l := range s.Location {
		for _, line := range l.Line {
			if line.Function == nil {
				continue
			}
			last, found = line, true
			if !isPackageFrame(line.Function.Name) {
				return line, true
			}
		}
	}
	return last, found
}

// TopSites returns the n call sites (all of them when n <= 0) with the most device memory by
// orderedBy, from the profile now ([MemorySites](Profile(), orderedBy)). The figures are
// estimates at the profile's sampling rate; at rate 1 they are exact.
func (r *MemoryProfile) TopSites(n int, orderedBy string) ([]MemorySite, error) {
	sites, err := MemorySites(r.Profile(), orderedBy)
	if err != nil {
		return nil, err
	}
	if n > 0 && len(sites) > n {
		sites = sites[:n]
	}
	return sites, nil
}

// Report formats TopSites(n, orderedBy) as a table, in the manner of [Profiler.Report]: a header,
// the sampling rate, the order, then a line of column names and one row per site — its
// inuse_objects, inuse_space, alloc_objects and alloc_space right-aligned under their names, with
// thousands separators, then two spaces and the site ("<file>:<line>(<function>)") — without a
// final newline. With no samples the table is "No samples". orderedBy is as for [MemorySites].
func (r *MemoryProfile) Report(n int, orderedBy string) (string, error) {
	if orderedBy == "" {
		orderedBy = "inuse_space"
	}
	sites, err := r.TopSites(n, orderedBy)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	b.WriteString("Device Memory by Call Site\n==========================\n\n")
	if r.rate == 1 {
		b.WriteString("Sampling: every allocation\n")
	} else {
		fmt.Fprintf(&b, "Sampling: one allocation per %s bytes on average (figures are estimates)\n", groupThousands(int64(r.rate)))
	}
	b.WriteString("Ordered by: " + orderedBy + "\n\n")
	if len(sites) == 0 {
		b.WriteString("No samples")
		return b.String(), nil
	}
	b.WriteString("inuse_objects     inuse_space  alloc_objects     alloc_space  filename:lineno(function)")
	for _, s := range sites {
		fmt.Fprintf(&b, "\n%13s %15s %14s %15s  %s", groupThousands(s.InUseObjects), groupThousands(s.InUseBytes), groupThousands(s.AllocObjects), groupThousands(s.AllocBytes), s)
	}
	return b.String(), nil
}
