// Package workload generates synthetic allocation logs, as RMM CSV events ([rmm.LogEvent]), for
// workloads that run far longer than the bundled traces: long enough to show whether a pool's
// footprint stays flat or creeps up when the shapes it is asked for never quite repeat.
//
// [NewServing] models a decoder-only language-model service on one GPU, as PyTorch's eager mode
// would ask its allocator for tensors: the weights, allocated once and kept; then requests, each
// a prefill pass over its prompt and decode steps that grow its key/value cache, a few in flight
// at once; now and then a large one-off batch. Every shape comes from continuous, heavy-tailed
// draws, so that no two requests ask for quite the same sizes. The same configuration (seed
// included) always gives the same events.
package workload

import (
	"errors"
	"fmt"
	"iter"
	"math"
	"math/rand/v2"
	"time"

	"github.com/gormm/rmm"
)

// ServingConfig configures [NewServing]. Zero fields take the defaults given with each.
type ServingConfig struct {
	// Seed seeds every random draw: equal configurations give equal events.
	Seed int64
	// Events is the least number of events to generate (default 1,000,000). Once as many were
	// made, at the end of the step under way, the requests still in flight are dropped (their caches
	// freed) and then the weights are freed, so the log ends with nothing live and holds a few
	// more events than this.
	Events int
	// Layers is the number of transformer blocks (default 16).
	Layers int
	// Hidden is the model width: a multiple of 128, the head size (default 3072, so 24 heads).
	// The MLP is 4×Hidden wide.
	Hidden int
	// Vocab is the vocabulary size, the width of the logits (default 50304).
	Vocab int
	// MaxInFlight is the most requests in flight at once (default 4). How many are wanted is
	// drawn again, from 1 to MaxInFlight, each time a request ends; decode steps go round the
	// requests in flight, one token each.
	MaxInFlight int
	// MaxContext caps a request's prompt plus generated tokens (default 4096).
	MaxContext int
	// KVBlock is the number of tokens by which a request's key/value cache grows (default 1): it
	// holds a multiple of KVBlock tokens, and when full each layer's keys and values are
	// allocated at the next multiple, copied and the old ones freed, as torch.cat does at every
	// decode step with the default.
	KVBlock int
	// SideStream is the fraction of requests served on a second stream, handle 0x1 (default 0:
	// all on the default stream 0).
	SideStream float64
	// OneOffs is the fraction of arrivals that are a large one-off batch instead of a request:
	// an embedding job of up to four times a request's tokens, one pass through the layers
	// without a cache, whose pooled output stays live until the next request ends (default
	// 0.02; negative for none).
	OneOffs float64
}

// The defaults of ServingConfig, and the fixed parts of the model.
const (
	defaultEvents      = 1_000_000
	defaultLayers      = 16
	defaultHidden      = 3072
	defaultVocab       = 50304
	defaultMaxInFlight = 4
	defaultMaxContext  = 4096
	defaultOneOffs     = 0.02

	headSize = 128 // elements of one head of one token (fp16)
	// maxBatchTokens caps batch × prompt of a request: a server splits larger prefills. Eager
	// attention's scores grow with batch × prompt², so this also bounds the largest transient.
	maxBatchTokens = 16384
	// maxBatch caps a request's batch.
	maxBatch = 32
	// maxNewTokens caps the tokens a request generates.
	maxNewTokens = 1024
	// sideStream is the handle of the second stream.
	sideStream = 0x1
	// base is the first address handed out: addresses only grow (a replay maps them to its own).
	base = 0x7f0000000000
	// maxTime is the latest time of day the log can write.
	maxTime = 24*time.Hour - time.Microsecond
)

// maxBytes bounds the weights and the largest tensor of a configuration: 1 PiB.
const maxBytes = 1 << 50

// ErrConfig is wrapped by the error of a configuration [NewServing] cannot use.
var ErrConfig = errors.New("workload: bad configuration")

func configError(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrConfig, fmt.Sprintf(format, a...))
}

