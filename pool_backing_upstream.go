package rmm

import (
	"cmp"
	"fmt"
	"sort"
)

// The upstream backing: librmm's pool. The pool takes its memory from an upstream MemoryResource
// in large blocks (growth policy as librmm: without a maximum, at least double the pool; with
// one, half the remaining headroom; a failing upstream is retried with halved sizes down to the
// request) and gives back a block only when it is wholly free. Each upstream block is a chain of
// its own: blocks from different upstream allocations never coalesce.

// upstreamBacking is the backing of a plain pool (NewPoolMemoryResource without
// PoolOptions.Expandable).
type upstreamBacking struct {
	noServing
	p      *PoolMemoryResource
	blocks map[DevicePtr]int // the upstream allocations held: address -> size
}

// newUpstreamPool makes a plain pool over upstream, taking o.InitialPoolSize from it now.
func newUpstreamPool(upstream MemoryResource, o PoolOptions) (*PoolMemoryResource, error) {
	p, err := newPool(upstream, o.MaximumPoolSize, o, DeviceOf(upstream))
	if err != nil {
		return nil, err
	}
	u := &upstreamBacking{p: p, blocks: map[DevicePtr]int{}}
	p.backing = u
	if o.InitialPoolSize > 0 {
		ptr, err := upstream.Allocate(o.InitialPoolSize, DefaultStream)
		if err != nil {
			return nil, errorf("NewPoolMemoryResource: taking the initial %s from %s: %w", bytesText(o.InitialPoolSize), resourceName(upstream), err)
		}
		p.mu.Lock()
		l, err := p.listFor(DefaultStream)
		if err != nil {
			p.mu.Unlock()
			upstream.Deallocate(ptr, o.InitialPoolSize, DefaultStream)
			return nil, err
		}
		u.add(ptr, o.InitialPoolSize)
		l.insert(p.newBlock(ptr, o.InitialPoolSize))
		l.dirty = true // a stream-ordered upstream gave it in the default stream's order
		p.mu.Unlock()
	}
	return p, nil
}

// add records the upstream allocation [ptr, ptr+n) in the pool's figures.
func (u *upstreamBacking) add(ptr DevicePtr, n int) {
	p := u.p
	u.blocks[ptr] = n
	p.size += n
	p.sizeAtomic.Store(int64(p.size))
	p.peakSize = max(p.peakSize, p.size)
}

// release gives every upstream block of def that is wholly free back to the upstream (every
// list merged into def after a wait for the work behind the frees). Pool locked, busy token held;
// without hold the upstream's frees are made unlocked, the blocks out of every list meanwhile
// (still counted in the pool's size: nothing grows until the token is released).
func (u *upstreamBacking) release(def *freeList, hold bool) error {
	p := u.p
	var whole []*block
	def.each(func(b *block) {
		if b.prev == nil && b.next == nil { // no neighbour: the whole upstream allocation
			whole = append(whole, b)
		}
	})
	if len(whole) == 0 {
		return nil
	}
	for _, b := range whole {
		def.remove(b)
	}
	p.pin(def)
	p.unlockUnless(hold)
	errs := make([]error, len(whole))
	for i, b := range whole {
		errs[i] = u.free(b)
	}
	p.relockUnless(hold)
	p.unpin(def)
	var firstErr error
	for i, b := range whole {
		if errs[i] != nil {
			firstErr = cmp.Or(firstErr, errs[i])
			p.freeInto(def, b) // stays in the pool, whole and free (its work was waited for)
			continue
		}
		u.forget(b)
	}
	return firstErr
}

// releaseAfterClose gives the block b, just freed after Close, back to the upstream when it is
// the whole of its upstream allocation (pool locked).
func (u *upstreamBacking) releaseAfterClose(b *block) error {
	if b.prev != nil || b.next != nil {
		return nil
	}
	if err := u.free(b); err != nil {
		return err
	}
	b.list.remove(b)
	u.forget(b)
	return nil
}

