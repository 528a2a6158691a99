package gpuworker

import (
	"strings"
	"testing"

	"github.com/rlflow/rlflow/gpuhealth"
	"github.com/rlflow/rlflow/gpuhealth/gpuhealthtest"
)

func TestSelect(t *testing.T) {
	mon := gpuhealthtest.NewMonitor(
		gpuhealth.DeviceInfo{Index: 0, Name: "a", UUID: "GPU-aaaa-1111", MemoryTotal: 80 << 30, MemoryFree: 10 << 30},
		gpuhealth.DeviceInfo{Index: 1, Name: "b", UUID: "GPU-bbbb-2222", MemoryTotal: 80 << 30, MemoryFree: 70 << 30},
		gpuhealth.DeviceInfo{Index: 2, Name: "c", UUID: "GPU-cccc-3333", MemoryTotal: 80 << 30, MemoryFree: 40 << 30},
	)
	cases := []struct {
		name      string
		requested int
		visible   string
		need      uint64
		cuda      int
		nvml      int
		err       string
	}{
		{"most free", -1, "", 1 << 30, 1, 1, ""},
		{"requested", 2, "", 1 << 30, 2, 2, ""},
		{"visible by index", -1, "2,0", 1 << 30, 0, 2, ""},
		{"visible by uuid prefix", 1, "GPU-cccc,GPU-aaaa", 1 << 30, 1, 0, ""},
		{"too little free, requested", 0, "", 20 << 30, 0, 0, "has 10737418240 bytes free"},
		{"too little free anywhere", -1, "", 75 << 30, 0, 0, "no visible GPU has"},
		{"out of range", 3, "", 0, 0, 0, "3 devices are visible"},
	}
	for _, tc := range cases {
		sel, err := Select(mon, tc.requested, tc.visible, tc.need)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s: %v, want %q", tc.name, err, tc.err)
			}
			continue
		}
		if err != nil || sel.CUDA != tc.cuda || sel.NVML != tc.nvml {
			t.Errorf("%s: %+v %v, want CUDA %d NVML %d", tc.name, sel, err, tc.cuda, tc.nvml)
		}
	}
	// A MIG instance has no whole-GPU NVML counterpart: no health, a warning.
	sel, err := Select(mon, 0, "MIG-1234", 0)
	if err != nil || sel.NVML != -1 || len(sel.Warnings) == 0 {
		t.Errorf("MIG: %+v %v", sel, err)
	}
	// Without NVML: the requested ordinal (or 0), with a warning.
	sel, err = Select(nil, -1, "", 1<<30)
	if err != nil || sel.CUDA != 0 || sel.NVML != -1 || !strings.Contains(strings.Join(sel.Warnings, ""), "NVML is not available") {
		t.Errorf("no NVML: %+v %v", sel, err)
	}
}