// withDefaults returns c with the defaults filled in, or an error for a field out of range.
func (c ServingConfig) withDefaults() (ServingConfig, error) {
	def := func(p *int, name string, d int) error {
		if *p < 0 {
			return configError("%s %d is negative", name, *p)
		}
		if *p == 0 {
			*p = d
		}
		return nil
	}
	for _, f := range []struct {
		p    *int
		name string
		d    int
	}{
		{&c.Events, "Events", defaultEvents},
		{&c.Layers, "Layers", defaultLayers},
		{&c.Hidden, "Hidden", defaultHidden},
		{&c.Vocab, "Vocab", defaultVocab},
		{&c.MaxInFlight, "MaxInFlight", defaultMaxInFlight},
		{&c.MaxContext, "MaxContext", defaultMaxContext},
		{&c.KVBlock, "KVBlock", 1},
	} {
		if err := def(f.p, f.name, f.d); err != nil {
			return c, err
		}
	}
	if c.Hidden%headSize != 0 {
		return c, configError("Hidden %d is not a multiple of the head size %d", c.Hidden, headSize)
	}
	if c.MaxContext < 2 {
		return c, configError("MaxContext %d leaves no room for a prompt and a token", c.MaxContext)
	}
	// The weights and the largest tensors (a batch of up to 32 sequences of MaxContext tokens
	// each, a row per token) must fit in memory that exists, so that no size or address
	// overflows.
	d := float64(c.Hidden)
	weights := 2 * (float64(c.Vocab)*d + float64(c.MaxContext)*d + float64(c.Layers)*(12*d*d+13*d) + 2*d)
	if weights > maxBytes || 32*float64(c.MaxContext)*max(d, float64(c.Vocab))*8 > maxBytes {
		return c, configError("the model (Hidden %d, Vocab %d, Layers %d, MaxContext %d) needs more than %d bytes", c.Hidden, c.Vocab, c.Layers, c.MaxContext, int64(maxBytes))
	}
	if !(c.SideStream >= 0 && c.SideStream <= 1) {
		return c, configError("SideStream %v is not a fraction in [0, 1]", c.SideStream)
	}
	switch {
	case c.OneOffs == 0:
		c.OneOffs = defaultOneOffs
	case c.OneOffs < 0:
		c.OneOffs = 0
	case !(c.OneOffs <= 1):
		return c, configError("OneOffs %v is not a fraction in [0, 1]", c.OneOffs)
	}
	return c, nil
}

// tensor is one live allocation.
type tensor struct {
	ptr    rmm.DevicePtr
	size   int
	stream uintptr
}

// request is a request in flight.
type request struct {
	batch     int
	newTokens int // tokens to generate, the first by the prefill
	generated int // tokens generated so far
	ctx       int // tokens in the cache
	kvCap     int // tokens the cache holds before it must grow
	stream    uintptr
	k, v      []tensor // per layer
	mask      tensor   // attention mask, one int64 per token of context
	next      tensor   // the token ids sampled last, the next step's input
}

// Generator yields the events of a serving workload, one at a time. It is not safe for
// concurrent use.
type Generator struct {
	cfg      ServingConfig
	rng      *rand.Rand
	now      time.Duration
	nextAddr rmm.DevicePtr
	emitted  int // events taken by Next
	buf      []rmm.LogEvent
	pos      int // next event of buf to return
	weights  []tensor
	inflight []*request
	turn     int // the request in flight whose decode step is next
	target   int // requests wanted in flight
	pooled   []tensor
	requests int
	oneOffs  int
	started  bool
	finished bool
	heads    int
	kvPerTok int // bytes of one token's keys (or values) in one layer of one sequence
	seqBytes int // bytes of one token's hidden state (fp16)
	stream   uintptr
	params   int // bytes of the weights
}

// NewServing returns a generator of the serving workload cfg describes, or an error wrapping
// [ErrConfig] for a field out of range.
//
// A request's lengths are drawn from log-normal distributions, rounded to whole tokens: its
// prompt around 300 tokens (a wide spread, up to MaxContext less the tokens it generates), the
// tokens it generates around 16 (up to 1024), its batch around 3 sequences (up to 32, and at
// most 16384 prompt tokens in all). A one-off batch has sequences of 8 to 512 tokens, up to
// 65536 tokens in all.
func NewServing(cfg ServingConfig) (*Generator, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	g := &Generator{
		cfg:      c,
		rng:      rand.New(rand.NewPCG(uint64(c.Seed), 0x9e3779b97f4a7c15)),
		nextAddr: base,
		heads:    c.Hidden / headSize,
		kvPerTok: c.Hidden * 2,
		seqBytes: c.Hidden * 2,
	}
	g.target = 1 + g.rng.IntN(c.MaxInFlight)
	return g, nil
}

