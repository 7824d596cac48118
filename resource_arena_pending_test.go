package rmm

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// arenaSyncFake stands in for the CUDA calls of an arena (its cudaDriver): it logs every call,
// naming streams and events, and either passes it on to the real driver (next) or answers as a
// device would, following a model of stream order (see arenaSyncModel) that tests check reuse
// against.
type arenaSyncFake struct {
	next *cudaDriver // nil: no device

	mu      sync.Mutex
	log     []string
	calls   int
	quiet   bool               // count calls only
	names   map[uintptr]string // stream handles
	evNames map[uintptr]string
	evCount int
	nextEv  uintptr
	dead    map[uintptr]bool // handles of destroyed streams: a call naming one is an error
	errs    []string
	deadArg string // a destroyed stream named by the call being logged (s), reported by add
	model   *arenaSyncModel
	onSync  func() // called within each cuCtxSynchronize
	// onCall, when set, is called (f.mu not held) at the start of each stream wait, record and
	// event synchronisation, with the call's name: "wait", "record-and-wait", "record",
	// "event-sync". Tests block a call there, or act in the middle of one.
	onCall func(op string)
}

// hook calls onCall.
func (f *arenaSyncFake) hook(op string) {
	f.mu.Lock()
	h := f.onCall
	f.mu.Unlock()
	if h != nil {
		h(op)
	}
}

func newArenaSyncFake(next *cudaDriver) *arenaSyncFake {
	return &arenaSyncFake{
		next:    next,
		names:   map[uintptr]string{cuStreamLegacy: "default"},
		evNames: map[uintptr]string{},
		nextEv:  0x1000,
		dead:    map[uintptr]bool{},
	}
}

// arenaSyncSim returns an arena of size bytes over an address-only upstream whose CUDA calls go
// to a fake device (ctx 1 stands for a context).
func arenaSyncSim(t *testing.T, size int) (*ArenaMemoryResource, *arenaSyncFake) {
	t.Helper()
	a, _ := arenaSim(t, size, nil)
	f := newArenaSyncFake(nil)
	a.ctx, a.drv = 1, f.driver()
	return a, f
}

// arenaSyncStream makes a Stream and returns a view of it carrying the fake handle h (without
// CUDA every Stream's handle is 0; with CUDA the Stream's own handle is kept), named name in the
// log.
func arenaSyncStream(t *testing.T, f *arenaSyncFake, h uintptr, name string) (StreamView, *Stream) {
	t.Helper()
	st, err := NewStream(CurrentDevice(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { st.Close() })
	v := st.View()
	if v.h == 0 {
		// Not h itself: with CUDA the Stream keeps its own handle, so a test that names the
		// stream by h rather than by the view's handle must fail here too, not only on a GPU.
		v.h = h | arenaSyncHandleBit
	} // with CUDA, the real handle: Stream.Close tells the arena about that one
	f.name(v.h, name)
	return v, st
}

// arenaSyncHandleBit marks the handles arenaSyncStream gives its Streams' views without CUDA.
const arenaSyncHandleBit = 1 << 44

// arenaSyncForeign returns a view of a foreign stream (as NewStreamView makes) with handle h.
func arenaSyncForeign(f *arenaSyncFake, h uintptr, id uint64, name string) StreamView {
	f.name(h, name)
	return StreamView{h: h, id: foreignStreamBit | id}
}

// name names the stream with handle h (a new stream: a handle the driver reused is alive again).
func (f *arenaSyncFake) name(h uintptr, name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.names[h] = name
	delete(f.dead, h)
}

// kill marks the stream with handle h destroyed, unless a live Stream has that handle again: with
// CUDA the driver may give a destroyed stream's handle to the next stream made, perhaps by another
// goroutine and named (name) before the caller's kill. (Seen on an H200: a walk's worker killed
// the handle of the stream it had closed after another worker's new stream had it.) The look at
// the live Streams is made under f.mu, as name is: made before it, a new Stream with h made and
// named between the look and the mark would find its name marked dead (seen once on an H200).
func (f *arenaSyncFake) kill(h uintptr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	reused := false
	streamRegistry.Range(func(_, x any) bool {
		reused = x.(*Stream).view.h == h
		return !reused
	})
	if !reused {
		f.dead[h] = true
	}
}

// take returns the calls logged since the last take.
func (f *arenaSyncFake) take() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	l := f.log
	f.log = nil
	return l
}

func (f *arenaSyncFake) errors() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.errs)
}

// s names a stream handle (f.mu held); a call naming a destroyed stream is an error.
func (f *arenaSyncFake) s(h uintptr) string {
	n, ok := f.names[h]
	if !ok {
		n = fmt.Sprintf("%#x", h)
	}
	if f.dead[h] {
		f.deadArg = n
	}
	return n
}

// e names an event (f.mu held).
func (f *arenaSyncFake) e(h uintptr) string {
	n, ok := f.evNames[h]
	if !ok {
		f.evCount++
		n = fmt.Sprintf("e%d", f.evCount)
		f.evNames[h] = n
	}
	return n
}

