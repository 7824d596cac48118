// Command pagemodel is a model, not part of the package: it replays a trace on the expandable pool
// over an address-only device, keeps the pool's placement, and puts under it physical memory in
// pages of -page bytes that can be unmapped and mapped again anywhere in the pool's range
// (stitching at page granularity). A page is mapped when a live allocation first touches it; a
// page that needs mapping takes a spare physical page, else steals one: unmaps a mapped page that
// no live allocation touches (the one freed longest ago), else a new page is created. Physical
// memory therefore grows only when every mapped page holds live bytes, so its peak is at most the
// page floor of the same placement (rmm-replay -floor), at the price of map and unmap calls.
//
// It prints, per pass, peak physical / peak live, the driver calls (create, map, unmap) and the
// driver time they would take with the H200 costs of the notes' VMM table (create 15.8 µs, map
// 1.8 + access 53.2 µs, unmap 29.7 µs per 2 MiB page), per trace event.
//
//	go run ./bench/experiments/pagemodel [-page BYTES] [-passes N] [-slack ε] TRACE...
//
// -slack ε creates a new page rather than steal one while physical memory is under (1+ε) × the
// pages holding live bytes: a cushion of idle pages against remapping the same pages back and
// forth (0: steal whenever an idle page exists).
package main

import (
	"container/heap"
	"flag"
	"fmt"
	"path/filepath"
	"strings"

	rmm "github.com/gormm/rmm"
)

// Per-call costs in µs (H200, 2 MiB pages).
const (
	costCreate = 15.8
	costMap    = 1.8 + 53.2
	costUnmap  = 29.7
)

type idle struct {
	page uintptr
	tick int
}

// idleHeap holds mapped pages that no live allocation touches, oldest free first. Entries go
// stale when the page is touched again (checked against pages[page].idleTick).
type idleHeap []idle

func (h idleHeap) Len() int           { return len(h) }
func (h idleHeap) Less(i, j int) bool { return h[i].tick < h[j].tick }
func (h idleHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *idleHeap) Push(x any)        { *h = append(*h, x.(idle)) }
func (h *idleHeap) Pop() any          { o := *h; x := o[len(o)-1]; *h = o[:len(o)-1]; return x }

type pageState struct {
	refs     int32
	mapped   bool
	idleTick int // tick at which it became idle; -1 while live or unmapped
}

type model struct {
	rmm.MemoryResource
	page                 int
	pages                map[uintptr]*pageState
	idle                 idleHeap
	nIdle                int // mapped, unlive pages
	spare                int // physical pages held but not mapped
	phys, peakPhys       int // pages
	tick                 int
	creates, maps, unmap int
	slack                float64
	livePages            int // pages with refs > 0
}

func (m *model) span(p rmm.DevicePtr, n int) (uintptr, uintptr) {
	return uintptr(p) / uintptr(m.page), (uintptr(p) + uintptr(n) - 1) / uintptr(m.page)
}

// physical finds a physical page for a page about to be mapped (not pg itself).
func (m *model) physical() {
	if m.spare > 0 {
		m.spare--
		return
	}
	for float64(m.phys) >= (1+m.slack)*float64(m.livePages) && m.idle.Len() > 0 {
		x := heap.Pop(&m.idle).(idle)
		st := m.pages[x.page]
		if st == nil || !st.mapped || st.refs > 0 || st.idleTick != x.tick {
			continue // stale
		}
		st.mapped, st.idleTick = false, -1
		m.nIdle--
		m.unmap++
		return
	}
	m.creates++
	m.phys++
	m.peakPhys = max(m.peakPhys, m.phys)
}

func (m *model) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	p, err := m.MemoryResource.Allocate(n, s)
	if err != nil || n == 0 || p == 0 {
		return p, err
	}
	m.tick++
	a, b := m.span(p, n)
	for i := a; i <= b; i++ {
		st := m.pages[i]
		if st == nil {
			st = &pageState{idleTick: -1}
			m.pages[i] = st
		}
		if st.refs == 0 && st.mapped {
			m.nIdle-- // its heap entry goes stale
			st.idleTick = -1
		}
		if st.refs++; st.refs == 1 {
			m.livePages++
		}
		if !st.mapped {
			m.physical()
			st.mapped = true
			m.maps++
		}
	}
	return p, nil
}

func (m *model) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	if err := m.MemoryResource.Deallocate(p, n, s); err != nil || n == 0 || p == 0 {
		return err
	}
	m.tick++
	a, b := m.span(p, n)
	for i := a; i <= b; i++ {
		st := m.pages[i]
		if st.refs--; st.refs == 0 {
			m.livePages--
			st.idleTick = m.tick
			heap.Push(&m.idle, idle{i, m.tick})
			m.nIdle++
		}
	}
	return nil
}

func (m *model) Upstream() rmm.MemoryResource { return m.MemoryResource }
func (m *model) Access() rmm.Access           { return rmm.AccessOf(m.MemoryResource) }

func main() {
	page := flag.Int("page", 2<<20, "page size in bytes (a multiple of 2 MiB)")
	passes := flag.Int("passes", 3, "replay this many times on the same pool")
	slack := flag.Float64("slack", 0, "create a new page rather than steal one while the physical pages are fewer than (1+slack) x the pages holding live bytes")
	flag.Parse()
	fmt.Printf("%-40s %4s %8s %8s %8s %8s %8s %10s\n", "trace", "pass", "phys", "creates", "maps", "unmaps", "ms", "ns/event")
	for _, f := range flag.Args() {
		ev, err := rmm.ReadLogFile(f)
		if err != nil {
			panic(err)
		}
		sim, err := rmm.NewSimulatedMemoryResource(1 << 40)
		if err != nil {
			panic(err)
		}
		pool, err := rmm.NewPoolMemoryResource(sim, &rmm.PoolOptions{Expandable: true})
		if err != nil {
			panic(err)
		}
		m := &model{MemoryResource: pool, page: *page, pages: map[uintptr]*pageState{}, slack: *slack}
		name := strings.TrimSuffix(filepath.Base(f), ".csv.gz")
		for pass := 1; pass <= *passes; pass++ {
			c0, m0, u0 := m.creates, m.maps, m.unmap
			r, err := rmm.Replay(ev, m, nil)
			if err != nil {
				panic(err)
			}
			c, mp, u := m.creates-c0, m.maps-m0, m.unmap-u0
			us := float64(c)*costCreate + float64(mp)*costMap + float64(u)*costUnmap
			fmt.Printf("%-40s %4d %8.3f %8d %8d %8d %8.1f %10.0f\n", name, pass,
				float64(m.peakPhys*m.page)/float64(max(r.PeakLiveBytes, 1)), c, mp, u, us/1000, us*1000/float64(len(ev)))
		}
		pool.Close()
	}
}
