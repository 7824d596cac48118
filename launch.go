package rmm

import (
	"encoding/binary"

	"github.com/gormm/rmm/internal/kernels"
)

// kernelSet is the loaded fill and copy kernels of one device context.
type kernelSet struct {
	fillV16, fillBytes uintptr
	copyV16, copyBytes uintptr
}

// ptxSources may be replaced by tests that load freshly generated PTX.
var ptxSources = func() (fill, copy string) { return kernels.FillPTX, kernels.CopyPTX }

// kernelsFor loads the kernels into dev's primary context once.
func kernelsFor(dev Device) (*kernelSet, *deviceState, error) {
	st, err := dev.state()
	if err != nil {
		return nil, nil, err
	}
	st.kernelsOnce.Do(func() {
		fillSrc, copySrc := ptxSources()
		ks := &kernelSet{}
		fm, err := cuModuleLoadData(st.ctx, fillSrc)
		if err != nil {
			st.kernelsErr = errorf("loading fill kernels on %s: %w", dev, err)
			return
		}
		cm, err := cuModuleLoadData(st.ctx, copySrc)
		if err != nil {
			st.kernelsErr = errorf("loading copy kernels on %s: %w", dev, err)
			return
		}
		for _, k := range []struct {
			mod  uintptr
			name string
			dst  *uintptr
		}{
			{fm, "rmm_fill_v16", &ks.fillV16}, {fm, "rmm_fill_bytes", &ks.fillBytes},
			{cm, "rmm_copy_v16", &ks.copyV16}, {cm, "rmm_copy_bytes", &ks.copyBytes},
		} {
			if *k.dst, err = cuModuleGetFunction(st.ctx, k.mod, k.name); err != nil {
				st.kernelsErr = errorf("kernel %s on %s: %w", k.name, dev, err)
				return
			}
		}
		st.kernels = ks
	})
	return st.kernels, st, st.kernelsErr
}

// launchBlock threads per block, at most launchBlocksPerSM blocks per multiprocessor (variables
// so that BenchmarkFillLaunchShape can sweep them): the widest blocks and the most of them per
// multiprocessor keep enough loads in flight to fill the memory bandwidth that cuMemsetD32Async
// reaches, where smaller shapes leave part of it unused (BenchmarkFillLaunchShape sweeps 128–1024
// threads × 2–64 blocks per SM).
var (
	launchBlock       = 1024
	launchBlocksPerSM = 64
)

// launchGrid returns a grid for n work items: enough blocks to fill the device several times,
// each thread then striding.
func launchGrid(st *deviceState, n int) int {
	g := (n + launchBlock - 1) / launchBlock
	if max := st.smCount * launchBlocksPerSM; g > max {
		g = max
	}
	if g < 1 {
		g = 1
	}
	return g
}

// deviceFill writes the elemSize-byte pattern elem repeatedly over nbytes at dst (nbytes a
// multiple of elemSize), ordered on s. Element widths 1, 2 and 4 use cuMemsetD8/16/32Async (the
// driver's memset is the bandwidth ceiling); widths up to 256 bytes use the fill kernels with
// 16-byte stores; larger elements are written once and then doubled by device copies.
func deviceFill(dev Device, dst DevicePtr, nbytes int, elem []byte, s StreamView) error {
	w := len(elem)
	if nbytes == 0 {
		return nil
	}
	if w == 0 || nbytes%w != 0 {
		return errorf("fill of %s with a %d-byte element: %w", bytesText(nbytes), w, ErrInvalidArgument)
	}
	st, err := dev.state()
	if err != nil {
		return err
	}
	stream := s.cu()
	switch {
	case w == 1:
		return cuMemsetAsync(st.ctx, dst, uint32(elem[0]), nbytes, 1, stream)
	case w == 2 && dst%2 == 0:
		return cuMemsetAsync(st.ctx, dst, uint32(binary.LittleEndian.Uint16(elem)), nbytes/2, 2, stream)
	case w == 4 && dst%4 == 0:
		return cuMemsetAsync(st.ctx, dst, binary.LittleEndian.Uint32(elem), nbytes/4, 4, stream)
	case w > patternBytes:
		return fillByDoubling(st, dst, nbytes, elem, stream)
	}
	ks, st, err := kernelsFor(dev)
	if err != nil {
		return err
	}
	// Head up to the first 16-byte boundary, body in 16-byte vectors, tail.
	head := int((16 - dst%16) % 16)
	if head > nbytes {
		head = nbytes
	}
	body := (nbytes - head) / 16
	tail := nbytes - head - body*16
	if head > 0 {
		if err := cuLaunchFill(st.ctx, ks.fillBytes, 1, 16, stream, dst, head, w, 0, elem); err != nil {
			return err
		}
	}
	if body > 0 {
		if err := cuLaunchFill(st.ctx, ks.fillV16, launchGrid(st, body), launchBlock, stream, dst+DevicePtr(head), body, w, head%w, elem); err != nil {
			return err
		}
	}
	if tail > 0 {
		off := head + body*16
		if err := cuLaunchFill(st.ctx, ks.fillBytes, 1, 16, stream, dst+DevicePtr(off), tail, w, off%w, elem); err != nil {
			return err
		}
	}
	return nil
}

// fillByDoubling writes elem at dst, then copies [0,k) to [k,2k) until nbytes are written.
func fillByDoubling(st *deviceState, dst DevicePtr, nbytes int, elem []byte, stream uintptr) error {
	if err := cuMemcpyHtoDSync(st.ctx, dst, bytesPtr(elem), len(elem), stream); err != nil {
		return err
	}
	for done := len(elem); done < nbytes; {
		n := done
		if n > nbytes-done {
			n = nbytes - done
		}
		if err := cuMemcpyDtoDAsync(st.ctx, dst+DevicePtr(done), dst, n, stream); err != nil {
			return err
		}
		done += n
	}
	return nil
}

// deviceCopy copies nbytes from src to dst (device-accessible, not overlapping), ordered on s,
// with cuMemcpyDtoDAsync: the driver's copy engines reach the copy bandwidth ceiling, which a
// copy kernel of ours would only approach.
func deviceCopy(dev Device, dst, src DevicePtr, nbytes int, s StreamView) error {
	if nbytes == 0 {
		return nil
	}
	ctx, err := dev.ctx()
	if err != nil {
		return err
	}
	return cuMemcpyAsync(ctx, uintptr(dst), uintptr(src), nbytes, s.cu())
}

// deviceCopyKernel copies with the copy kernels instead of the driver (for benchmarks).
func deviceCopyKernel(dev Device, dst, src DevicePtr, nbytes int, s StreamView) error {
	ks, st, err := kernelsFor(dev)
	if err != nil {
		return err
	}
	if dst%16 == 0 && src%16 == 0 && nbytes%16 == 0 {
		n := nbytes / 16
		return cuLaunchCopy(st.ctx, ks.copyV16, launchGrid(st, n), launchBlock, s.cu(), dst, src, n)
	}
	return cuLaunchCopy(st.ctx, ks.copyBytes, launchGrid(st, nbytes), launchBlock, s.cu(), dst, src, nbytes)
}