func (f *arenaSyncFake) add(format string, args ...any) {
	if f.deadArg != "" {
		f.errs = append(f.errs, fmt.Sprintf("a call names the destroyed stream %s: "+format, append([]any{f.deadArg}, args...)...))
		f.deadArg = ""
	}
	f.calls++
	if !f.quiet {
		f.log = append(f.log, fmt.Sprintf(format, args...))
	}
}

func (f *arenaSyncFake) driver() *cudaDriver {
	return &cudaDriver{
		ctxSynchronize: func(ctx uintptr) error {
			f.mu.Lock()
			f.add("ctx-sync")
			f.model.ctxSync()
			on := f.onSync
			f.mu.Unlock()
			if on != nil {
				on()
			}
			if f.next != nil {
				return f.next.ctxSynchronize(ctx)
			}
			return nil
		},
		streamSynchronize: func(ctx, s uintptr) error {
			f.mu.Lock()
			f.add("sync %s", f.s(s))
			f.model.streamSync(s)
			f.mu.Unlock()
			if f.next != nil {
				return f.next.streamSynchronize(ctx, s)
			}
			return nil
		},
		streamQuery: func(ctx, s uintptr) (bool, error) {
			f.mu.Lock()
			f.add("query %s", f.s(s))
			f.mu.Unlock()
			if f.next != nil {
				return f.next.streamQuery(ctx, s)
			}
			return false, nil // busy: the caller synchronises
		},
		streamWaitEvent: func(ctx, s, e uintptr) error {
			f.hook("wait")
			f.mu.Lock()
			f.add("wait %s on %s", f.s(s), f.e(e))
			f.model.wait(s, e)
			f.mu.Unlock()
			if f.next != nil {
				return f.next.streamWaitEvent(ctx, s, e)
			}
			return nil
		},
		recordAndWait: func(ctx, e, from, to uintptr) error {
			f.hook("record-and-wait")
			f.mu.Lock()
			f.add("record %s on %s, wait %s", f.e(e), f.s(from), f.s(to))
			f.model.record(e, from)
			f.model.wait(to, e)
			f.mu.Unlock()
			if f.next != nil {
				return f.next.recordAndWait(ctx, e, from, to)
			}
			return nil
		},
		eventCreate: func(ctx uintptr, flags uint) (uintptr, error) {
			var e uintptr
			if f.next != nil {
				var err error
				if e, err = f.next.eventCreate(ctx, flags); err != nil {
					return 0, err
				}
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			if f.next == nil {
				f.nextEv++
				e = f.nextEv
			}
			f.add("create %s", f.e(e))
			return e, nil
		},
		eventRecord: func(ctx, e, s uintptr) error {
			f.hook("record")
			f.mu.Lock()
			f.add("record %s on %s", f.e(e), f.s(s))
			f.model.record(e, s)
			f.mu.Unlock()
			if f.next != nil {
				return f.next.eventRecord(ctx, e, s)
			}
			return nil
		},
		eventSynchronize: func(ctx, e uintptr) error {
			f.hook("event-sync")
			f.mu.Lock()
			f.add("event-sync %s", f.e(e))
			f.model.eventSync(e)
			f.mu.Unlock()
			if f.next != nil {
				return f.next.eventSynchronize(ctx, e)
			}
			return nil
		},
		eventDestroy: func(ctx, e uintptr) error {
			f.mu.Lock()
			f.add("destroy %s", f.e(e))
			delete(f.evNames, e) // a later event may reuse the handle
			f.mu.Unlock()
			if f.next != nil {
				return f.next.eventDestroy(ctx, e)
			}
			return nil
		},
	}
}

// arenaSyncModel follows the order a device would give the work of each stream. The work queued
// on a stream before its k-th free is (stream, k). What a stream is ordered after is a vector
// (for each stream, the last free covered): waiting on an event joins the vector the event
// captured, a record captures the recording stream's vector plus its own frees. What the host
// knows finished is another vector. A block handed to stream t is safe when, for every free of
// its bytes by another stream a, t is ordered after that free or the host saw it finish.
type arenaSyncModel struct {
	streams map[uintptr]int // handle -> stream number
	seq     []int           // frees per stream
	after   [][]int         // after[t][a]: the last free of a that t is ordered after
	done    []int           // done[a]: the last free of a known finished
	events  map[uintptr][]int
	freed   []arenaSyncFreed
}

type arenaSyncFreed struct {
	p, end DevicePtr
	s, k   int
}

func newArenaSyncModel() *arenaSyncModel {
	return &arenaSyncModel{streams: map[uintptr]int{}, events: map[uintptr][]int{}}
}

// stream adds a stream with handle h and returns its number.
func (m *arenaSyncModel) stream(h uintptr) int {
	i := len(m.seq)
	m.streams[h] = i
	m.seq = append(m.seq, 0)
	m.done = append(m.done, 0)
	for j := range m.after {
		m.after[j] = append(m.after[j], 0)
	}
	m.after = append(m.after, make([]int, i+1))
	return i
}

func (m *arenaSyncModel) of(h uintptr) int {
	i, ok := m.streams[h]
	if !ok {
		panic(fmt.Sprintf("model: unknown stream %#x", h))
	}
	return i
}

func joinMax(dst, src []int) {
	for i, v := range src {
		dst[i] = max(dst[i], v)
	}
}

func (m *arenaSyncModel) record(e, h uintptr) {
	if m == nil {
		return
	}
	a := m.of(h)
	v := slices.Clone(m.after[a])
	v[a] = m.seq[a]
	m.events[e] = v
}

func (m *arenaSyncModel) wait(h, e uintptr) {
	if m == nil {
		return
	}
	if v, ok := m.events[e]; ok {
		joinMax(m.after[m.of(h)], v)
	}
}

func (m *arenaSyncModel) streamSync(h uintptr) {
	if m == nil {
		return
	}
	a := m.of(h)
	joinMax(m.done, m.after[a])
	m.done[a] = max(m.done[a], m.seq[a])
}

func (m *arenaSyncModel) eventSync(e uintptr) {
	if m != nil {
		joinMax(m.done, m.events[e])
	}
}

func (m *arenaSyncModel) ctxSync() {
	if m != nil {
		joinMax(m.done, m.seq)
	}
}

// free notes that stream a (number) frees [p, p+n): call it before Deallocate.
func (m *arenaSyncModel) free(a int, p DevicePtr, n int) {
	m.seq[a]++
	m.freed = append(m.freed, arenaSyncFreed{p, p + DevicePtr(n), a, m.seq[a]})
}

// allocated checks that stream t may use [p, p+n), just allocated, and forgets the frees of
// those bytes.
func (m *arenaSyncModel) allocated(t int, p DevicePtr, n int) error {
	end := p + DevicePtr(n)
	var err error
	var keep []arenaSyncFreed
	for _, x := range m.freed {
		if x.end <= p || x.p >= end {
			keep = append(keep, x)
			continue
		}
		if err == nil && x.s != t && m.after[t][x.s] < x.k && m.done[x.s] < x.k {
			err = fmt.Errorf("stream %d got [%#x, %#x) before the work of stream %d's free #%d over [%#x, %#x) (ordered after #%d, finished #%d)",
				t, uintptr(p), uintptr(end), x.s, x.k, uintptr(x.p), uintptr(x.end), m.after[t][x.s], m.done[x.s])
		}
		if x.p < p {
			keep = append(keep, arenaSyncFreed{x.p, p, x.s, x.k})
		}
		if x.end > end {
			keep = append(keep, arenaSyncFreed{end, x.end, x.s, x.k})
		}
	}
	m.freed = keep
	return err
}

// returned checks that [p, p+n), given back to the upstream (or unmapped), holds no byte whose
// free the host has not seen finish, and forgets the frees of those bytes.
func (m *arenaSyncModel) returned(p DevicePtr, n int) error {
	end := p + DevicePtr(n)
	var err error
	var keep []arenaSyncFreed
	for _, x := range m.freed {
		if x.end <= p || x.p >= end {
			keep = append(keep, x)
			continue
		}
		if err == nil && m.done[x.s] < x.k {
			err = fmt.Errorf("[%#x, %#x) given back before the work of stream %d's free #%d over [%#x, %#x) finished (finished #%d)",
				uintptr(p), uintptr(end), x.s, x.k, uintptr(x.p), uintptr(x.end), m.done[x.s])
		}
		if x.p < p {
			keep = append(keep, arenaSyncFreed{x.p, p, x.s, x.k})
		}
		if x.end > end {
			keep = append(keep, arenaSyncFreed{end, x.end, x.s, x.k})
		}
	}
	m.freed = keep
	return err
}

// The pending set: at most arenaPendingMax distinct streams, finished ones pruned when room is
// needed, union passing on what does not fit.
func TestArenaPendingSet(t *testing.T) {
	xs := make([]*arenaStream, 7)
	for i := range xs {
		xs[i] = &arenaStream{stream: StreamView{id: ownedStreamBit | uint64(i+1)}, lazy: true}
	}
	var nilSet *arenaPending
	require.Zero(t, nilSet.len())
	require.False(t, nilSet.has(xs[0]))
	require.True(t, nilSet.fits(xs[0]))
	nilSet.clear()

	var p arenaPending
	for i := 0; i < arenaPendingMax; i++ {
		require.True(t, p.add(xs[i]))
		require.True(t, p.add(xs[i]), "twice: no new entry")
	}
	require.Equal(t, arenaPendingMax, p.len())
	require.NoError(t, p.check())
	require.False(t, p.fits(xs[4]))
	require.False(t, p.add(xs[4]), "full")
	require.True(t, p.fits(xs[2]), "already there")
	require.Equal(t, arenaPendingMax, p.len(), "a refused add changes nothing")

	xs[1].done = true // its Stream closed after synchronising
	require.True(t, p.add(xs[4]), "the finished stream makes room")
	require.False(t, p.has(xs[1]))
	require.Equal(t, []*arenaStream{xs[0], xs[2], xs[3], xs[4]}, p.recs[:p.n])
	require.NoError(t, p.check())
	xs[1].done = false

	var q arenaPending
	q.add(xs[4]) // in both
	q.add(xs[5])
	q.add(xs[6])
	q.add(xs[0]) // in both
	var over []*arenaStream
	p.union(&q, func(x *arenaStream) { over = append(over, x) })
	require.Equal(t, []*arenaStream{xs[5], xs[6]}, over, "what does not fit is passed on")
	require.Equal(t, []*arenaStream{xs[0], xs[2], xs[3], xs[4]}, p.recs[:p.n])
	p.union(nil, func(*arenaStream) { t.Fatal("nothing to pass on") })

	var r arenaPending
	r.union(&q, func(*arenaStream) { t.Fatal("room for all") })
	require.Equal(t, q.recs, r.recs)

	p.clear()
	require.Zero(t, p.len())
	require.Equal(t, [arenaPendingMax]*arenaStream{}, p.recs)
	p.recs[0], p.recs[1], p.n = xs[0], xs[0], 2
	require.Error(t, p.check(), "duplicate")
	p.recs[1], p.n = nil, 1
	require.NoError(t, p.check())
	p.recs[2] = xs[2]
	require.Error(t, p.check(), "entry past the count")
}

// One stream allocating and freeing, large blocks or small, on DefaultStream or one of our
// Streams, makes no CUDA call at all.
func TestArenaSyncOneStreamNoCalls(t *testing.T) {
	for _, own := range []bool{false, true} {
		a, f := arenaSyncSim(t, 1<<30)
		s := DefaultStream
		if own {
			s, _ = arenaSyncStream(t, f, 0xa, "A")
		}
		for i := 0; i < 200; i++ {
			for _, n := range []int{64 << 20, 4096, 3<<20 + 256, 1 << 20, 900 << 20} {
				p := arenaAlloc(t, a, n, s)
				require.NoError(t, a.Deallocate(p, n, s))
			}
		}
		require.Empty(t, f.take(), "%v", s)
		arenaCheck(t, a)
		require.NoError(t, a.Close())
		require.Equal(t, []string{"ctx-sync"}, f.take(), "no event was ever made")
	}
}

// A large block freed on A is taken by B: B waits on the device for A's event, recorded then
// (A's lifetime is known); a third stream waits on the event as recorded, until A frees again.
func TestArenaSyncLargeCrossStream(t *testing.T) {
	const n = 64 << 20
	a, f := arenaSyncSim(t, 4*n)
	sa, _ := arenaSyncStream(t, f, 0xa, "A")
	sb, _ := arenaSyncStream(t, f, 0xb, "B")
	sc, _ := arenaSyncStream(t, f, 0xc, "C")
	x := arenaAlloc(t, a, n, sa)
	require.NoError(t, a.Deallocate(x, n, sa))
	require.Empty(t, f.take(), "the free makes no call")
	y := arenaAlloc(t, a, n, sb)
	require.Equal(t, x, y)
	require.Equal(t, []string{"create e1", "record e1 on A, wait B"}, f.take())
	z := arenaAlloc(t, a, n, sc)
	require.Equal(t, x+n, z, "the tail split off kept A as pending")
	require.Equal(t, []string{"wait C on e1"}, f.take(), "A freed nothing since: its event stands")
	require.NoError(t, a.Deallocate(y, n, sb))
	require.NoError(t, a.Deallocate(z, n, sc))
	require.Empty(t, f.take())
	arenaCheck(t, a)
	// The three merged superblocks name A, B and C; A takes the memory: it waits for B and C.
	w := arenaAlloc(t, a, 2*n, sa)
	require.Equal(t, x, w)
	require.ElementsMatch(t, []string{"create e2", "record e2 on B, wait A", "create e3", "record e3 on C, wait A"}, f.take())
	require.NoError(t, a.Deallocate(w, 2*n, sa))
	// DefaultStream is a stream like another: its event is made when first needed.
	v := arenaAlloc(t, a, n, DefaultStream)
	require.Equal(t, x, v)
	require.ElementsMatch(t, []string{"record e1 on A, wait default", "wait default on e2", "wait default on e3"}, f.take())
	require.NoError(t, a.Deallocate(v, n, DefaultStream))
	v = arenaAlloc(t, a, n, sb)
	require.ElementsMatch(t, []string{"create e4", "record e4 on default, wait B", "wait B on e1", "wait B on e3"}, f.take())
	require.NoError(t, a.Deallocate(v, n, sb))
	arenaCheck(t, a)
	// Release synchronises the device: nothing is pending afterwards.
	require.NoError(t, a.Release())
	require.Equal(t, []string{"ctx-sync"}, f.take())
	v = arenaAlloc(t, a, n, sc)
	require.Empty(t, f.take())
	require.NoError(t, a.Deallocate(v, n, sc))
	require.NoError(t, a.Close())
	log := f.take()
	require.Equal(t, "ctx-sync", log[0])
	require.ElementsMatch(t, []string{"destroy e1", "destroy e2", "destroy e3", "destroy e4"}, log[1:])
}

// A small request that takes a superblock from the global arena waits for the streams that
// freed into it; the superblock then forgets them, while the tail left in the global arena keeps
// them.
func TestArenaSyncTakeSuperblock(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, f := arenaSyncSim(t, 8*mb)
	sa, _ := arenaSyncStream(t, f, 0xa, "A")
	sb, _ := arenaSyncStream(t, f, 0xb, "B")
	x := arenaAlloc(t, a, 4*mb, sa)
	require.NoError(t, a.Deallocate(x, 4*mb, sa))
	y := arenaAlloc(t, a, 4096, sb)
	require.Equal(t, x, y)
	require.Equal(t, []string{"create e1", "record e1 on A, wait B"}, f.take())
	arenaCheck(t, a) // B's superblock names no pending stream
	// B's arena serves B without calls; DefaultStream's shard takes the next megabyte and waits.
	y2 := arenaAlloc(t, a, 8192, sb)
	require.Empty(t, f.take())
	z := arenaAlloc(t, a, 4096, DefaultStream)
	require.Equal(t, x+mb, z)
	require.Equal(t, []string{"wait default on e1"}, f.take())
	// A small free on another stream than the arena's still synchronises that stream.
	require.NoError(t, a.Deallocate(y2, 8192, sa))
	require.Equal(t, []string{"query A", "sync A"}, f.take())
	require.NoError(t, a.Deallocate(y, 4096, sb))
	require.NoError(t, a.Deallocate(z, 4096, DefaultStream))
	require.Empty(t, f.take())
	arenaCheck(t, a)
}

// A foreign stream's event is made with its record and recorded at every free into the global
// arena; others only wait on it, so nothing touches the stream once it is destroyed. A
// defragmentation drops the record and its event.
func TestArenaSyncForeignStream(t *testing.T) {
	const n = 4 << 20
	a, f := arenaSyncSim(t, 4*n)
	fs := arenaSyncForeign(f, 0xf, 7, "F")
	sb, _ := arenaSyncStream(t, f, 0xb, "B")
	x := arenaAlloc(t, a, n, fs)
	require.Empty(t, f.take())
	require.NoError(t, a.Deallocate(x, n, fs))
	require.Equal(t, []string{"create e1", "record e1 on F"}, f.take())
	x = arenaAlloc(t, a, n, fs)
	require.Empty(t, f.take(), "its own memory: no wait")
	require.NoError(t, a.Deallocate(x, n, fs))
	require.Equal(t, []string{"record e1 on F"}, f.take())
	f.kill(0xf)
	y := arenaAlloc(t, a, n, sb)
	require.Equal(t, x, y)
	require.Equal(t, []string{"wait B on e1"}, f.take())
	z := arenaAlloc(t, a, 4096, DefaultStream)
	require.Equal(t, []string{"wait default on e1"}, f.take(), "the tail remembers F too")
	require.NoError(t, a.Deallocate(y, n, sb))
	require.NoError(t, a.Deallocate(z, 4096, DefaultStream))
	require.Empty(t, f.errors())
	require.NoError(t, a.Release())
	require.Equal(t, []string{"ctx-sync", "destroy e1"}, f.take())
	_, ok := a.recs.Load(fs.id)
	require.False(t, ok, "the record is dropped")
	arenaCheck(t, a)
}

// A Stream that freed into the global arena is synchronised when it closes; superblocks that
// still name it ignore it afterwards, and its event is destroyed.
func TestArenaSyncStreamClose(t *testing.T) {
	const n = 4 << 20
	a, f := arenaSyncSim(t, 4*n)
	sa, sta := arenaSyncStream(t, f, 0xa, "A")
	sb, _ := arenaSyncStream(t, f, 0xb, "B")
	sc, _ := arenaSyncStream(t, f, 0xc, "C")
	x := arenaAlloc(t, a, n, sa)
	require.NoError(t, a.Deallocate(x, n, sa))
	y := arenaAlloc(t, a, n, sb) // A's event is made and recorded
	require.Equal(t, []string{"create e1", "record e1 on A, wait B"}, f.take())
	require.NoError(t, a.Deallocate(y, n, sb))
	x = arenaAlloc(t, a, n, sa) // waits for B
	require.NoError(t, a.Deallocate(x, n, sa))
	f.take()
	require.NoError(t, sta.Close())
	require.Equal(t, []string{"sync " + f.nameOf(sta.View().cu()), "destroy e1"}, f.take())
	f.kill(sa.h)
	y = arenaAlloc(t, a, n, sc)
	require.Equal(t, x, y)
	require.Equal(t, []string{"wait C on e2"}, f.take(), "A is ignored: its work finished; B freed nothing since A waited for it")
	require.NoError(t, a.Deallocate(y, n, sc))
	// Freeing on the closed Stream synchronises the device.
	p := arenaAlloc(t, a, n, sb)
	f.take()
	require.NoError(t, a.Deallocate(p, n, sa))
	require.Equal(t, []string{"ctx-sync"}, f.take())
	require.Empty(t, f.errors())
	arenaCheck(t, a)
}

func (f *arenaSyncFake) nameOf(h uintptr) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if n, ok := f.names[h]; ok {
		return n
	}
	return fmt.Sprintf("%#x", h)
}

