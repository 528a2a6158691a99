package procs

import (
	"os/exec"
	"runtime"
	"sync"
)

// Start starts cmd from the spawner: one OS thread locked for the life of
// this process, on which every command that sets Pdeathsig must be started.
//
// Linux sends the parent-death signal when the thread that forked the child
// exits, not the process. A goroutine that locks its thread and returns
// without unlocking ends that thread (nccl.Device does, so CUDA state never
// leaks to another goroutine), and Go may have forked any earlier child
// from that very thread: started with a plain cmd.Start, a command, the
// trainer or a test's Temporal server would then be SIGKILLed long before
// this process dies. Started here, Pdeathsig fires only when the process
// dies.
func Start(cmd *exec.Cmd) error {
	spawner.once.Do(func() {
		spawner.reqs = make(chan func())
		go func() {
			runtime.LockOSThread() // never unlocked: the thread lives as long as the process
			for f := range spawner.reqs {
				f()
			}
		}()
	})
	errc := make(chan error, 1)
	spawner.reqs <- func() { errc <- cmd.Start() }
	return <-errc
}

var spawner struct {
	once sync.Once
	reqs chan func()
}
