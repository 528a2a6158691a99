// Package gpuhealth reads a GPU host's inventory (devices, names, UUIDs,
// free memory) and each device's health (ECC errors, retired pages and
// remapped rows, critical XID events) through NVML: go-nvml, which dlopens
// libnvidia-ml.so.1 at OpenNVML, so nothing is needed to build. A host
// without the library gets an error from OpenNVML, and the GPU worker runs
// without health data.
//
// Invariants: indices are NVML's (PCI bus order); a counter the device or
// driver does not support is nil, never zero; Health.Problems says in
// words what needs an operator, empty when the device looks healthy. The
// package never logs.
package gpuhealth

import (
	"fmt"
	"strconv"
	"strings"
)

// Monitor reads GPU inventory and health. OpenNVML returns the real one;
// gpuhealthtest.Monitor is a test double. Indices are NVML's (PCI bus
// order).
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

// Diagnose fills h.Problems from the counters.
func (h *Health) Diagnose() {
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