// A free into the global arena while a defragmentation waits for the device is not covered by
// that wait: it must be noted after the defragmentation forgets the pending streams, not before.
func TestArenaSyncFreeDuringDefragment(t *testing.T) {
	const n = 4 << 20
	a, f := arenaSyncSim(t, 4*n)
	sb, _ := arenaSyncStream(t, f, 0xb, "B")
	x := arenaAlloc(t, a, n, DefaultStream)
	freed := make(chan error, 1)
	var once sync.Once
	f.onSync = func() {
		once.Do(func() {
			go func() { freed <- a.Deallocate(x, n, DefaultStream) }()
			time.Sleep(20 * time.Millisecond) // room for the free to run, were it not held back
		})
	}
	require.NoError(t, a.Release())
	require.NoError(t, <-freed)
	f.onSync = nil
	f.take()
	y := arenaAlloc(t, a, n, sb)
	require.Equal(t, x, y)
	require.Equal(t, []string{"create e1", "record e1 on default, wait B"}, f.take())
	require.NoError(t, a.Deallocate(y, n, sb))
	arenaCheck(t, a)
}

// Superblocks that merge wait for the streams of both; past arenaPendingMax streams, a merge
// synchronises the streams that do not fit, and a free by one more stream synchronises it.
func TestArenaSyncPendingOverflow(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, f := arenaSyncSim(t, 16*mb)
	var ss []StreamView
	for i := range 6 {
		s, _ := arenaSyncStream(t, f, uintptr(0xa+i), string(rune('A'+i)))
		ss = append(ss, s)
	}
	// Five 2 MiB blocks side by side; freed in order, each merges with the one before.
	var ps []DevicePtr
	for _, s := range ss[:5] {
		ps = append(ps, arenaAlloc(t, a, 2*mb, s))
	}
	for i := range 4 {
		require.NoError(t, a.Deallocate(ps[i], 2*mb, ss[i]))
	}
	require.Empty(t, f.take())
	require.NoError(t, a.Deallocate(ps[4], 2*mb, ss[4]))
	require.Equal(t, []string{"sync E"}, f.take(), "the fifth stream does not fit in the merged superblock")
	arenaCheck(t, a)
	require.Equal(t, 1, a.Stats().Superblocks)
	p := arenaAlloc(t, a, 2*mb, ss[5])
	require.ElementsMatch(t, []string{"create e1", "record e1 on A, wait F", "create e2", "record e2 on B, wait F",
		"create e3", "record e3 on C, wait F", "create e4", "record e4 on D, wait F"}, f.take())
	require.NoError(t, a.Deallocate(p, 2*mb, ss[5]))
	require.NoError(t, a.Release())
	f.take()

	// Small blocks of several streams in one superblock that went back to the global arena
	// (Release moves it there with its blocks): a fifth stream's free synchronises it.
	var qs []DevicePtr
	for range 6 {
		qs = append(qs, arenaAlloc(t, a, 4096, ss[0]))
	}
	require.NoError(t, a.Release())
	require.Equal(t, []string{"ctx-sync"}, f.take())
	for i := range 4 {
		require.NoError(t, a.Deallocate(qs[i], 4096, ss[i]))
	}
	require.Empty(t, f.take())
	require.NoError(t, a.Deallocate(qs[4], 4096, ss[4]))
	require.Equal(t, []string{"query E", "sync E"}, f.take())
	require.NoError(t, a.Deallocate(qs[5], 4096, ss[1]))
	require.Empty(t, f.take(), "B is already pending there")
	arenaCheck(t, a)
}

