package rmm

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"strconv"
)

// MemoryProfileHandler returns an HTTP handler that serves r's profile as net/http/pprof serves
// Go's heap profile: a GET answers with WriteProfile's bytes (Content-Type
// application/octet-stream, as an attachment named "devicemem"), which go tool pprof reads from
// the URL. With debug=N for N > 0 it answers Report(0, "inuse_space") as plain text instead, for
// a browser. Go's heap handler's gc parameter is ignored: a garbage collection frees no device
// memory before the profile is taken (containers dropped without Close are freed by cleanups that
// run later, if at all). The seconds parameter (a delta profile) is refused with status 400.
//
// Mount it beside net/http/pprof's handlers (its index page does not list it):
//
//	http.Handle("/debug/pprof/devicemem", rmm.MemoryProfileHandler(prof.MemoryProfile)) // prof: a MemoryProfileResourceAdaptor
//
// and read it with
//
//	go tool pprof http://localhost:6060/debug/pprof/devicemem
func MemoryProfileHandler(r *MemoryProfile) http.Handler {
	return memProfHandler{r}
}

type memProfHandler struct{ r *MemoryProfile }

func (h memProfHandler) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	w.Header().Set("X-Content-Type-Options", "nosniff")
	q := req.URL.Query()
	if q.Get("seconds") != "" {
		memProfServeError(w, http.StatusBadRequest, "device memory profiles are not available as deltas: leave out seconds")
		return
	}
	debug, _ := strconv.Atoi(q.Get("debug"))
	if debug > 0 {
		report, err := h.r.Report(0, "inuse_space")
		if err != nil {
			memProfServeError(w, http.StatusInternalServerError, err.Error())
			return
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		io.WriteString(w, report+"\n")
		return
	}
	var buf bytes.Buffer
	if err := h.r.WriteProfile(&buf); err != nil {
		memProfServeError(w, http.StatusInternalServerError, "could not write the profile: "+err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", `attachment; filename="devicemem"`)
	w.Write(buf.Bytes())
}

// memProfServeError answers an error as net/http/pprof does (go tool pprof shows the text of a
// response carrying X-Go-Pprof).
func memProfServeError(w http.ResponseWriter, status int, txt string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Go-Pprof", "1")
	w.Header().Del("Content-Disposition")
	w.WriteHeader(status)
	fmt.Fprintln(w, txt)
}
