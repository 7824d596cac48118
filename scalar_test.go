package rmm

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestScalar(t *testing.T) {
	mr := newTestResource()
	s1, s2 := newHostStream(t), newHostStream(t)
	c, err := NewScalar[triple](s1, mr)
	require.NoError(t, err)
	assert.NotZero(t, c.Data())
	assert.Equal(t, s1, c.Stream())
	assert.Same(t, mr, c.MemoryResource())
	assert.Equal(t, CurrentDevice(), c.Device())
	assert.Equal(t, 12, mr.liveBytes(), "one element of 12 bytes")
	assert.Equal(t, 1, c.Span().Len())
	assert.Equal(t, c.Data(), c.Span().Data())

	require.NoError(t, c.SetValue(triple{4, -5, 6}, s1))
	v, err := c.Value(s1)
	require.NoError(t, err)
	assert.Equal(t, triple{4, -5, 6}, v)
	require.NoError(t, c.SetValueToZero(s1))
	v, err = c.Value(s1)
	require.NoError(t, err)
	assert.Equal(t, triple{}, v)

	c.SetStream(s2)
	assert.Equal(t, s2, c.Stream())
	require.NoError(t, c.Close())
	assert.Equal(t, s2, mr.lastFreeS)
	assert.Zero(t, mr.liveBytes())
	require.NoError(t, c.Close())
	assert.Zero(t, c.Data())
	for name, err := range map[string]error{
		"Value":          func() error { _, err := c.Value(s1); return err }(),
		"SetValue":       c.SetValue(triple{}, s1),
		"SetValueToZero": c.SetValueToZero(s1),
		"Copy":           func() error { _, err := c.Copy(s1, nil); return err }(),
	} {
		require.ErrorIs(t, err, ErrClosed, name)
		assert.Contains(t, err.Error(), "Scalar[rmm.triple]."+name, name)
	}
}

func TestScalarWithValueAndCopy(t *testing.T) {
	mr1, mr2 := newTestResource(), newTestResource()
	negZero := math.Copysign(0, -1)
	c, err := NewScalarWithValue(negZero, DefaultStream, mr1)
	require.NoError(t, err)
	defer c.Close()
	v, err := c.Value(DefaultStream)
	require.NoError(t, err)
	assert.True(t, math.Signbit(v), "-0.0 survives the round trip")

	require.NoError(t, c.SetValue(2.75, DefaultStream))
	d, err := c.Copy(DefaultStream, mr2)
	require.NoError(t, err)
	assert.Same(t, mr2, d.MemoryResource())
	assert.NotEqual(t, c.Data(), d.Data())
	require.NoError(t, c.SetValue(-1, DefaultStream))
	got, err := d.Value(DefaultStream)
	require.NoError(t, err)
	assert.Equal(t, 2.75, got, "the copy is independent")
	require.NoError(t, d.Close())
	assert.Zero(t, mr2.liveBytes())

	mr1.setFailNext(1)
	_, err = NewScalarWithValue(1.0, DefaultStream, mr1)
	require.ErrorIs(t, err, ErrOutOfMemory)
	assert.Contains(t, err.Error(), "NewScalarWithValue[float64]")
	assert.Equal(t, 8, mr1.liveBytes(), "only c is live")

	sim, _ := NewSimulatedMemoryResource(1 << 20)
	_, err = NewScalarWithValue(1.0, DefaultStream, sim)
	require.ErrorIs(t, err, ErrNotSupported)
	assert.Zero(t, sim.UsedBytes(), "a failed set frees the allocation")
}

// A nil *Scalar reads as an empty one (no memory, the default stream), closes with nil, and
// every call that can fail returns ErrInvalidArgument naming the nil scalar.
func TestScalarNil(t *testing.T) {
	var c *Scalar[float64]
	require.Zero(t, c.Data())
	require.Equal(t, DeviceSpan[float64]{}, c.Span())
	require.Equal(t, DefaultStream, c.Stream())
	require.Nil(t, c.MemoryResource())
	require.Zero(t, c.Device())
	s := newHostStream(t)
	c.SetStream(s)
	require.Equal(t, DefaultStream, c.Stream())
	require.NoError(t, c.Close())
	mr := newTestResource()
	requireNilErr(t, "Scalar[float64]", map[string]func() error{
		"Copy":           func() error { x, err := c.Copy(s, mr); require.Nil(t, x); return err },
		"Value":          func() error { _, err := c.Value(s); return err },
		"SetValue":       func() error { return c.SetValue(1.5, s) },
		"SetValueToZero": func() error { return c.SetValueToZero(s) },
	})
	require.Zero(t, mr.liveBytes())
}