// modelStream is a stream of a random walk against the model of stream order.
type modelStream struct {
	v    StreamView
	st   *Stream // nil: DefaultStream or a foreign stream
	i    int     // in the model
	gone bool    // closed (ours) or destroyed (foreign)
}

// modelStreams is the streams of a random walk against the model (f.model): DefaultStream first,
// then Streams of ours and foreign streams, named in the fake and numbered in the model as they
// come.
type modelStreams struct {
	t      *testing.T
	f      *arenaSyncFake
	r      *rand.Rand
	all    []*modelStream
	nextH  uintptr
	nextID uint64
	blocks []modelBlock // live
}

// newModelStreams returns DefaultStream, ours Streams of ours and foreign foreign streams.
func newModelStreams(t *testing.T, f *arenaSyncFake, r *rand.Rand, ours, foreign int) *modelStreams {
	w := &modelStreams{t: t, f: f, r: r, nextH: 0x100, nextID: 1}
	f.mu.Lock()
	w.all = append(w.all, &modelStream{v: DefaultStream, i: f.model.stream(cuStreamLegacy)})
	f.mu.Unlock()
	for range ours {
		w.add(false)
	}
	for range foreign {
		w.add(true)
	}
	return w
}

// modelBlock is a live allocation of a random walk: n bytes asked at p on s, m bytes in the model.
type modelBlock struct {
	p    DevicePtr
	n, m int
	s    *modelStream
}

