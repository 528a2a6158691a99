//go:build linux

package nccl

import "syscall"

// ThreadID identifies the calling OS thread. Device uses it to run nested
// requests inline (a request made from the actor's own goroutine would
// otherwise deadlock) and nccltest.Fake to keep a current device per
// thread, as CUDA does.
func ThreadID() int { return syscall.Gettid() }
