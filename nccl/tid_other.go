//go:build !linux

package nccl

// threadID is unknown off Linux: 0 for every thread. Device then never runs
// a request inline and the Fake shares one current device between threads.
func ThreadID() int { return 0 }