// took checks in the model that s may use the m bytes at p, just allocated for n bytes asked,
// and adds the block to the live ones.
func (w *modelStreams) took(s *modelStream, p DevicePtr, n, m int) error {
	w.f.mu.Lock()
	err := w.f.model.allocated(s.i, p, m)
	w.f.mu.Unlock()
	w.blocks = append(w.blocks, modelBlock{p, n, m, s})
	return err
}

// free frees the live block k with mr on the stream freeOn picks, noting the free in the model
// first.
func (w *modelStreams) free(mr MemoryResource, k int) error {
	b := w.blocks[k]
	w.blocks = slices.Delete(w.blocks, k, k+1)
	s := w.freeOn(b.s)
	w.f.mu.Lock()
	w.f.model.free(s.i, b.p, b.m)
	w.f.mu.Unlock()
	return mr.Deallocate(b.p, b.n, s.v)
}

// add adds a Stream of ours, or a foreign stream.
func (w *modelStreams) add(foreign bool) {
	w.nextH++
	s := &modelStream{}
	if foreign {
		w.nextID++
		s.v = arenaSyncForeign(w.f, w.nextH, w.nextID, fmt.Sprintf("F%d", w.nextID))
	} else {
		s.v, s.st = arenaSyncStream(w.t, w.f, w.nextH, fmt.Sprintf("S%#x", w.nextH))
	}
	w.f.mu.Lock()
	s.i = w.f.model.stream(s.v.h)
	w.f.mu.Unlock()
	w.all = append(w.all, s)
}

