//go:build !(linux && cgo)

package gpuhealth

import "errors"

// NVML is unavailable in this build: go-nvml needs cgo on Linux. The GPU
// worker then runs without health data, as on a host without the driver.
type NVML struct{ Monitor }

// OpenNVML always fails in a build without cgo or not for Linux.
func OpenNVML(string) (*NVML, error) {
	return nil, errors.New("nvml: this binary was built without cgo or not for linux, so NVML cannot be loaded")
}