// ServingEvents returns all the events of the workload cfg describes.
func ServingEvents(cfg ServingConfig) ([]rmm.LogEvent, error) {
	g, err := NewServing(cfg)
	if err != nil {
		return nil, err
	}
	events := make([]rmm.LogEvent, 0, g.cfg.Events+g.cfg.Events/50)
	for e := range g.All() {
		events = append(events, e)
	}
	return events, nil
}

// Config returns the configuration in use, defaults filled in.
func (g *Generator) Config() ServingConfig { return g.cfg }

// Requests returns the requests and the one-off batches begun so far.
func (g *Generator) Requests() (requests, oneOffs int) { return g.requests, g.oneOffs }

// Next returns the next event, or false after the last.
func (g *Generator) Next() (rmm.LogEvent, bool) {
	for g.pos == len(g.buf) {
		if g.finished {
			return rmm.LogEvent{}, false
		}
		g.buf, g.pos = g.buf[:0], 0
		g.step()
	}
	e := g.buf[g.pos]
	g.pos++
	g.emitted++
	return e, true
}

// All yields the remaining events.
func (g *Generator) All() iter.Seq[rmm.LogEvent] {
	return func(yield func(rmm.LogEvent) bool) {
		for {
			e, ok := g.Next()
			if !ok || !yield(e) {
				return
			}
		}
	}
}

// step appends the events of the next unit of work to g.buf: loading the weights, a request's
// prefill or decode step, a one-off batch, or, once enough events were made, the end.
func (g *Generator) step() {
	switch {
	case !g.started:
		g.started = true
		g.loadWeights()
	case g.emitted+len(g.buf) >= g.cfg.Events:
		g.end()
	case len(g.inflight) < g.target:
		g.pause(time.Duration(20+g.rng.IntN(400)) * time.Microsecond) // the next arrival
		if g.rng.Float64() < g.cfg.OneOffs {
			g.oneOff()
		} else {
			g.admit()
		}
	default:
		g.turn %= len(g.inflight)
		r := g.inflight[g.turn]
		g.decode(r)
		if r.generated == r.newTokens {
			g.finish(g.turn)
		} else {
			g.turn++
		}
	}
}

// pause advances the clock by d, never past the last time of day the log can write.
func (g *Generator) pause(d time.Duration) {
	g.now = min(g.now+d, maxTime)
}

// The device the time column models: what a pass costs when the host waits for it.
const (
	flops     = 4e14 // fp16 operations per second
	bandwidth = 3e12 // bytes per second of device memory
)

// gpu advances the clock by the time a pass over tokens tokens that reads cache bytes of
// key/value cache takes on the device: the host waits for it where it samples. A pass reads every
// weight once and does about two operations per weight and token, as many as the weights' fp16
// bytes.
func (g *Generator) gpu(tokens, cache int) {
	compute := float64(tokens) * float64(g.params) / flops
	memory := float64(g.params+cache) / bandwidth
	g.pause(time.Duration(max(compute, memory) * float64(time.Second)))
}

// alloc logs an allocation of size bytes on the current stream.
func (g *Generator) alloc(size int) tensor {
	t := tensor{ptr: g.nextAddr, size: size, stream: g.stream}
	g.nextAddr += rmm.DevicePtr((size + 511) &^ 511)
	g.pause(time.Duration(1+g.rng.IntN(4)) * time.Microsecond)
	g.buf = append(g.buf, rmm.LogEvent{Time: g.now, Action: rmm.ActionAllocate, Pointer: t.ptr, Size: size, Stream: t.stream})
	return t
}

// free logs the free of t, on the stream it was allocated on.
func (g *Generator) free(t tensor) {
	g.pause(time.Duration(1+g.rng.IntN(2)) * time.Microsecond)
	g.buf = append(g.buf, rmm.LogEvent{Time: g.now, Action: rmm.ActionFree, Pointer: t.ptr, Size: t.size, Stream: t.stream})
}

