// Command rmm-workload writes a synthetic allocation log, in the RMM CSV format that librmm's
// logging_resource_adaptor writes and rmm-replay reads, for a workload that runs far longer than
// a recorded trace: a decoder-only language-model service on one GPU, as PyTorch's eager mode
// would ask its allocator for tensors.
//
//	rmm-workload [flags] -o FILE.csv[.gz]
//
// The log starts with the model's weights (fp16, a few GiB in about two hundred tensors), kept to
// the end. Then requests arrive, one to -inflight of them in flight at once. Each has a batch,
// a prompt length and a number of tokens to generate, drawn from continuous heavy-tailed
// distributions, so that no two requests ask for quite the same sizes. A request's prefill runs
// its prompt through every layer, allocating and freeing the activations of each step in the
// order a block computes them (norm, query/key/value projection, attention scores and their
// fp32 softmax, output projection, residual, the 4× MLP); it allocates the key/value cache and
// ends with the logits and the sampling of a token. Each decode step then runs one token per
// sequence through the layers and grows the cache: every -kvblock tokens each layer's keys and
// values are allocated larger before the old ones are freed, as torch.cat does (at every step
// with the default 1). When a request has its tokens its cache is freed. Now and then, instead
// of a request, a large one-off batch (an embedding job) runs through the layers. Once -events
// events were written, the requests in flight are dropped and the weights freed, so that
// nothing is left live.
//
// Every event is on thread 0 and, unless -sidestream, on the default stream; times increase
// with modelled compute time. Pointers are never reused (a replay maps them to its own).
// The same flags write the same log.
//
// Flags:
//
//	-o FILE          the log to write; gzip when the name ends in .gz (required)
//	-seed N          seed of every random draw (default 1)
//	-events N        the least number of events (default 1000000)
//	-layers N        transformer blocks (default 16)
//	-hidden N        model width, a multiple of 128 (default 3072)
//	-vocab N         vocabulary size (default 50304)
//	-inflight N      the most requests in flight at once (default 4)
//	-context N       the most tokens of a request, prompt and generated (default 4096)
//	-kvblock N       tokens by which a key/value cache grows when full (default 1)
//	-sidestream F    fraction of requests on a second stream, handle 0x1 (default 0)
//	-oneoffs F       fraction of arrivals that are a large one-off batch (default 0.02; 0:
//	                 none)
//
// Exit status: 0; 1 on an error; 2 on a bad command line.
package main

import (
	"compress/gzip"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/gormm/rmm"
	"github.com/gormm/rmm/internal/cli"
	"github.com/gormm/rmm/internal/workload"
)

func main() { cli.Main("rmm-workload", run, exitStatus) }

// exitStatus is the exit status for run's error: 0 for none (or -h), 2 for a bad command line,
// 1 for any other error.
var exitStatus = cli.Status

var (
	errUsage = cli.ErrUsage
	usagef   = cli.Usagef
)

func run(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("rmm-workload", flag.ContinueOnError)
	fs.SetOutput(stderr)
	out := fs.String("o", "", "the log to write (required); gzip when the name ends in .gz")
	seed := fs.Int64("seed", 1, "seed of every random draw: the same flags write the same log")
	events := fs.Int("events", 1_000_000, "the least number of events: the log ends at the first step after, once what is live was freed")
	layers := fs.Int("layers", 16, "transformer blocks")
	hidden := fs.Int("hidden", 3072, "model width, a multiple of 128 (the head size)")
	vocab := fs.Int("vocab", 50304, "vocabulary size")
	inflight := fs.Int("inflight", 4, "the most requests in flight at once")
	context := fs.Int("context", 4096, "the most tokens of a request, prompt and generated")
	kvblock := fs.Int("kvblock", 1, "tokens by which a request's key/value cache grows when full (1: at every decode step, as torch.cat)")
	side := fs.Float64("sidestream", 0, "fraction of requests served on a second stream, handle 0x1")
	oneOffs := fs.Float64("oneoffs", 0.02, "fraction of arrivals that are a large one-off batch (an embedding job)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: rmm-workload [flags] -o FILE.csv[.gz]")
		fmt.Fprintln(stderr, "Writes the RMM CSV allocation log of a synthetic language-model service (see go doc).")
		fmt.Fprintln(stderr, "Exit status: 0; 1 on an error; 2 on a bad command line.")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return cli.Printed(fmt.Errorf("%w: %w", errUsage, err))
	}
	if fs.NArg() != 0 {
		return usagef("unexpected arguments %q: the log goes to -o", fs.Args())
	}
	if *out == "" {
		return usagef("need -o FILE")
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"events", *events}, {"layers", *layers}, {"hidden", *hidden}, {"vocab", *vocab}, {"inflight", *inflight}, {"context", *context}, {"kvblock", *kvblock}} {
		if f.v < 1 {
			return usagef("-%s %d: must be at least 1", f.name, f.v)
		}
	}
	if !(*oneOffs >= 0 && *oneOffs <= 1) {
		return usagef("-oneoffs %v: must be a fraction in [0, 1]", *oneOffs)
	}
	cfg := workload.ServingConfig{Seed: *seed, Events: *events, Layers: *layers, Hidden: *hidden, Vocab: *vocab,
		MaxInFlight: *inflight, MaxContext: *context, KVBlock: *kvblock, SideStream: *side, OneOffs: *oneOffs}
	if *oneOffs == 0 {
		cfg.OneOffs = -1 // none; the configuration's zero is its default
	}
	g, err := workload.NewServing(cfg)
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	n, err := write(*out, g)
	if err != nil {
		return err
	}
	requests, ones := g.Requests()
	fmt.Fprintf(stdout, "rmm-workload: %s: %d events, %d requests, %d one-off batches\n", *out, n, requests, ones)
	return nil
}

// write writes g's events to the file path, gzipped when its name ends in .gz, and returns how
// many it wrote. A file it could not finish is removed.
func write(path string, g *workload.Generator) (n int, err error) {
	f, err := os.Create(path)
	if err != nil {
		return 0, err
	}
	defer func() {
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(path)
		}
	}()
	var w io.Writer = f
	var zw *gzip.Writer
	if strings.HasSuffix(path, ".gz") {
		zw = gzip.NewWriter(f)
		w = zw
	}
	lw := rmm.NewLogWriter(w)
	for e := range g.All() {
		if err := lw.Write(e); err != nil {
			return n, err
		}
		n++
	}
	if err := lw.Flush(); err != nil {
		return n, err
	}
	if zw != nil {
		if err := zw.Close(); err != nil {
			return n, err
		}
	}
	return n, nil
}
