module github.com/gormm/rmm

go 1.26.0

require (
	github.com/dustin/go-humanize v1.1.0
	github.com/google/pprof v0.0.0-20261105003125-4bf881d7fb0b
	github.com/leanovate/gopter v0.2.11
	github.com/stretchr/testify v1.12.1
	golang.org/x/term v0.48.0
)

require (
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/sys v0.50.0 // indirect
)
