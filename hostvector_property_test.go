package rmm

import (
	"fmt"
	"slices"
	"testing"

	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/commands"
	"github.com/leanovate/gopter/gen"
)

// State machine test of HostVector against a model: a host vector and a device vector of
// hostPropDevLen elements (on the current device resource: the GPU where there is one, host
// memory elsewhere) are driven by random Resize, Set, Fill (device), CopyToDeviceAsync and
// CopyFromDeviceAsync (of a prefix span) commands; after every step the host vector's elements
// (read with Slice, which waits for copies in flight), its length and capacity, and the device
// vector's elements must equal the model's. On a GPU the copies are really asynchronous, so the
// test also checks that host access waits and that copies are ordered. Replay with
// RMM_PROPERTY_SEED as the other property tests.

const hostPropDevLen = 48

type hostPropState struct {
	host []int32
	cap  int
	dev  []int32
}

type hostPropSUT struct {
	h *HostVector[int32]
	d *Uvector[int32]
	s StreamView
}

type hostPropResult struct {
	host, dev []int32
	n, c      int
	err       error
}

func (st *hostPropState) clone() *hostPropState {
	return &hostPropState{host: slices.Clone(st.host), cap: st.cap, dev: slices.Clone(st.dev)}
}

func hostPropObserve(sut *hostPropSUT, err error) hostPropResult {
	r := hostPropResult{n: sut.h.Len(), c: sut.h.Cap(), err: err}
	if err != nil {
		return r
	}
	hs, err := sut.h.Slice()
	if err != nil {
		r.err = err
		return r
	}
	r.host = slices.Clone(hs)
	r.dev, r.err = sut.d.ToSlice(sut.s)
	return r
}

// hostPropCmd is one command: run it on the vectors, apply it to the model.
type hostPropCmd struct {
	name  string
	pre   func(*hostPropState) bool
	run   func(*hostPropSUT) error
	apply func(*hostPropState)
}

func (c *hostPropCmd) String() string { return c.name }

func (c *hostPropCmd) Run(sut commands.SystemUnderTest) commands.Result {
	s := sut.(*hostPropSUT)
	return hostPropObserve(s, c.run(s))
}

func (c *hostPropCmd) NextState(state commands.State) commands.State {
	st := state.(*hostPropState).clone()
	c.apply(st)
	return st
}

func (c *hostPropCmd) PreCondition(state commands.State) bool {
	return c.pre == nil || c.pre(state.(*hostPropState))
}

func (c *hostPropCmd) PostCondition(state commands.State, result commands.Result) *gopter.PropResult {
	st := state.(*hostPropState)
	r := result.(hostPropResult)
	switch {
	case r.err != nil:
		return &gopter.PropResult{Status: gopter.PropError, Error: r.err}
	case r.n != len(st.host) || r.c != st.cap:
		return gopter.NewPropResult(false, fmt.Sprintf("Len/Cap %d/%d, model %d/%d", r.n, r.c, len(st.host), st.cap))
	case !slices.Equal(r.host, st.host):
		return gopter.NewPropResult(false, fmt.Sprintf("host %v, model %v", r.host, st.host))
	case !slices.Equal(r.dev, st.dev):
		return gopter.NewPropResult(false, fmt.Sprintf("device %v, model %v", r.dev, st.dev))
	}
	return gopter.NewPropResult(true, "")
}

func hostPropResize(n int) commands.Command {
	return &hostPropCmd{
		name: fmt.Sprintf("Resize(%d)", n),
		run:  func(s *hostPropSUT) error { return s.h.Resize(n) },
		apply: func(st *hostPropState) {
			if n <= len(st.host) {
				st.host = st.host[:n]
			} else {
				st.host = append(st.host, make([]int32, n-len(st.host))...)
			}
			st.cap = max(st.cap, n)
		},
	}
}

func hostPropSet(i int, v int32) commands.Command {
	return &hostPropCmd{
		name:  fmt.Sprintf("Set(%d, %d)", i, v),
		pre:   func(st *hostPropState) bool { return i < len(st.host) },
		run:   func(s *hostPropSUT) error { return s.h.Set(i, v) },
		apply: func(st *hostPropState) { st.host[i] = v },
	}
}

func hostPropFill(v int32) commands.Command {
	return &hostPropCmd{
		name: fmt.Sprintf("FillDevice(%d)", v),
		run:  func(s *hostPropSUT) error { return s.d.Fill(v, s.s) },
		apply: func(st *hostPropState) {
			for i := range st.dev {
				st.dev[i] = v
			}
		},
	}
}

func hostPropToDevice() commands.Command {
	return &hostPropCmd{
		name:  "CopyToDeviceAsync",
		pre:   func(st *hostPropState) bool { return len(st.host) <= hostPropDevLen },
		run:   func(s *hostPropSUT) error { return s.h.CopyToDeviceAsync(s.d, s.s) },
		apply: func(st *hostPropState) { copy(st.dev, st.host) },
	}
}

func hostPropFromDevice(k int) commands.Command {
	return &hostPropCmd{
		name: fmt.Sprintf("CopyFromDeviceAsync(first %d)", k),
		pre:  func(st *hostPropState) bool { return k <= len(st.host) },
		run: func(s *hostPropSUT) error {
			sp, err := s.d.Span().Subspan(0, k)
			if err != nil {
				return err
			}
			return s.h.CopyFromDeviceAsync(sp, s.s)
		},
		apply: func(st *hostPropState) { copy(st.host[:k], st.dev[:k]) },
	}
}

func TestHostVectorProperty(t *testing.T) {
	seed := propertySeed(t)
	t.Logf("seed %d (replay with RMM_PROPERTY_SEED=%d)", seed, seed)
	params := gopter.DefaultTestParametersWithSeed(seed)
	params.MinSuccessfulTests = 150 * propertyScale(t)
	params.MaxSize = 40
	cmds := &commands.ProtoCommands{
		NewSystemUnderTestFunc: func(initial commands.State) commands.SystemUnderTest {
			h, err := NewHostVector[int32](0, nil)
			if err != nil {
				panic(err)
			}
			d, err := NewUvector[int32](hostPropDevLen, DefaultStream, nil)
			if err != nil {
				panic(err)
			}
			if err := d.Fill(0, DefaultStream); err != nil {
				panic(err)
			}
			return &hostPropSUT{h: h, d: d, s: DefaultStream}
		},
		DestroySystemUnderTestFunc: func(sut commands.SystemUnderTest) {
			s := sut.(*hostPropSUT)
			s.h.Close()
			s.d.Close()
		},
		InitialStateGen: gen.Const(&hostPropState{dev: make([]int32, hostPropDevLen)}),
		GenCommandFunc: func(state commands.State) gopter.Gen {
			n := len(state.(*hostPropState).host)
			gens := []gopter.Gen{
				gen.IntRange(0, hostPropDevLen+8).Map(func(k int) commands.Command { return hostPropResize(k) }),
				gen.Int32Range(-1000, 1000).Map(func(v int32) commands.Command { return hostPropFill(v) }),
				gen.Const(hostPropToDevice()),
			}
			if n > 0 {
				gens = append(gens,
					gopter.CombineGens(gen.IntRange(0, n-1), gen.Int32Range(-1000, 1000)).Map(func(v []interface{}) commands.Command {
						return hostPropSet(v[0].(int), v[1].(int32))
					}),
					gen.IntRange(0, min(n, hostPropDevLen)).Map(func(k int) commands.Command { return hostPropFromDevice(k) }),
				)
			}
			return gen.OneGenOf(gens...)
		},
	}
	runCommandsProperty(t, seed, params, "HostVector against a model", cmds)
}
