//go:build !(linux && cgo)

package nccl

import "errors"

// Environment variables that override where the libraries are loaded from.
const (
	EnvNCCLLib   = "RLFLOW_NCCL_LIB"
	EnvCUDARTLib = "RLFLOW_CUDART_LIB"
)

// Config says where to find the libraries. Empty fields mean "search".
type Config struct {
	NCCLPath   string
	CUDARTPath string
}

// Library is unavailable in this build: the bindings need cgo on Linux.
// The embedded API only makes *Library satisfy API so that callers compile;
// Load never returns a Library here.
type Library struct{ API }

// Load always fails in a build without cgo or on a platform other than Linux.
func Load(Config) (*Library, error) {
	return nil, errors.New("nccl: this binary was built without cgo or not for linux, so NCCL and the CUDA runtime cannot be loaded (rebuild with CGO_ENABLED=1 on linux)")
}

// NCCLPath and CUDARTPath are empty in this build.
func (l *Library) NCCLPath() string   { return "" }
func (l *Library) CUDARTPath() string { return "" }