// loadWeights allocates the model's parameters in fp16, as a model's constructor and its move to
// the GPU do: the embedding (its transpose is the output head), then each block's norms,
// projections and biases, then the final norm.
func (g *Generator) loadWeights() {
	d, v := g.cfg.Hidden, g.cfg.Vocab
	w := func(elems int) {
		g.weights = append(g.weights, g.alloc(elems*2))
		g.params += elems * 2
	}
	w(v * d)
	w(g.cfg.MaxContext * d) // learned positions
	for range g.cfg.Layers {
		w(d) // ln1 weight, bias
		w(d)
		w(d * 3 * d) // qkv
		w(3 * d)
		w(d * d) // attention output
		w(d)
		w(d) // ln2 weight, bias
		w(d)
		w(d * 4 * d) // MLP up
		w(4 * d)
		w(4 * d * d) // MLP down
		w(d)
	}
	w(d) // final norm
	w(d)
}

// lognormal draws from a log-normal distribution of the given median and shape, clamped to
// [lo, hi] and rounded to an integer.
func (g *Generator) lognormal(median, sigma float64, lo, hi int) int {
	x := median * math.Exp(sigma*g.rng.NormFloat64())
	return int(math.Round(min(max(x, float64(lo)), float64(hi))))
}

// admit starts a request: it draws its batch, prompt and generated lengths and runs its prefill,
// which samples its first token.
func (g *Generator) admit() {
	g.requests++
	c := g.cfg
	newTokens := g.lognormal(16, 1.0, 1, min(maxNewTokens, c.MaxContext-1))
	prompt := g.lognormal(300, 1.1, 1, c.MaxContext-newTokens)
	batch := g.lognormal(3, 1.0, 1, maxBatch)
	batch = max(1, min(batch, maxBatchTokens/prompt))
	r := &request{batch: batch, newTokens: newTokens, k: make([]tensor, c.Layers), v: make([]tensor, c.Layers)}
	if g.rng.Float64() < c.SideStream {
		r.stream = sideStream
	}
	g.stream = r.stream
	b, s := batch, prompt
	ids := g.alloc(b * s * 8)
	r.mask = g.alloc(b * s * 8)
	posIDs := g.alloc(b * s * 8)
	h := g.alloc(b * s * g.seqBytes) // token + position embeddings
	for l := range c.Layers {
		h = g.block(r, l, b, s, 0, h)
	}
	hf := g.alloc(b * s * g.seqBytes) // final norm
	g.free(h)
	last := g.alloc(b * g.seqBytes) // the last position of each sequence
	g.free(hf)
	g.free(posIDs)
	g.free(ids)
	r.ctx = s
	g.gpu(b*s, 0)
	g.sample(r, last)
	g.inflight = append(g.inflight, r)
	if r.generated == r.newTokens {
		g.finish(len(g.inflight) - 1)
	}
}

// decode runs one decode step of r: one token per sequence through every block, appending to
// the cache, then samples the next token.
func (g *Generator) decode(r *request) {
	g.stream = r.stream
	g.pause(time.Duration(30+g.rng.IntN(120)) * time.Microsecond) // the host between steps
	b, n := r.batch, r.ctx
	posIDs := g.alloc(b * 8)
	mask := g.alloc(b * (n + 1) * 8) // the mask, one longer: torch.cat
	g.free(r.mask)
	r.mask = mask
	h := g.alloc(b * g.seqBytes) // embeddings of r.next
	for l := range g.cfg.Layers {
		h = g.block(r, l, b, 1, n, h)
	}
	hf := g.alloc(b * g.seqBytes) // final norm
	g.free(h)
	g.free(posIDs)
	r.ctx = n + 1
	g.gpu(b, b*r.ctx*2*g.kvPerTok*g.cfg.Layers)
	g.sample(r, hf)
}

// block runs q new tokens of each of b sequences, after past tokens in the cache (none without
// a request: a one-off), through layer l, as an eager PyTorch block does: pre-norm attention
// with fp32 softmax, then a 4× MLP, each with a residual. It frees h and returns the output.
func (g *Generator) block(r *request, l, b, q, past int, h tensor) tensor {
	d := g.seqBytes // bytes of one token's hidden state
	t := b * q
	x := g.alloc(t * d) // ln1
	qkv := g.alloc(t * 3 * d)
	g.free(x)
	if r != nil {
		g.appendKV(r, l, b, past+q)
	}
	keys := past + q
	scores := g.alloc(b * g.heads * q * keys * 2) // q·kᵀ, fp16
	p32 := g.alloc(b * g.heads * q * keys * 4)    // softmax in fp32
	g.free(scores)
	p := g.alloc(b * g.heads * q * keys * 2) // back to fp16
	g.free(p32)
	o := g.alloc(t * d) // p·v, heads merged
	g.free(p)
	g.free(qkv)
	a := g.alloc(t * d) // output projection
	g.free(o)
	r1 := g.alloc(t * d) // residual
	g.free(a)
	g.free(h)
	x2 := g.alloc(t * d) // ln2
	u := g.alloc(t * 4 * d)
	g.free(x2)
	act := g.alloc(t * 4 * d) // gelu
	g.free(u)
	m := g.alloc(t * d)
	g.free(act)
	r2 := g.alloc(t * d) // residual
	g.free(m)
	g.free(r1)
	return r2
}

