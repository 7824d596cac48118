package rmmtest

import (
	"fmt"
	"math/rand"
	randv2 "math/rand/v2"
	"testing"

	"github.com/gormm/rmm"
)

// Configuration is one configuration of a resource for RunConfigurations: how to build it, and
// what it promises.
type Configuration struct {
	// Name describes the configuration in failure reports, e.g. "initial 1 MiB, maximum 4 MiB".
	Name string

	// NewResource builds the resource over upstream, as Run's newResource does.
	NewResource func(t *testing.T, upstream rmm.MemoryResource) rmm.MemoryResource

	// Options declares what the resource promises in this configuration, as Run's options do.
	// Its Sequences, MaxCommands and Seed are not used: RunConfigurations' options give them.
	Options Options
}

// Coverage is what the random sequences of RunConfigurations exercised, for a test to check
// that its configurations still reach the paths it is about.
type Coverage struct {
	Sequences        int // sequences run, shrinking included
	Allocations      int // allocations of a non-zero size that succeeded
	OutOfMemory      int // allocations that failed with rmm.ErrOutOfMemory, BeyondCapacity included
	BeyondCapacity   int // requests for more than was left of Options.Capacity
	CrossStreamFrees int // frees on another stream than the allocating one
	InvalidFrees     int // invalid frees attempted (Options.DetectsInvalidFree)
	Releases         int // calls of Release

	// ReleasesToNothing counts the Releases after which nothing was live and the resource held
	// nothing from the upstream and mapped nothing.
	ReleasesToNothing int

	// UpstreamRefusals counts the requests the upstream refused, UpstreamRetries the requests it
	// granted right after refusing a larger one (a resource that backs off to a smaller size).
	UpstreamRefusals, UpstreamRetries int
}

// RunConfigurations runs the state machine of Run (its StateMachine check, as a sub-test of t of
// that name) over a resource whose configuration changes from one random sequence to the next:
// for every sequence, draw returns a Configuration drawn from r, whose NewResource builds the
// sequence's resource and whose Options declare what that resource promises. A failure report
// names the configuration of the shrunk sequence. It returns what the sequences exercised; when
// the state machine fails, it ends the test instead (t.FailNow).
//
// r is derived from the seed, so that a replay draws the same configurations: draw must depend
// on r alone, and must not build anything (it is called again whenever a sequence is replayed
// while shrinking). A configuration is not shrunk, only the commands run against it.
//
// opts gives what is common to the run: Sequences, MaxCommands and Seed (and the environment
// variables that override them); nil means the defaults. Its other fields are not used.
//
// The fixed checks of Run do not run: run Run over a few fixed configurations for those.
func RunConfigurations(t *testing.T, draw func(r *randv2.Rand) Configuration, opts *Options) Coverage {
	t.Helper()
	run, err := resolve(opts)
	if err != nil {
		t.Fatal(err)
	}
	var cov Coverage
	if !(testT{t}).Run("StateMachine", func(tb tester) { cov = runConfigurations(tb, draw, run) }) {
		t.FailNow() // what the sequences exercised means nothing after a failure
	}
	return cov
}

// runConfigurations is RunConfigurations on any tester.
func runConfigurations(t tester, draw func(r *randv2.Rand) Configuration, run *config) Coverage {
	t.Logf("rmmtest: seed %d (replay with %s=%d)", run.seed, SeedEnv, run.seed)
	next := func(r *rand.Rand) (*smSeq, error) {
		// A *rand.Rand is a math/rand/v2 Source: its Uint64 draws from the sequence's source.
		conf := draw(randv2.New(r))
		if conf.NewResource == nil {
			return nil, fmt.Errorf("rmmtest: configuration %q has no NewResource", conf.Name)
		}
		c, err := resolve(&conf.Options)
		if err != nil {
			return nil, fmt.Errorf("configuration %q: %w", conf.Name, err)
		}
		c.seed, c.scale, c.sequences, c.maxCommands = run.seed, run.scale, run.sequences, run.maxCommands
		build := conf.NewResource
		s := &suite{cfg: c, build: func(t tester, up rmm.MemoryResource) rmm.MemoryResource {
			tt, ok := t.(testT)
			if !ok {
				return build(nil, up)
			}
			return build(tt.T, up)
		}}
		return &smSeq{s: s, name: conf.Name, views: 1 + c.streams}, nil
	}
	// A probe's configuration, drawn from a source of its own: whether the options resolve, and
	// whether a resource can be built and torn down. Configurations may differ in being
	// rmm.Releasers: Release is drawn for every one, and does nothing where there is none.
	probe, err := next(rand.New(rand.NewSource(run.seed)))
	if err != nil {
		t.Fatalf("%v", err)
	}
	return runMachine(t, run, func(r *rand.Rand) *smSeq {
		q, err := next(r)
		if err != nil {
			panic(err) // gopter reports it with the seed
		}
		return q
	}, probe.s, true)
}
