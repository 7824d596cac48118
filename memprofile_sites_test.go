package rmm_test

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/google/pprof/profile"
	"github.com/gormm/rmm"
	"github.com/stretchr/testify/require"
)

// These tests allocate from functions of this package (rmm_test), which are, to the adaptor, the
// program's own call sites, as a user's functions are.

// memLoadWeights allocates n blocks of size bytes; it is one call site.
//
//go:noinline
func memLoadWeights(t *testing.T, mr rmm.MemoryResource, n, size int) []rmm.DevicePtr {
	var ps []rmm.DevicePtr
	for range n {
		p, err := mr.Allocate(size, rmm.DefaultStream) // the site
		require.NoError(t, err)
		ps = append(ps, p)
	}
	return ps
}

// memScratch allocates a buffer through a Uvector, so that the allocation's innermost frames
// are inside package rmm; its site is the line that calls NewUvector.
//
//go:noinline
func memScratch(t *testing.T, mr rmm.MemoryResource, n int) *rmm.Uvector[float32] {
	v, err := rmm.NewUvector[float32](n, rmm.DefaultStream, mr) // the site
	require.NoError(t, err)
	return v
}

// memLine returns the number of the line of this file marked "// the site" that holds marker. It
// reads the file from the package directory, where go test runs a test binary: the path the
// binary was compiled at (runtime.Caller's) need not exist where it runs, and is not a path at
// all under -trimpath.
func memLine(t *testing.T, marker string) int {
	t.Helper()
	src, err := os.ReadFile("memprofile_sites_test.go")
	require.NoError(t, err)
	for i, l := range strings.Split(string(src), "\n") {
		if strings.Contains(l, marker) && strings.Contains(l, "// the site") {
			return i + 1
		}
	}
	t.Fatalf("no line with %q", marker)
	return 0
}

// memSiteValues sums the values of the samples whose stack passes through function fn.
func memSiteValues(p *profile.Profile, fn string) (v [4]int64) {
	for _, s := range p.Sample {
		found := false
		for _, l := range s.Location {
			for _, line := range l.Line {
				found = found || line.Function.Name == fn
			}
		}
		if found {
			for i := range v {
				v[i] += s.Value[i]
			}
		}
	}
	return v
}

// At rate 1 the profile holds exactly what each call site allocated and still holds, and
// TopSites and Report sum it by site: the line that called Allocate, or NewUvector for a vector.
func TestMemoryProfileSitesExact(t *testing.T) {
	sim, err := rmm.NewSimulatedMemoryResource(1 << 40)
	require.NoError(t, err)
	prof, err := rmm.NewMemoryProfileResourceAdaptor(sim, &rmm.MemoryProfileOptions{Rate: 1})
	require.NoError(t, err)

	weights := memLoadWeights(t, prof, 3, 1000)
	weights = append(weights, memLoadWeights(t, prof, 1, 5000)...) // same site, another size
	scratch := memScratch(t, prof, 10_000)                         // 40,000 bytes
	scratch2 := memScratch(t, prof, 2_500)                         // 10,000 bytes
	require.NoError(t, prof.Deallocate(weights[0], 1000, rmm.DefaultStream))
	require.NoError(t, scratch2.Close())

	var buf bytes.Buffer
	require.NoError(t, prof.WriteProfile(&buf))
	p, err := profile.Parse(&buf)
	require.NoError(t, err)
	require.Len(t, p.Sample, 4) // one per stack and size
	require.Equal(t, [4]int64{4, 8000, 3, 7000}, memSiteValues(p, "github.com/gormm/rmm_test.memLoadWeights"))
	require.Equal(t, [4]int64{2, 50000, 1, 40000}, memSiteValues(p, "github.com/gormm/rmm_test.memScratch"))
	require.Equal(t, [4]int64{6, 58000, 4, 47000}, memSiteValues(p, "github.com/gormm/rmm_test.TestMemoryProfileSitesExact"))
	for _, s := range p.Sample { // the stack starts at the caller of Allocate
		fn := s.Location[0].Line[0].Function.Name
		if s.NumLabel["bytes"][0] == 1000 || s.NumLabel["bytes"][0] == 5000 {
			require.Equal(t, "github.com/gormm/rmm_test.memLoadWeights", fn)
		} else {
			require.True(t, strings.HasPrefix(fn, "github.com/gormm/rmm."), fn) // inside NewUvector
		}
	}

	_, file, _, _ := runtime.Caller(0) // the name the profile gives this file: the binary's, never opened
	load := rmm.MemorySite{Function: "github.com/gormm/rmm_test.memLoadWeights", File: file, Line: memLine(t, "mr.Allocate(size"),
		InUseObjects: 3, InUseBytes: 7000, AllocObjects: 4, AllocBytes: 8000}
	scr := rmm.MemorySite{Function: "github.com/gormm/rmm_test.memScratch", File: file, Line: memLine(t, "rmm.NewUvector[float32](n"),
		InUseObjects: 1, InUseBytes: 40000, AllocObjects: 2, AllocBytes: 50000}
	sites, err := prof.TopSites(0, "inuse_space")
	require.NoError(t, err)
	require.Equal(t, []rmm.MemorySite{scr, load}, sites)
	sites, err = prof.TopSites(1, "inuse_objects")
	require.NoError(t, err)
	require.Equal(t, []rmm.MemorySite{load}, sites)
	sites, err = rmm.MemorySites(p, "alloc_space") // from the profile read back
	require.NoError(t, err)
	require.Equal(t, []rmm.MemorySite{scr, load}, sites)
	sites, err = rmm.MemorySites(p, "alloc_objects")
	require.NoError(t, err)
	require.Equal(t, []rmm.MemorySite{load, scr}, sites)

	report, err := prof.Report(0, "alloc_space")
	require.NoError(t, err)
	lines := strings.Split(report, "\n")
	require.Equal(t, []string{
		"Device Memory by Call Site",
		"==========================",
		"",
		"Sampling: every allocation",
		"Ordered by: alloc_space",
		"",
		"inuse_objects     inuse_space  alloc_objects     alloc_space  filename:lineno(function)",
		"            1          40,000              2          50,000  " + scr.String(),
		"            3           7,000              4           8,000  " + load.String(),
	}, lines)
	require.Equal(t, file+":"+strconv.Itoa(scr.Line)+"(github.com/gormm/rmm_test.memScratch)", scr.String())

	require.NoError(t, prof.Deallocate(weights[1], 1000, rmm.DefaultStream))
	require.NoError(t, prof.Deallocate(weights[2], 1000, rmm.DefaultStream))
	require.NoError(t, prof.Deallocate(weights[3], 5000, rmm.DefaultStream))
	require.NoError(t, scratch.Close())
	sites, err = prof.TopSites(0, "")
	require.NoError(t, err)
	for _, s := range sites {
		require.Zero(t, s.InUseBytes)
		require.Zero(t, s.InUseObjects)
	}
}