// pick returns a stream neither closed nor destroyed.
func (w *modelStreams) pick() *modelStream {
	var live []*modelStream
	for _, s := range w.all {
		if !s.gone {
			live = append(live, s)
		}
	}
	return live[w.r.IntN(len(live))]
}

// freeOn returns the stream to free a block allocated on s on: mostly s, now and then another
// live stream (always when s is gone), or a closed Stream of ours if any (the device is then
// synchronised).
func (w *modelStreams) freeOn(s *modelStream) *modelStream {
	switch v := w.r.IntN(10); {
	case v < 2 || s.gone:
		return w.pick()
	case v == 2:
		for _, x := range w.all {
			if x.gone && x.st != nil {
				return x
			}
		}
	}
	return s
}

// closeOne closes the first open Stream of ours with close, and adds another.
func (w *modelStreams) closeOne(close func(*modelStream)) {
	for _, s := range w.all[1:] {
		if !s.gone && s.st != nil {
			close(s)
			w.f.kill(s.v.h)
			s.gone = true
			break
		}
	}
	w.add(false)
}

// killOne destroys the first foreign stream still alive, and adds another.
func (w *modelStreams) killOne() {
	for _, s := range w.all[1:] {
		if !s.gone && s.st == nil {
			w.f.kill(s.v.h)
			s.gone = true
			break
		}
	}
	w.add(true)
}

