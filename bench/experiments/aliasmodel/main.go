// Command aliasmodel is a model, not part of the package: an expandable pool (one address range,
// best fit over one free list, growth at the end by a sixteenth of the pool, at least 32 MiB)
// replayed over a trace, to which it adds stitching by aliasing, as GMLake does but with whole
// physical chunks: when no free block holds a request of at least 2 MiB but the free bytes do,
// the chunks that lie wholly in free memory are mapped a second time, back to back, in a separate
// range (the chunks' own addresses stay mapped and are marked lent while the stitched block
// lives), with a new chunk for what they lack. A stitched range is kept when freed and used again
// for a request it fits (within -slack) once its chunks are all free again, with no driver call.
// It prints peak physical memory / peak live at each pass, and the driver time a pass would take
// with per-call costs from bench/vmm-probe (create + map + access 37 µs at 2 MiB, growing to
// 92 µs at 64 MiB and 152 µs at 1 GiB; a second mapping with access 30 µs; an unmap 20 µs).
//
//	go run ./bench/experiments/aliasmodel [-maxchunk BYTES | -div D] [-exact] [-stitch=false] TRACE...
//
// Streams are ignored (one free list), so the two multi-stream traces come out lower than the
// package's per-stream pool; on the eight one-stream traces, -stitch=false reproduces the
// expandable pool's footprint exactly.
package main

import (
	"flag"
	"fmt"
	"path/filepath"
	"sort"
	"strings"

	rmm "github.com/gormm/rmm"
)

const gran = 2 << 20

type state int

const (
	sFree state = iota
	sLive
	sLent
)

type blk struct {
	addr, size int
	st         state
	prev, next *blk
}

type chunk struct {
	addr, size int
	lent       *stitch
}

type stitch struct {
	va, size int
	chunks   []*chunk
	live     bool
	used     int // last use tick
}

type pool struct {
	head, tail *blk
	top        int
	free       []*blk // sorted by (size, addr)
	freeBytes  int
	chunks     []*chunk // by addr
	phys, peak int
	live       map[int]*blk
	stLive     map[int]*stitch
	stitches   []*stitch
	stTop      int
	tick       int
	// options
	stitchOn      bool
	exact         bool // exact growth when fragmented
	slack         float64
	maxChunk      int
	cacheMax      int
	div, minChunk int
	// costs (µs)
	cost                                float64
	creates, maps, unmaps, stHit, stNew int
}

func less(a, b *blk) bool { return a.size < b.size || (a.size == b.size && a.addr < b.addr) }

func (p *pool) ins(b *blk) {
	i := sort.Search(len(p.free), func(i int) bool { return !less(p.free[i], b) })
	p.free = append(p.free, nil)
	copy(p.free[i+1:], p.free[i:])
	p.free[i] = b
	p.freeBytes += b.size
}
func (p *pool) del(b *blk) {
	i := sort.Search(len(p.free), func(i int) bool { return !less(p.free[i], b) })
	if p.free[i] != b {
		panic("del")
	}
	p.free = append(p.free[:i], p.free[i+1:]...)
	p.freeBytes -= b.size
}

func createCost(sz int) float64 {
	switch {
	case sz <= 2<<20:
		return 37
	case sz <= 64<<20:
		return 37 + float64(sz-(2<<20))/float64(62<<20)*55
	default:
		return 92 + float64(sz-(64<<20))/float64(960<<20)*60
	}
}

const mapCost, unmapCost = 30.0, 20.0

func (p *pool) bestFit(n int) *blk {
	i := sort.Search(len(p.free), func(i int) bool { return p.free[i].size >= n })
	if i == len(p.free) {
		return nil
	}
	return p.free[i]
}

func (p *pool) split(b *blk, n int) {
	if b.size == n {
		return
	}
	r := &blk{addr: b.addr + n, size: b.size - n, st: sFree, prev: b, next: b.next}
	if b.next != nil {
		b.next.prev = r
	} else {
		p.tail = r
	}
	b.next = r
	b.size = n
	p.ins(r)
}

// freeBlk makes b free and coalesces with free neighbours (b not in free set).
func (p *pool) freeBlk(b *blk) *blk {
	b.st = sFree
	if nx := b.next; nx != nil && nx.st == sFree {
		p.del(nx)
		b.size += nx.size
		b.next = nx.next
		if nx.next != nil {
			nx.next.prev = b
		} else {
			p.tail = b
		}
	}
	if pv := b.prev; pv != nil && pv.st == sFree {
		p.del(pv)
		pv.size += b.size
		pv.next = b.next
		if b.next != nil {
			b.next.prev = pv
		} else {
			p.tail = pv
		}
		b = pv
	}
	p.ins(b)
	return b
}

