package callocator

import "syscall"

func threadID() int { return syscall.Gettid() }
