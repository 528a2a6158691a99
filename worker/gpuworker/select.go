package gpuworker

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/rlflow/rlflow/gpuhealth"
)

// Selection is the device a GPU worker runs on.
type Selection struct {
	// CUDA is the CUDA ordinal (what nccl.OpenDevice takes).
	CUDA int
	// NVML is the device's NVML index; -1 when unknown (no NVML, or a
	// CUDA_VISIBLE_DEVICES entry that does not name a whole GPU).
	NVML int
	Info gpuhealth.DeviceInfo
	// Warnings say what could not be checked or looks wrong; the worker
	// logs them at startup.
	Warnings []string
}

// Select picks the GPU: the CUDA ordinal requested (>= 0), or else the
// visible device with the most free memory. visible is
// CUDA_VISIBLE_DEVICES ("" = every device); the worker sets
// CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA ordinals follow NVML's order.
// need is the device memory the staging buffers will take; a device with
// less free is refused when requested explicitly, skipped otherwise. A nil
// Monitor (NVML missing) selects the requested ordinal, or 0, with a
// warning and no health data.
func Select(m gpuhealth.Monitor, requested int, visible string, need uint64) (Selection, error) {
	if m == nil {
		sel := Selection{CUDA: max(requested, 0), NVML: -1}
		sel.Warnings = append(sel.Warnings, "NVML is not available: no device health data, and free memory is checked only when the staging buffers are allocated")
		return sel, nil
	}
	devs, err := m.Devices()
	if err != nil {
		return Selection{}, fmt.Errorf("gpuworker: list devices: %w", err)
	}
	// CUDA ordinal i is candidates[i].
	candidates := make([]int, 0, len(devs)) // NVML index, -1 unknown
	if strings.TrimSpace(visible) == "" {
		for _, d := range devs {
			candidates = append(candidates, d.Index)
		}
	} else {
		for _, v := range strings.Split(visible, ",") {
			candidates = append(candidates, nvmlIndexOf(strings.TrimSpace(v), devs))
		}
	}
	if len(candidates) == 0 {
		return Selection{}, errors.New("gpuworker: no GPU visible")
	}
	info := func(idx int) (gpuhealth.DeviceInfo, bool) {
		for _, d := range devs {
			if d.Index == idx {
				return d, true
			}
		}
		return gpuhealth.DeviceInfo{}, false
	}
	if requested >= 0 {
		if requested >= len(candidates) {
			return Selection{}, fmt.Errorf("gpuworker: --gpu-device %d, but %d devices are visible", requested, len(candidates))
		}
		sel := Selection{CUDA: requested, NVML: candidates[requested]}
		d, ok := info(sel.NVML)
		if !ok {
			sel.NVML = -1
			sel.Warnings = append(sel.Warnings, fmt.Sprintf("CUDA device %d (CUDA_VISIBLE_DEVICES=%q) has no NVML counterpart: no health data", requested, visible))
			return sel, nil
		}
		sel.Info = d
		if d.MemoryFree < need {
			return Selection{}, fmt.Errorf("gpuworker: GPU %d (%s) has %d bytes free, the staging buffers need %d", requested, d.Name, d.MemoryFree, need)
		}
		return sel, nil
	}
	best := -1
	var bestInfo gpuhealth.DeviceInfo
	for cuda, idx := range candidates {
		d, ok := info(idx)
		if !ok || d.MemoryFree < need {
			continue
		}
		if best < 0 || d.MemoryFree > bestInfo.MemoryFree {
			best, bestInfo = cuda, d
		}
	}
	if best < 0 {
		return Selection{}, fmt.Errorf("gpuworker: no visible GPU has %d bytes free for the staging buffers", need)
	}
	return Selection{CUDA: best, NVML: bestInfo.Index, Info: bestInfo}, nil
}

// nvmlIndexOf resolves one CUDA_VISIBLE_DEVICES entry: an NVML index or a
// (prefix of a) GPU UUID. MIG instances and unknown entries give -1.
func nvmlIndexOf(v string, devs []gpuhealth.DeviceInfo) int {
	if n, err := strconv.Atoi(v); err == nil {
		return n
	}
	if strings.HasPrefix(v, "GPU-") {
		for _, d := range devs {
			if strings.HasPrefix(d.UUID, v) {
				return d.Index
			}
		}
	}
	return -1
}
