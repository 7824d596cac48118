//go:build !race

package rmm

// logRaceEnabled reports whether the test binary was built with -race.
const logRaceEnabled = false