// appendKV makes layer l's keys and values of r hold need tokens per sequence: allocated at the
// first pass, and when full reallocated to hold need rounded up to a multiple of KVBlock (the new
// allocated before the old is freed, as torch.cat does).
func (g *Generator) appendKV(r *request, l, b, need int) {
	if l == 0 && need > r.kvCap {
		blk := g.cfg.KVBlock
		r.kvCap = (need + blk - 1) / blk * blk
	}
	size := b * r.kvCap * g.kvPerTok
	if r.k[l].size == size {
		return
	}
	old := r.k[l]
	r.k[l] = g.alloc(size)
	if old.size > 0 {
		g.free(old)
	}
	old = r.v[l]
	r.v[l] = g.alloc(size)
	if old.size > 0 {
		g.free(old)
	}
}

// sample turns the last hidden states h of r's sequences into its next tokens, as a sampling
// step does (logits, fp32, softmax, multinomial), and frees h.
func (g *Generator) sample(r *request, h tensor) {
	b, v := r.batch, g.cfg.Vocab
	logits := g.alloc(b * v * 2)
	g.free(h)
	f := g.alloc(b * v * 4)
	g.free(logits)
	probs := g.alloc(b * v * 4)
	g.free(f)
	next := g.alloc(b * 8)
	g.free(probs)
	done := g.alloc(8) // all sequences finished?
	g.free(done)
	if r.next.size > 0 {
		g.free(r.next)
	}
	r.next = next
	r.generated++
}

// finish ends the request in flight at index i: its cache, mask and last tokens are freed, with
// the pooled outputs of earlier one-offs; and the number of requests wanted in flight is drawn
// again.
func (g *Generator) finish(i int) {
	r := g.inflight[i]
	g.stream = r.stream
	g.drop(r)
	g.inflight = append(g.inflight[:i], g.inflight[i+1:]...)
	for _, t := range g.pooled {
		g.free(t)
	}
	g.pooled = g.pooled[:0]
	g.target = 1 + g.rng.IntN(g.cfg.MaxInFlight)
}

// drop frees what r holds.
func (g *Generator) drop(r *request) {
	for l := range r.k {
		g.free(r.k[l])
		g.free(r.v[l])
	}
	g.free(r.mask)
	g.free(r.next)
}

// oneOff runs a large batch through the layers without a cache, as an embedding job does, and
// keeps its pooled output (fp32) until the next request ends.
func (g *Generator) oneOff() {
	g.oneOffs++
	g.stream = 0
	s := g.lognormal(128, 0.8, 8, 512)
	b := g.lognormal(float64(2*maxBatchTokens/s), 0.5, 1, 4*maxBatchTokens/s)
	ids := g.alloc(b * s * 8)
	mask := g.alloc(b * s * 8)
	h := g.alloc(b * s * g.seqBytes)
	for l := range g.cfg.Layers {
		h = g.block(nil, l, b, s, 0, h)
	}
	hf := g.alloc(b * s * g.seqBytes)
	g.free(h)
	g.gpu(b*s, 0)
	pooled := g.alloc(b * g.cfg.Hidden * 4)
	g.free(hf)
	g.free(mask)
	g.free(ids)
	g.pooled = append(g.pooled, pooled)
}

// end drops the requests in flight and frees the pooled outputs, then the weights.
func (g *Generator) end() {
	for _, r := range g.inflight {
		g.stream = r.stream
		g.drop(r)
	}
	g.inflight = nil
	g.stream = 0
	for _, t := range g.pooled {
		g.free(t)
	}
	g.pooled = nil
	for _, t := range g.weights {
		g.free(t)
	}
	g.weights = nil
	g.finished = true
}