// Random work on DefaultStream, Streams that close and foreign streams that are destroyed,
// against the model of stream order: every block handed out is ordered after the work behind
// every earlier free of its bytes, and no call names a stream after its end.
func TestArenaSyncAgainstModel(t *testing.T) {
	const mb = arenaMinSuperblockSize
	for seed := range uint64(4) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			a, f := arenaSyncSim(t, 96*mb)
			m := newArenaSyncModel()
			f.model = m
			r := rand.New(rand.NewPCG(seed, 3))
			w := newModelStreams(t, f, r, 3, 2)
			for op := 0; op < 3000; op++ {
				switch v := r.IntN(100); {
				case len(w.blocks) == 0 || (len(w.blocks) < 24 && v < 50):
					s := w.pick()
					var n int
					switch w := r.IntN(10); {
					case w < 5:
						n = 256 * (1 + r.IntN(64))
					case w < 7:
						n = 256 * (1 + r.IntN(4096))
					default:
						n = mb + 256*(1+r.IntN(6*4096))
					}
					p, err := a.Allocate(n, s.v)
					if errors.Is(err, ErrOutOfMemory) {
						continue
					}
					require.NoError(t, err)
					require.NoError(t, w.took(s, p, n, roundUp(n)), "op %d", op)
				case v < 93:
					require.NoError(t, w.free(a, r.IntN(len(w.blocks))))
				case v < 96:
					// A Stream closes (its frees so far must finish first) and another comes.
					w.closeOne(func(s *modelStream) { brkCloseInModel(t, f, s.st, s.i) })
				case v < 99:
					w.killOne() // a foreign stream is destroyed and another appears
				default:
					require.NoError(t, a.Release())
				}
				if op%100 == 0 {
					arenaCheck(t, a)
				}
			}
			for len(w.blocks) > 0 {
				require.NoError(t, w.free(a, len(w.blocks)-1))
			}
			require.Empty(t, f.errors())
			arenaCheck(t, a)
			t.Logf("%d driver calls over 3000 operations, %d defragmentations", f.calls, a.Stats().Defragmentations)
		})
	}
}

