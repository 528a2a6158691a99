//go:build unix

package pipelines

import (
	"os"
	"syscall"
)

// openNoBlock opens path for reading without waiting for a FIFO's writer;
// a regular file reads as usual with O_NONBLOCK set.
func openNoBlock(path string) (*os.File, error) {
	return os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
}
