//go:build !linux

package rmm

import "errors"

func hostMemoryInfo() (free, total int, err error) {
	return 0, 0, errors.New("host memory figures are only read on Linux")
}
