package gpuhealth_test

import (
	"strings"
	"testing"

	"github.com/rlflow/rlflow/gpuhealth"
	"github.com/rlflow/rlflow/gpuhealth/gpuhealthtest"
)

func TestHealthProblems(t *testing.T) {
	zero, two := uint64(0), uint64(2)
	yes, rows := true, 3
	mon := gpuhealthtest.NewMonitor(gpuhealth.DeviceInfo{Index: 0})
	mon.SetHealth(gpuhealth.Health{Device: 0, ECCUncorrected: &zero})
	if h, _ := mon.Health(0); len(h.Problems) != 0 {
		t.Errorf("zero counters reported as problems: %v", h.Problems)
	}
	mon.SetHealth(gpuhealth.Health{Device: 0, ECCUncorrected: &two, RemappedUncorrected: &rows, RemapPending: &yes, XIDs: []uint64{48, 79}})
	h, _ := mon.Health(0)
	got := strings.Join(h.Problems, "; ")
	for _, want := range []string{"2 uncorrected ECC errors", "3 rows remapped", "row remapping pending", "XID errors 48, 79"} {
		if !strings.Contains(got, want) {
			t.Errorf("problems %q lack %q", got, want)
		}
	}
	if _, err := mon.Health(5); err == nil {
		t.Error("unknown device accepted")
	}
}

// On a host without the NVIDIA driver, opening NVML fails with an error
// that says so, instead of crashing.
func TestOpenNVMLWithoutLibrary(t *testing.T) {
	m, err := gpuhealth.OpenNVML("/nonexistent/libnvidia-ml.so.1")
	if err == nil {
		m.Close()
		t.Fatal("opened NVML from a path that does not exist")
	}
	if !strings.Contains(err.Error(), "not found") && !strings.Contains(err.Error(), "without cgo") {
		t.Errorf("error %v", err)
	}
}
