package rmm

import (
	"cmp"
	"slices"
	"sync"
)

// StreamStatistics are the figures of one stream in a [StreamStatisticsResourceAdaptor]: the
// allocations made on [StreamStatistics.Stream], with their current, peak and total bytes and counts.
type StreamStatistics struct {
	Stream StreamView
	Statistics
}

// streamRecord is what a StreamStatisticsResourceAdaptor keeps per live allocation: the stream it
// was charged to and the size it was charged.
type streamRecord struct {
	stream StreamView
	size   int
}

// StreamStatisticsResourceAdaptor forwards every call to its upstream and counts the allocations
// made through it stream by stream: for each stream, the bytes and allocations live now, their
// peaks and their totals ([Statistics]), so that a program running work on several streams can see
// which stream's work holds its memory. [StatisticsResourceAdaptor] gives the same figures for all
// streams together.
//
//   - Allocate calls the upstream first; when it succeeds the allocation is charged to the stream
//     it was made on: nbytes (as asked, not rounded) and one allocation, each peak following its
//     value. Zero-byte allocations are not counted (they hold no memory, and their null pointer
//     cannot be told apart). A failed allocation changes nothing.
//   - Deallocate takes the allocation off the stream it was allocated on, whatever stream the free
//     is made on (a block handed to another stream with an [Event] and freed there, as
//     [Uvector.SetStream] before Close does, still leaves its own stream), and with the size it was
//     charged; the size given is passed to the upstream as it is. The record is dropped before
//     the upstream is called, so that an address the upstream hands out again at once is never
//     counted twice, and put back when the upstream returns an error (the memory is still
//     allocated). A pointer the adaptor did not hand out (or already took back) is passed to the
//     upstream and counts nothing. So no stream's current figures go negative.
//   - Memory freed behind the adaptor's back (through its upstream directly) stays counted until
//     its address is handed out through the adaptor again: the old record is then dropped, as a
//     free on its stream, and the new allocation charged.
//
// A view of a [Stream] that was closed is a stream like any other here: it keeps its figures, and
// allocations still live on it stay charged to it (the resources under the adaptor treat frees on
// it as frees on [DefaultStream]). The adaptor keeps one entry per stream it has seen, for its life,
// and one record per live allocation, as [TrackingResourceAdaptor] does.
//
// Safe for concurrent use: the records and counters are kept under one mutex, never held across a
// call to the upstream. Nothing is allocated per call beyond the growth of the record map and an
// entry for each new stream.
type StreamStatisticsResourceAdaptor struct {
	upstream MemoryResource

	mu      sync.Mutex
	live    map[DevicePtr]streamRecord
	streams map[StreamView]*statLevel
}

// NewStreamStatisticsResourceAdaptor returns an adaptor that counts, stream by stream, the
// allocations made through it from upstream. A nil upstream means the current device resource
// ([CurrentDeviceResource], read once, here); a nil pointer as upstream returns an error wrapping
// [ErrInvalidArgument].
func NewStreamStatisticsResourceAdaptor(upstream MemoryResource) (*StreamStatisticsResourceAdaptor, error) {
	up, err := upstreamOf("NewStreamStatisticsResourceAdaptor", upstream)
	if err != nil {
		return nil, err
	}
	return &StreamStatisticsResourceAdaptor{
		upstream: up,
		live:     map[DevicePtr]streamRecord{},
		streams:  map[StreamView]*statLevel{},
	}, nil
}

// level returns the counters of stream s, making them on first use. r.mu must be held.
func (r *StreamStatisticsResourceAdaptor) level(s StreamView) *statLevel {
	l := r.streams[s]
	if l == nil {
		l = &statLevel{}
		r.streams[s] = l
	}
	return l
}

// Allocate allocates nbytes from the upstream on stream s and charges the allocation to s (see
// the type's comment). A negative size returns an error wrapping [ErrInvalidArgument] without
// calling the upstream; the upstream's errors are returned unchanged.
func (r *StreamStatisticsResourceAdaptor) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes < 0 {
		return 0, invalidSize("StreamStatisticsResourceAdaptor", "Allocate", nbytes)
	}
	p, err := r.upstream.Allocate(nbytes, s)
	if err != nil || nbytes == 0 || p == 0 {
		return p, err
	}
	r.mu.Lock()
	if old, ok := r.live[p]; ok {
		// Freed behind the adaptor's back: that allocation is gone.
		r.streams[old.stream].sub(int64(old.size))
	}
	r.live[p] = streamRecord{stream: s, size: nbytes}
	r.level(s).add(int64(nbytes))
	r.mu.Unlock()
	return p, nil
}

// Deallocate takes p off the stream it was allocated on and returns it to the upstream on stream
// s (see the type's comment). A negative size returns an error wrapping [ErrInvalidArgument] and
// changes nothing; the upstream's error is returned, and the allocation then stays counted.
func (r *StreamStatisticsResourceAdaptor) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if nbytes < 0 {
		return invalidSize("StreamStatisticsResourceAdaptor", "Deallocate", nbytes)
	}
	if p == 0 {
		return r.upstream.Deallocate(p, nbytes, s)
	}
	r.mu.Lock()
	rec, found := r.live[p]
	if found {
		delete(r.live, p)
		r.streams[rec.stream].sub(int64(rec.size))
	}
	r.mu.Unlock()
	if err := r.upstream.Deallocate(p, nbytes, s); err != nil {
		if found {
			r.mu.Lock()
			if _, taken := r.live[p]; !taken {
				r.live[p] = rec
				r.streams[rec.stream].restore(int64(rec.size))
			}
			r.mu.Unlock()
		}
		return err
	}
	return nil
}

// StreamStats returns the figures of stream s: all zero for a stream the adaptor has not seen.
func (r *StreamStatisticsResourceAdaptor) StreamStats(s StreamView) Statistics {
	r.mu.Lock()
	defer r.mu.Unlock()
	if l := r.streams[s]; l != nil {
		return l.stats()
	}
	return Statistics{}
}

// ByStream returns the figures of every stream the adaptor has seen, by ascending [StreamView.ID]
// ([DefaultStream] first). The slice is a copy the caller owns.
func (r *StreamStatisticsResourceAdaptor) ByStream() []StreamStatistics {
	r.mu.Lock()
	out := make([]StreamStatistics, 0, len(r.streams))
	for s, l := range r.streams {
		out = append(out, StreamStatistics{Stream: s, Statistics: l.stats()})
	}
	r.mu.Unlock()
	slices.SortFunc(out, func(a, b StreamStatistics) int {
		if c := cmp.Compare(a.Stream.ID(), b.Stream.ID()); c != 0 {
			return c
		}
		// Views of one stream from different devices' DefaultStream.
		return cmp.Compare(a.Stream.dev1, b.Stream.dev1)
	})
	return out
}

// Upstream returns the resource the adaptor forwards to.
func (r *StreamStatisticsResourceAdaptor) Upstream() MemoryResource { return r.upstream }

func (*StreamStatisticsResourceAdaptor) insideUpstream() {}

func (*StreamStatisticsResourceAdaptor) passesPointersThrough() {}

// Access reports the upstream's accessibility ([AccessOf](Upstream())).
func (r *StreamStatisticsResourceAdaptor) Access() Access { return AccessOf(r.upstream) }

// Device returns the upstream's device ([DeviceOf](Upstream())).
func (r *StreamStatisticsResourceAdaptor) Device() Device { return DeviceOf(r.upstream) }
