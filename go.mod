module github.com/gormm/rmm

go 1.26.0