// free hands the wholly free upstream block b back to the upstream (the pool's figures
// unchanged: forget does that once it succeeded).
func (u *upstreamBacking) free(b *block) error {
	p := u.p
	if err := p.upstream.Deallocate(b.addr, b.size, DefaultStream); err != nil {
		return errorf("PoolMemoryResource: returning %s at %#x to %s: %w", bytesText(b.size), uintptr(b.addr), resourceName(p.upstream), err)
	}
	return nil
}

// forget takes b, given back to the upstream and out of every list, off the pool's figures.
func (u *upstreamBacking) forget(b *block) {
	p := u.p
	delete(u.blocks, b.addr)
	p.size -= b.size
	p.sizeAtomic.Store(int64(p.size))
	p.recycle(b)
}

// growSize is librmm's growth policy for an n-byte request: the size to ask the upstream for
// first, 0 when the pool cannot grow enough.
func (u *upstreamBacking) growSize(n int) int {
	p := u.p
	if p.maximum == 0 {
		return max(n, p.size)
	}
	room := p.maximum - p.size // not rounded up: the pool must never pass its maximum
	if n > room {
		return 0
	}
	// Half the headroom, kept on the 256-byte grid so that what is left stays usable and the
	// pool can reach its maximum exactly.
	return max(n, AlignDown(room/2, Alignment))
}

// backOff is the next size to try after the upstream refused try bytes for an n-byte request:
// half, at least n. Under a maximum it stays on the 256-byte grid; without one it is librmm's
// exact halving.
func (u *upstreamBacking) backOff(try, n int) int {
	p := u.p
	if p.maximum > 0 {
		return max(n, AlignDown(try/2, Alignment))
	}
	return max(n, try/2)
}

// grow takes a new block from the upstream for an n-byte request on s (whose list is l, pinned)
// and returns it, free and out of every list. Pool locked with the busy token held; the upstream
// is called unlocked (nothing else grows or releases meanwhile, so the size it was sized for
// stays).
func (u *upstreamBacking) grow(n int, s StreamView, l *freeList) (*block, error) {
	p := u.p
	try := u.growSize(n)
	if try == 0 {
		DebugLogger().Debug("rmm: PoolMemoryResource cannot grow", "request", n, "pool_size", p.size, "maximum", p.maximum)
		return nil, p.oomErr(n, maxDetail(n, n, p.maximum-p.size, p.maximum), nil, false)
	}
	first, size, lazy, ev := try, p.size, l.lazy, l.event
	p.mu.Unlock()
	var ptr DevicePtr
	var lastErr error
	ok := false
	for try >= n {
		var err error
		if ptr, err = p.upstream.Allocate(try, s); err == nil {
			ok = true
			break
		}
		lastErr = err
		if try == n {
			break
		}
		try = u.backOff(try, n)
	}
	if ok && !lazy && p.ctx != 0 && ev != 0 {
		// The block is ordered on s (a stream-ordered upstream such as cuMemAllocAsync): the
		// event of a list we hold only a view of must cover that before another stream can see
		// the remainder (l is pinned: the event lives; its other records are on s too).
		if err := p.drv.eventRecord(p.ctx, ev, s.cu()); err != nil {
			p.upstream.Deallocate(ptr, try, s)
			p.mu.Lock()
			return nil, errorf("PoolMemoryResource: recording the event on %v: %w", s, err)
		}
	}
	if !ok {
		DebugLogger().Debug("rmm: PoolMemoryResource failed to grow", "request", n, "pool_size", size, "maximum", p.maximum, "err", lastErr)
	} else {
		DebugLogger().Debug("rmm: PoolMemoryResource grew", "request", n, "bytes", try, "pool_size", size+try, "maximum", p.maximum)
	}
	p.mu.Lock()
	if ok {
		if lazy {
			l.dirty = true // a lazy list's event must cover the allocation on s
		}
		u.add(ptr, try)
		return p.newBlock(ptr, try), nil
	}
	detail := fmt.Sprintf("the upstream refused %d bytes", n)
	if first != n {
		detail = fmt.Sprintf("the upstream refused every size from %d down to %d bytes", first, n)
	}
	return nil, p.oomErr(n, detail, lastErr, true)
}

