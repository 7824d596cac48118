// Package kernels holds the PTX of gormm/rmm's device kernels (fill and copy), generated from the
// .cu sources beside it by gen.sh with nvcc and committed, so that building needs no CUDA toolkit.
// The rmm package loads it once per device context with cuModuleLoadData.
package kernels

import _ "embed"

// FillPTX is the PTX of fill.cu: rmm_fill_v16 and rmm_fill_bytes.
//
//go:embed fill.ptx
var FillPTX string

// CopyPTX is the PTX of copy.cu: rmm_copy_v16 and rmm_copy_bytes.
//
//go:embed copy.ptx
var CopyPTX string
