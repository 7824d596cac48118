package kernels

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"strings"
	"testing"
)

// Each PTX file must have been generated from the .cu beside it as it is now: its header records
// the source's SHA-256.
func TestPTXMatchesSource(t *testing.T) {
	for name, ptx := range map[string]string{"fill": FillPTX, "copy": CopyPTX} {
		src, err := os.ReadFile(name + ".cu")
		if err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(src)
		want := "// source-sha256: " + hex.EncodeToString(sum[:])
		header := strings.SplitN(ptx, "\n", 6)
		if len(header) < 5 {
			t.Fatalf("%s.ptx: no header", name)
		}
		found := false
		for _, line := range header[:5] {
			if line == want {
				found = true
			}
		}
		if !found {
			t.Errorf("%s.ptx is stale: %s.cu changed since it was generated; run internal/kernels/gen.sh with nvcc (header: %q, source: %s)", name, name, header[:4], want)
		}
		if !strings.Contains(header[1], "nvcc: release") || !strings.Contains(header[2], "flags: -ptx") {
			t.Errorf("%s.ptx header lacks the nvcc version or flags: %q", name, header[:4])
		}
		for _, k := range map[string][]string{"fill": {"rmm_fill_v16", "rmm_fill_bytes"}, "copy": {"rmm_copy_v16", "rmm_copy_bytes"}}[name] {
			if !strings.Contains(ptx, ".entry "+k) {
				t.Errorf("%s.ptx lacks kernel %s", name, k)
			}
		}
	}
}