// Many goroutines on shared and own streams, large and small blocks, cross-stream frees, with
// the stream ordering on (a fake device): the arena stays consistent under the race detector.
func TestArenaSyncConcurrent(t *testing.T) {
	a, err := NewArenaMemoryResource(arenaMustSim(t, 1<<40), &ArenaOptions{ArenaSize: 256 << 20, DefaultStreamArenas: 4})
	require.NoError(t, err)
	defer func() { require.NoError(t, a.Close()) }()
	f := newArenaSyncFake(nil)
	f.quiet = true
	a.ctx, a.drv = 1, f.driver()
	arenaConcurrent(t, a, false)
	require.Empty(t, f.errors())
	t.Logf("%d driver calls", f.calls)
}

// A stream that already waits for another stream's event as last recorded does not wait for it
// again: its later work stays ordered after the first wait. A new record (a lazy stream's frees
// since, or every free of a foreign stream) makes it wait again; foreign waiters always wait.
func TestArenaSyncNoRedundantWait(t *testing.T) {
	const n = 4 << 20
	a, f := arenaSyncSim(t, 16*n)
	sa, _ := arenaSyncStream(t, f, 0xa, "A")
	sb, _ := arenaSyncStream(t, f, 0xb, "B")
	fs := arenaSyncForeign(f, 0xf, 7, "F")
	x := arenaAlloc(t, a, 4*n, sa)
	require.NoError(t, a.Deallocate(x, 4*n, sa))
	require.Empty(t, f.take())

	// B takes two pieces of what A freed: one wait.
	y1 := arenaAlloc(t, a, n, sb)
	require.Equal(t, []string{"create e1", "record e1 on A, wait B"}, f.take())
	y2 := arenaAlloc(t, a, n, sb)
	require.Equal(t, x+n, y2)
	require.Empty(t, f.take(), "B already waits for e1 as recorded")
	// A foreign stream is not remembered: it waits each time.
	z1 := arenaAlloc(t, a, n, fs)
	require.Equal(t, []string{"wait F on e1"}, f.take())
	require.NoError(t, a.Deallocate(z1, n, fs))
	require.Equal(t, []string{"create e2", "record e2 on F"}, f.take())
	z1 = arenaAlloc(t, a, n, fs)
	require.Equal(t, []string{"wait F on e1"}, f.take(), "the foreign stream waits again")
	require.NoError(t, a.Deallocate(z1, n, fs))
	require.Equal(t, []string{"record e2 on F"}, f.take())

	// A frees again: its event must be recorded anew, and B waits for the new record.
	x2 := arenaAlloc(t, a, n, sa)
	require.Equal(t, []string{"wait A on e2"}, f.take(), "F freed there")
	require.NoError(t, a.Deallocate(x2, n, sa))
	require.NoError(t, a.Deallocate(y1, n, sb))
	require.NoError(t, a.Deallocate(y2, n, sb))
	require.Empty(t, f.take())
	w := arenaAlloc(t, a, 8*n, DefaultStream)
	require.ElementsMatch(t, []string{"record e1 on A, wait default", "wait default on e2", "create e3", "record e3 on B, wait default"}, f.take())
	require.NoError(t, a.Deallocate(w, 8*n, DefaultStream))
	w = arenaAlloc(t, a, 8*n, sb)
	require.ElementsMatch(t, []string{"create e4", "record e4 on default, wait B", "wait B on e1", "wait B on e2"}, f.take(),
		"A's event was recorded again since B waited: B waits for it again")
	require.NoError(t, a.Deallocate(w, 8*n, sb))
	arenaCheck(t, a)
}

// The streams remembered as waiting are at most arenaWaitedMax; the oldest gives way, and then
// waits again (a redundant wait, not a missing one).
func TestArenaWaitedRing(t *testing.T) {
	var x arenaStream
	views := make([]StreamView, arenaWaitedMax+1)
	for i := range views {
		views[i] = StreamView{id: ownedStreamBit | uint64(i+1)}
		x.noteWaited(views[i])
	}
	require.False(t, x.hasWaited(views[0].id), "the oldest gave way")
	for _, v := range views[1:] {
		require.True(t, x.hasWaited(v.id))
	}
	x.noteWaited(DefaultStream)
	require.True(t, x.hasWaited(DefaultStream.id))
	require.False(t, x.hasWaited(views[1].id))
	x.noteWaited(StreamView{id: foreignStreamBit | 9})
	require.False(t, x.hasWaited(foreignStreamBit|9), "foreign streams are not remembered")
	x.recorded()
	for _, v := range views {
		require.False(t, x.hasWaited(v.id))
	}
}

// The fake reports a call naming a destroyed stream, with the call.
func TestArenaSyncFakeReportsDestroyedStream(t *testing.T) {
	f := newArenaSyncFake(nil) // no model: the calls only logged
	f.names[0x51] = "S"
	d := f.driver()
	require.NoError(t, d.streamSynchronize(1, 0x51))
	require.Empty(t, f.errors())
	f.kill(0x51)
	require.NoError(t, d.recordAndWait(1, 0x1001, 0x51, cuStreamLegacy))
	require.NoError(t, d.streamSynchronize(1, cuStreamLegacy))
	require.Equal(t, []string{"a call names the destroyed stream S: record e1 on S, wait default"}, f.errors())
}