// releaseMayHelp: a plain pool stopped by its maximum gains from giving back, as its free
// upstream blocks count against the maximum.
func (u *upstreamBacking) releaseMayHelp() bool { return true }

// trim is never asked for: a plain pool has no ReleaseThreshold.
func (u *upstreamBacking) trim(*block) {}

func (u *upstreamBacking) close() error { return nil }

func (u *upstreamBacking) stats(st *PoolStats) { st.UpstreamBlocks = len(u.blocks) }

// checkChain verifies that each upstream allocation is one chain of blocks linked to their
// address neighbours, covering it exactly, that together they hold every block of all, and that
// they total the pool's size (CheckInvariants).
func (u *upstreamBacking) checkChain(all map[DevicePtr]*block, served int) error {
	p := u.p
	total, visited := 0, 0
	ups := make([]DevicePtr, 0, len(u.blocks))
	for a := range u.blocks {
		ups = append(ups, a)
	}
	sort.Slice(ups, func(i, j int) bool { return ups[i] < ups[j] })
	for _, a := range ups {
		size := u.blocks[a]
		total += size
		b := all[a]
		if b == nil {
			return errorf("no block starts the upstream allocation %#x", uintptr(a))
		}
		if b.prev != nil {
			return errorf("the first block of upstream allocation %#x has a previous neighbour", uintptr(a))
		}
		covered := 0
		for ; b != nil; b = b.next {
			visited++
			if b.addr%Alignment != 0 || b.size <= 0 {
				return errorf("block %#x of %s is not 256-aligned", uintptr(b.addr), bytesText(b.size))
			}
			if all[b.addr] != b {
				return errorf("block %#x is linked but neither free in a list nor live", uintptr(b.addr))
			}
			covered += b.size
			if nx := b.next; nx != nil {
				if nx.prev != b || nx.addr != b.end() {
					return errorf("blocks %#x and %#x are badly linked", uintptr(b.addr), uintptr(nx.addr))
				}
				if adjacentUncoalesced(b, nx) {
					return errorf("free blocks %#x and %#x are adjacent but not coalesced", uintptr(b.addr), uintptr(nx.addr))
				}
			}
		}
		if covered != size {
			return errorf("upstream allocation %#x of %s is covered by %s of blocks", uintptr(a), bytesText(size), bytesText(covered))
		}
	}
	if visited != len(all) {
		return errorf("%d blocks, %d of them in an upstream allocation's chain", len(all), visited)
	}
	if total != p.size {
		return errorf("upstream blocks total %s, pool size %d", bytesText(total), p.size)
	}
	return nil
}

// exportIPC exports [ptr, ptr+n) through the upstream: the upstream allocation holding it,
// with the range's offset in it.
func (u *upstreamBacking) exportIPC(ptr DevicePtr, n int) (*IPCHandle, error) {
	const name = "PoolMemoryResource"
	p := u.p
	base, size, err := u.blockCovering(ptr, n)
	if err != nil {
		return nil, err
	}
	h, err := ExportIPC(p.upstream, base, size)
	if err != nil {
		return nil, errorf("%s.ExportIPC: the upstream block [%#x, %#x) from %s: %w", name, uintptr(base), uintptr(base)+uintptr(size), resourceName(p.upstream), err)
	}
	h.offset += int(ptr - base)
	h.size = n
	return h, nil
}

// blockCovering returns the upstream allocation that holds [ptr, ptr+n), which must lie in one
// live allocation of the pool.
func (u *upstreamBacking) blockCovering(ptr DevicePtr, n int) (DevicePtr, int, error) {
	p := u.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.checkLiveRange(ptr, n); err != nil {
		return 0, 0, err
	}
	for base, size := range u.blocks {
		if base <= ptr && ptr+DevicePtr(n) <= base+DevicePtr(size) {
			return base, size, nil
		}
	}
	return 0, 0, errorf("internal error: PoolMemoryResource.ExportIPC(%#x, %d): live memory in no upstream block", uintptr(ptr), n)
}