// The handler serves the profile as net/http/pprof serves Go's heap profile: go tool pprof reads
// it; debug=1 gives the report as text; seconds is refused.
func TestMemoryProfileHandler(t *testing.T) {
	prof, err := rmm.NewMemoryProfileResourceAdaptor(rmm.NewSystemMemoryResource(), &rmm.MemoryProfileOptions{Rate: 1})
	require.NoError(t, err)
	weights := memLoadWeights(t, prof, 2, 3<<20)
	defer func() {
		for _, w := range weights {
			require.NoError(t, prof.Deallocate(w, 3<<20, rmm.DefaultStream))
		}
	}()

	mux := http.NewServeMux()
	mux.Handle("/debug/pprof/devicemem", rmm.MemoryProfileHandler(prof.MemoryProfile))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	resp, err := http.Get(srv.URL + "/debug/pprof/devicemem?gc=1")
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "application/octet-stream", resp.Header.Get("Content-Type"))
	require.Equal(t, `attachment; filename="devicemem"`, resp.Header.Get("Content-Disposition"))
	require.Equal(t, "nosniff", resp.Header.Get("X-Content-Type-Options"))
	p, err := profile.ParseData(body)
	require.NoError(t, err)
	require.Equal(t, [4]int64{2, 6 << 20, 2, 6 << 20}, memSiteValues(p, "github.com/gormm/rmm_test.memLoadWeights"))

	resp, err = http.Get(srv.URL + "/debug/pprof/devicemem?debug=1")
	require.NoError(t, err)
	text, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.Equal(t, "text/plain; charset=utf-8", resp.Header.Get("Content-Type"))
	require.Regexp(t, regexp.MustCompile(`(?m)^ +2 +6,291,456 +2 +6,291,456  .*memprofile_sites_test\.go:\d+\(github\.com/gormm/rmm_test\.memLoadWeights\)$`), string(text))

	resp, err = http.Get(srv.URL + "/debug/pprof/devicemem?seconds=5")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
	require.Equal(t, "1", resp.Header.Get("X-Go-Pprof"))

	if testing.Short() {
		t.Skip("go tool pprof: not in -short mode")
	}
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go tool pprof: no go command on PATH")
	}
	file := filepath.Join(t.TempDir(), "devicemem.pb.gz")
	require.NoError(t, os.WriteFile(file, body, 0o644))
	cmd := exec.Command(goTool, "tool", "pprof", "-top", "-sample_index=inuse_space", file)
	cmd.Env = append(os.Environ(), "PPROF_TMPDIR="+t.TempDir(), "PPROF_BINARY_PATH="+t.TempDir())
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	t.Logf("go tool pprof -top:\n%s", out)
	require.Contains(t, string(out), "Type: inuse_space")
	require.Regexp(t, regexp.MustCompile(`(?m)^ +6MB +100% +100% +6MB +100% +github\.com/gormm/rmm_test\.memLoadWeights$`), string(out))
}

func TestMemorySiteFormat(t *testing.T) {
	s := rmm.MemorySite{Function: "main.load", File: "/src/main.go", Line: 12, InUseObjects: 2, InUseBytes: 4096, AllocObjects: 5, AllocBytes: 10240}
	require.Equal(t, "/src/main.go:12(main.load)", fmt.Sprintf("%v", s))
	require.Equal(t, "/src/main.go:12(main.load)", fmt.Sprintf("%s", s))
	require.Equal(t, "/src/main.go:12(main.load): in use 2 allocations, 4096 bytes; allocated 5, 10240 bytes", fmt.Sprintf("%+v", s))
	require.Equal(t, `rmm.MemorySite{Function:"main.load", File:"/src/main.go", Line:12, InUseObjects:2, InUseBytes:4096, AllocObjects:5, AllocBytes:10240}`, fmt.Sprintf("%#v", s))
	require.Equal(t, "%!d(rmm.MemorySite=/src/main.go:12(main.load))", fmt.Sprintf("%d", s))
}
