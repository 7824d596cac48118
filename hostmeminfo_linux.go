package rmm

import (
	"bufio"
	"os"
	"strconv"
	"strings"
)

// hostMemoryInfo returns the host's available and total memory in bytes (MemAvailable and
// MemTotal of /proc/meminfo).
func hostMemoryInfo() (free, total int, err error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 {
			continue
		}
		kb, err := strconv.Atoi(fields[1])
		if err != nil {
			continue
		}
		switch fields[0] {
		case "MemTotal:":
			total = kb << 10
		case "MemAvailable:":
			free = kb << 10
		}
	}
	if total == 0 {
		return 0, 0, errorf("no MemTotal in /proc/meminfo")
	}
	return free, total, sc.Err()
}