func (p *pool) grow(k int) {
	// one or more handles at the tail
	for k > 0 {
		h := k
		mc := p.maxChunk
		if p.div > 0 {
			mc = max(p.minChunk, up(p.phys/p.div))
		}
		if mc > 0 && h > mc {
			h = mc
		}
		p.chunks = append(p.chunks, &chunk{addr: p.top, size: h})
		p.cost += createCost(h)
		p.creates++
		b := &blk{addr: p.top, size: h, st: sLive, prev: p.tail}
		if p.tail != nil {
			p.tail.next = b
		} else {
			p.head = b
		}
		p.tail = b
		p.top += h
		p.phys += h
		p.peak = max(p.peak, p.phys)
		p.freeBlk(b)
		k -= h
	}
}

func up(n int) int { return (n + gran - 1) / gran * gran }

// blockAt finds the block containing addr (linear from head; model only).
func (p *pool) blockAt(addr int) *blk {
	for b := p.head; b != nil; b = b.next {
		if addr >= b.addr && addr < b.addr+b.size {
			return b
		}
	}
	return nil
}

// wholly free chunks
func (p *pool) freeChunks() []*chunk {
	var out []*chunk
	// walk chain and chunks together
	i := 0
	for b := p.head; b != nil; b = b.next {
		if b.st != sFree {
			continue
		}
		for i < len(p.chunks) && p.chunks[i].addr < b.addr {
			i++
		}
		for j := i; j < len(p.chunks) && p.chunks[j].addr+p.chunks[j].size <= b.addr+b.size; j++ {
			out = append(out, p.chunks[j])
		}
	}
	return out
}

func (p *pool) chunkFree(c *chunk) bool {
	if c.lent != nil {
		return false
	}
	b := p.blockAt(c.addr)
	return b.st == sFree && b.addr+b.size >= c.addr+c.size
}

// lend carves chunk c out of its free block.
func (p *pool) lend(c *chunk, s *stitch) {
	b := p.blockAt(c.addr)
	p.del(b)
	if c.addr > b.addr {
		pre := b.addr
		// split: b becomes [pre, c.addr), new block from c.addr
		nb := &blk{addr: c.addr, size: b.addr + b.size - c.addr, st: sFree, prev: b, next: b.next}
		if b.next != nil {
			b.next.prev = nb
		} else {
			p.tail = nb
		}
		b.next = nb
		b.size = c.addr - pre
		p.ins(b)
		b = nb
	}
	if b.size > c.size {
		r := &blk{addr: b.addr + c.size, size: b.size - c.size, st: sFree, prev: b, next: b.next}
		if b.next != nil {
			b.next.prev = r
		} else {
			p.tail = r
		}
		b.next = r
		b.size = c.size
		p.ins(r)
	}
	b.st = sLent
	c.lent = s
}

func (p *pool) unlend(c *chunk) {
	c.lent = nil
	b := p.blockAt(c.addr)
	if b.st != sLent || b.addr != c.addr || b.size != c.size {
		panic("unlend")
	}
	p.freeBlk(b)
}

func (p *pool) alloc(n int) int {
	n = (n + 255) / 256 * 256
	p.tick++
	if b := p.bestFit(n); b != nil {
		p.del(b)
		p.split(b, n)
		b.st = sLive
		p.live[b.addr] = b
		return b.addr
	}
	frag := p.freeBytes >= n
	if p.stitchOn && frag && n >= gran {
		if a, ok := p.tryStitch(n); ok {
			return a
		}
	}
	tailFree := 0
	if p.tail != nil && p.tail.st == sFree {
		tailFree = p.tail.size
	}
	need := n - tailFree
	k := up(need)
	if !(frag && p.exact) {
		step := min(max(p.phys/16, 32<<20), 1<<30)
		k = up(max(need, step))
	}
	p.grow(k)
	b := p.bestFit(n)
	p.del(b)
	p.split(b, n)
	b.st = sLive
	p.live[b.addr] = b
	return b.addr
}

