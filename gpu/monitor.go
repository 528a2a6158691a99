package gpu

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
)

// Monitor reads GPU inventory and health. OpenNVML returns the real one;
// FakeMonitor is a test double. Indices are NVML's (PCI bus order).
type Monitor interface {
	Devices() ([]DeviceInfo, error)
	Health(index int) (Health, error)
	Close() error
}

// DeviceInfo is one GPU as NVML lists it.
type DeviceInfo struct {
	Index       int    `json:"index"`
	Name        string `json:"name"`
	UUID        string `json:"uuid"`
	PCIBusID    string `json:"pci_bus_id,omitempty"`
	MemoryTotal uint64 `json:"memory_total"`
	MemoryFree  uint64 `json:"memory_free"`
}

// Health is one device's state. Counters the device or driver does not
// support are nil (not zero: zero means "supported, none").
type Health struct {
	Device      int    `json:"device"`
	Name        string `json:"name,omitempty"`
	MemoryTotal uint64 `json:"memory_total"`
	MemoryFree  uint64 `json:"memory_free"`
	// ECC error counts since the driver loaded (volatile).
	ECCCorrected   *uint64 `json:"ecc_corrected,omitempty"`
	ECCUncorrected *uint64 `json:"ecc_uncorrected,omitempty"`
	// Retired pages (pre-Ampere) and remapped rows (Ampere and later).
	RetiredPages        *int  `json:"retired_pages,omitempty"`
	RetiredPagesPending *bool `json:"retired_pages_pending,omitempty"`
	RemappedUncorrected *int  `json:"remapped_rows_uncorrectable,omitempty"`
	RemapPending        *bool `json:"remap_pending,omitempty"`
	RemapFailed         *bool `json:"remap_failed,omitempty"`
	// XIDs are the critical XID errors seen since the monitor opened
	// (the latest ones, at most maxXIDs).
	XIDs []uint64 `json:"xids,omitempty"`
	// Problems describe, in words, whatever above is worth an operator's
	// attention; empty when the device looks healthy.
	Problems []string `json:"problems,omitempty"`
}

const maxXIDs = 16

// problems fills h.Problems from the counters.
func (h *Health) problems() {
	h.Problems = nil
	if h.ECCUncorrected != nil && *h.ECCUncorrected > 0 {
		h.Problems = append(h.Problems, fmt.Sprintf("%d uncorrected ECC errors", *h.ECCUncorrected))
	}
	if h.RetiredPagesPending != nil && *h.RetiredPagesPending {
		h.Problems = append(h.Problems, "page retirement pending (reset the GPU)")
	}
	if h.RemappedUncorrected != nil && *h.RemappedUncorrected > 0 {
		h.Problems = append(h.Problems, fmt.Sprintf("%d rows remapped after uncorrectable errors", *h.RemappedUncorrected))
	}
	if h.RemapPending != nil && *h.RemapPending {
		h.Problems = append(h.Problems, "row remapping pending (reset the GPU)")
	}
	if h.RemapFailed != nil && *h.RemapFailed {
		h.Problems = append(h.Problems, "row remapping failed")
	}
	if len(h.XIDs) > 0 {
		s := make([]string, len(h.XIDs))
		for i, x := range h.XIDs {
			s[i] = strconv.FormatUint(x, 10)
		}
		h.Problems = append(h.Problems, "XID errors "+strings.Join(s, ", "))
	}
}

// Selection is the device a GPU worker runs on.
type Selection struct {
	// CUDA is the CUDA ordinal (what nccl.OpenDevice takes).
	CUDA int
	// NVML is the device's NVML index; -1 when unknown (no NVML, or a
	// CUDA_VISIBLE_DEVICES entry that does not name a whole GPU).
	NVML int
	Info DeviceInfo
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
func Select(m Monitor, requested int, visible string, need uint64) (Selection, error) {
	if m == nil {
		sel := Selection{CUDA: max(requested, 0), NVML: -1}
		sel.Warnings = append(sel.Warnings, "NVML is not available: no device health data, and free memory is checked only when the staging buffers are allocated")
		return sel, nil
	}
	devs, err := m.Devices()
	if err != nil {
		return Selection{}, fmt.Errorf("gpu: list devices: %w", err)
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
		return Selection{}, errors.New("gpu: no GPU visible")
	}
	info := func(idx int) (DeviceInfo, bool) {
		for _, d := range devs {
			if d.Index == idx {
				return d, true
			}
		}
		return DeviceInfo{}, false
	}
	if requested >= 0 {
		if requested >= len(candidates) {
			return Selection{}, fmt.Errorf("gpu: --gpu %d, but %d devices are visible", requested, len(candidates))
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
			return Selection{}, fmt.Errorf("gpu: GPU %d (%s) has %d bytes free, the staging buffers need %d", requested, d.Name, d.MemoryFree, need)
		}
		return sel, nil
	}
	best := -1
	var bestInfo DeviceInfo
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
		return Selection{}, fmt.Errorf("gpu: no visible GPU has %d bytes free for the staging buffers", need)
	}
	return Selection{CUDA: best, NVML: bestInfo.Index, Info: bestInfo}, nil
}

// nvmlIndexOf resolves one CUDA_VISIBLE_DEVICES entry: an NVML index or a
// (prefix of a) GPU UUID. MIG instances and unknown entries give -1.
func nvmlIndexOf(v string, devs []DeviceInfo) int {
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

// FakeMonitor is a test double for Monitor: it reports the devices and
// health it is given. It is not a GPU and never pretends to be one outside
// tests.
type FakeMonitor struct {
	mu     sync.Mutex
	devs   []DeviceInfo
	health map[int]Health
}

// NewFakeMonitor returns a FakeMonitor listing devs, all healthy.
func NewFakeMonitor(devs ...DeviceInfo) *FakeMonitor {
	return &FakeMonitor{devs: devs, health: map[int]Health{}}
}

// SetHealth replaces what Health reports for a device (Problems are
// derived from the counters).
func (f *FakeMonitor) SetHealth(h Health) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.health[h.Device] = h
}

func (f *FakeMonitor) Devices() ([]DeviceInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]DeviceInfo(nil), f.devs...), nil
}

func (f *FakeMonitor) Health(index int) (Health, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, d := range f.devs {
		if d.Index != index {
			continue
		}
		h, ok := f.health[index]
		if !ok {
			h = Health{Device: index}
		}
		if h.Name == "" {
			h.Name = d.Name
		}
		if h.MemoryTotal == 0 {
			h.MemoryTotal, h.MemoryFree = d.MemoryTotal, d.MemoryFree
		}
		h.problems()
		return h, nil
	}
	return Health{}, fmt.Errorf("gpu: fake monitor has no device %d", index)
}

func (f *FakeMonitor) Close() error { return nil }
