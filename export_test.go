package rmm

// NewExpandablePoolOverHostVMM builds an expandable pool over host memory with the given
// granularity (a multiple of the page size) and physical limit (0: none), for tests outside the
// package.
func NewExpandablePoolOverHostVMM(granularity, physicalLimit int, opts PoolOptions) (*PoolMemoryResource, error) {
	vm, err := newHostVMM(granularity, physicalLimit)
	if err != nil {
		return nil, err
	}
	opts.Expandable = true
	return newExpandablePool(NewSystemMemoryResource(), vm, opts, poolTuning{})
}
