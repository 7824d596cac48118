package rmm

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"testing"

	"github.com/stretchr/testify/require"
)

// minstd0 is the "minimal standard" generator minstd_rand0: x ← 16807·x mod (2³¹−1), first state
// 1; outputs lie in [1, 2³¹−2].
type minstd0 struct{ x uint64 }

const (
	minstdMod   = 1<<31 - 1
	minstdMin   = 1
	minstdRange = minstdMod - 1 - minstdMin // max − min = 2³¹−3
)

func (g *minstd0) next() uint64 {
	g.x = g.x * 16807 % minstdMod
	return g.x
}

// uniform draws from [a, b] the way libstdc++'s uniform_int_distribution does over minstd0:
// downscaling by division with rejection when the range is smaller than the generator's,
// upscaling by composing draws when it is larger.
func (g *minstd0) uniform(a, b uint64) uint64 {
	r := b - a
	switch {
	case r < minstdRange:
		erange := r + 1
		scaling := minstdRange / erange
		past := erange * scaling
		for {
			u := g.next() - minstdMin
			if u < past {
				return a + u/scaling
			}
		}
	case r > minstdRange:
		const erng = minstdRange + 1
		for {
			t := erng * g.uniform(0, r/erng)
			u := t + (g.next() - minstdMin)
			if u <= r && u >= t {
				return a + u
			}
		}
	default:
		return a + g.next() - minstdMin
	}
}

// w2Step is one step of RMM's random_allocations workload: an allocation of size, or a free of
// the live allocation at index.
type w2Step struct {
	alloc bool
	size  int // the size drawn at this step (allocated, or not, for a free)
	index int // for a free: position in the live list (after the modulo)
	drawn int // for a free: the value drawn before the modulo
}

// w2Run drives RMM's random_allocations benchmark loop, replicated draw for draw: n allocations at
// most, sizes uniform in [1, maxMiB MiB], 73% allocation probability, live bytes capped below
// 16000 MiB, a random victim on free (swap-removed from the live list). allocate is called for
// each allocation and returns false on failure (the step then falls through to a free); free is
// called with the live-list index of the victim. With record it returns the steps taken.
func w2Run(n, maxMiB int, record bool, allocate func(size int) bool, free func(index int)) []w2Step {
	g := &minstd0{x: 1}
	const maxUsage = 16000 << 20
	var sizes []int // live sizes, in the live-list order
	liveBytes := 0
	made := 0
	var steps []w2Step
	for i := 0; i < 2*n; i++ {
		size := int(g.uniform(1, uint64(maxMiB)<<20))
		doAlloc := true
		if len(sizes) > 0 {
			chance := g.uniform(0, 99)
			doAlloc = chance < 73 && made < n && liveBytes+size < maxUsage
		}
		if doAlloc {
			if allocate(size) {
				sizes = append(sizes, size)
				liveBytes += size
				made++
				if record {
					steps = append(steps, w2Step{alloc: true, size: size})
				}
				continue
			}
		}
		if len(sizes) > 0 {
			drawn := g.uniform(0, uint64(n-1))
			idx := int(drawn % uint64(len(sizes)))
			free(idx)
			liveBytes -= sizes[idx]
			sizes[idx] = sizes[len(sizes)-1]
			sizes = sizes[:len(sizes)-1]
			if record {
				steps = append(steps, w2Step{index: idx, drawn: int(drawn), size: size})
			}
		}
	}
	return steps
}

// The generator reproduces librmm's draws: the first sizes of each W2 cell, which exercise both
// the downscaling and the upscaling (4096 MiB) paths of the distribution, and the op draws
// between them.
func TestW2GeneratorDraws(t *testing.T) {
	for _, c := range []struct {
		n, maxMiB int
		first     []int
	}{
		{1000, 4096, []int{282475249, 2617694918, 3931968138, 1137522503, 823378840, 3622316815}},
		{10000, 64, []int{543, 9112105, 36906740, 15168106, 47027448, 64749604}},
		{100000, 1, []int{9, 137995, 558920, 229708, 712189, 980576}},
	} {
		steps := w2Run(c.n, c.maxMiB, true, func(int) bool { return true }, func(int) {})
		var first []int // the size drawn at each of the first steps
		for _, s := range steps[:len(c.first)] {
			first = append(first, s.size)
		}
		require.Equal(t, c.first, first, "N=%d max=%d MiB", c.n, c.maxMiB)
		allocs, frees := 0, 0
		for _, s := range steps {
			if s.alloc {
				allocs++
			} else {
				frees++
			}
		}
		require.Equal(t, c.n, allocs, "every allocation is made")
		require.Equal(t, c.n, frees, "and freed within the loop")
	}
}

// w2Digest is the FNV-1a-64 digest of a W2 run's events, each two little-endian 8-byte words:
// (1, size) for an allocation, (2, live-list index) for a free.
func w2Digest(steps []w2Step) string {
	h := fnv.New64a()
	var w [16]byte
	for _, s := range steps {
		if s.alloc {
			binary.LittleEndian.PutUint64(w[:8], 1)
			binary.LittleEndian.PutUint64(w[8:], uint64(s.size))
		} else {
			binary.LittleEndian.PutUint64(w[:8], 2)
			binary.LittleEndian.PutUint64(w[8:], uint64(s.index))
		}
		h.Write(w[:])
	}
	return fmt.Sprintf("%016x", h.Sum64())
}

// The whole run matches libstdc++: the digests are what testdata/w2/oracle.cpp prints, which
// runs librmm's loop over std::default_random_engine and std::uniform_int_distribution
// themselves (g++ 12, libstdc++). Every size, every allocate/free decision and every victim index
// of the 2N steps enters the digest.
//
// benchmarks.md lists other digests for the same encoding (ec47a7901b106e1c, 4e7e60fe8019415b,
// ba19c57a1811392e); neither this generator nor libstdc++'s, under any of the readings tried
// (byte- or word-wise FNV, index before or after the modulo, erase instead of swap-remove), gives
// them, while the first sizes listed beside them agree.
func TestW2GeneratorDigests(t *testing.T) {
	for _, c := range []struct {
		n, maxMiB int
		digest    string
	}{
		{1000, 4096, "f33f6e239df3e016"},
		{10000, 64, "2119a34529e2f11d"},
		{100000, 1, "e20b4cec1688e184"},
	} {
		steps := w2Run(c.n, c.maxMiB, true, func(int) bool { return true }, func(int) {})
		require.Len(t, steps, 2*c.n)
		require.Equal(t, c.digest, w2Digest(steps), "N=%d max=%d MiB", c.n, c.maxMiB)
	}
}
