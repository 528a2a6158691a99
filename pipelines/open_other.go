//go:build !unix

package pipelines

import "os"

// openNoBlock opens path for reading; these systems have no FIFOs that
// block an open, and LoadFile stats the path before opening it.
func openNoBlock(path string) (*os.File, error) { return os.Open(path) }