func (p *pool) tryStitch(n int) (int, bool) {
	// cached
	var best *stitch
	for _, s := range p.stitches {
		if s.live || s.size < n || float64(s.size) > float64(n)*(1+p.slack)+gran {
			continue
		}
		ok := true
		for _, c := range s.chunks {
			if !p.chunkFree(c) {
				ok = false
				break
			}
		}
		if ok && (best == nil || s.size < best.size) {
			best = s
		}
	}
	if best != nil {
		for _, c := range best.chunks {
			p.lend(c, best)
		}
		best.live = true
		best.used = p.tick
		p.stLive[best.va] = best
		p.stHit++
		return best.va, true
	}
	w := p.freeChunks()
	sort.Slice(w, func(i, j int) bool { return w[i].size > w[j].size })
	var pick []*chunk
	sum := 0
	rest := w[:0:0]
	for _, c := range w {
		if sum+c.size <= n {
			pick = append(pick, c)
			sum += c.size
		} else {
			rest = append(rest, c)
		}
	}
	if sum < n {
		// smallest remaining chunk covering the remainder
		var ov *chunk
		for _, c := range rest {
			if c.size >= n-sum && (ov == nil || c.size < ov.size) {
				ov = c
			}
		}
		if ov != nil && float64(sum+ov.size) <= float64(n)*(1+p.slack)+gran {
			pick = append(pick, ov)
			sum += ov.size
		}
	}
	if len(pick) == 0 {
		return 0, false
	}
	if sum < n {
		// new chunk for the remainder at the tail
		k := up(n - sum)
		// grow appends free block at tail; find its chunk
		p.grow(k)
		pick = append(pick, p.chunks[len(p.chunks)-1])
		sum += k
	}
	s := &stitch{va: (1 << 50) + p.stTop, size: sum, chunks: pick, live: true, used: p.tick}
	p.stTop += up(sum) + gran
	for _, c := range pick {
		p.lend(c, s)
		p.cost += mapCost
		p.maps++
	}
	p.stitches = append(p.stitches, s)
	p.stLive[s.va] = s
	p.stNew++
	if p.cacheMax > 0 && len(p.stitches) > p.cacheMax {
		// evict LRU non-live
		idx := -1
		for i, x := range p.stitches {
			if !x.live && (idx < 0 || x.used < p.stitches[idx].used) {
				idx = i
			}
		}
		if idx >= 0 {
			p.cost += unmapCost * float64(len(p.stitches[idx].chunks))
			p.unmaps += len(p.stitches[idx].chunks)
			p.stitches = append(p.stitches[:idx], p.stitches[idx+1:]...)
		}
	}
	return s.va, true
}

func (p *pool) freeP(a int) {
	if s, ok := p.stLive[a]; ok {
		delete(p.stLive, a)
		s.live = false
		for _, c := range s.chunks {
			p.unlend(c)
		}
		return
	}
	b := p.live[a]
	delete(p.live, a)
	p.freeBlk(b)
}

func main() {
	passes := flag.Int("passes", 3, "replay this many times on the same pool")
	stitchOn := flag.Bool("stitch", true, "stitch free chunks by aliasing")
	exact := flag.Bool("exact", false, "grow by only what is missing when the free bytes hold the request")
	slack := flag.Float64("slack", 0.0625, "a stitched range serves requests down to its size / (1 + slack) (minus 2 MiB)")
	maxChunk := flag.Int("maxchunk", 0, "cut every growth into chunks of at most this many bytes (0: one chunk)")
	cacheMax := flag.Int("cache", 0, "keep at most this many stitched ranges (0: all)")
	div := flag.Int("div", 0, "chunks of at most the pool's size / div (overrides -maxchunk)")
	minChunk := flag.Int("minchunk", 2<<20, "with -div: chunks of at least this many bytes")
	flag.Parse()
	for _, f := range flag.Args() {
		ev, err := rmm.ReadLogFile(f)
		if err != nil {
			panic(err)
		}
		p := &pool{live: map[int]*blk{}, stLive: map[int]*stitch{}, stitchOn: *stitchOn, exact: *exact, slack: *slack, maxChunk: *maxChunk, cacheMax: *cacheMax, div: *div, minChunk: *minChunk}
		peakLive, liveB := 0, 0
		var peaks []int
		var costs []float64
		for pass := 0; pass < *passes; pass++ {
			m := map[rmm.DevicePtr]int{}
			sizes := map[rmm.DevicePtr]int{}
			c0 := p.cost
			for _, e := range ev {
				switch e.Action {
				case rmm.ActionAllocate:
					if e.Size == 0 {
						continue
					}
					m[e.Pointer] = p.alloc(e.Size)
					sizes[e.Pointer] = e.Size
					liveB += e.Size
					peakLive = max(peakLive, liveB)
				case rmm.ActionFree:
					if a, ok := m[e.Pointer]; ok {
						p.freeP(a)
						delete(m, e.Pointer)
						liveB -= sizes[e.Pointer]
					}
				}
			}
			// What the trace never frees is freed at the end of each pass, as rmm-replay does.
			for ptr, a := range m {
				p.freeP(a)
				liveB -= sizes[ptr]
			}
			peaks = append(peaks, p.peak)
			costs = append(costs, (p.cost-c0)/1000)
		}
		fmt.Printf("%-40s", strings.TrimSuffix(filepath.Base(f), ".csv.gz"))
		for i := range peaks {
			fmt.Printf(" p%d %.3f (%.0fms)", i+1, float64(peaks[i])/float64(peakLive), costs[i])
		}
		fmt.Printf("  creates %d maps %d unmaps %d hit %d new %d stitches %d\n", p.creates, p.maps, p.unmaps, p.stHit, p.stNew, len(p.stitches))
	}
}
