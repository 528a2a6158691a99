//go:build linux && cgo

package gpuhealth

import (
	"fmt"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// NVML is the real Monitor: go-nvml, which dlopens libnvidia-ml.so.1 at
// OpenNVML (nothing is needed to build). It also watches every device for
// critical XID events, which NVML only reports to an event set registered
// before they happen.
type NVML struct {
	lib nvml.Interface

	mu     sync.Mutex
	events nvml.EventSet // nil when the driver does not support XID events
	xids   map[int][]uint64
	byUUID map[string]int
}

// nvmlError is an NVML return code with the call that produced it.
type nvmlError struct {
	call string
	ret  nvml.Return
	lib  nvml.Interface
}

func (e *nvmlError) Error() string {
	return fmt.Sprintf("nvml: %s: %s", e.call, e.lib.ErrorString(e.ret))
}

// OpenNVML loads NVML (path "" = libnvidia-ml.so.1) and initialises it. A
// host without the library gets an error saying so: the GPU worker then
// runs without health data (NCCL may still work).
func OpenNVML(path string) (*NVML, error) {
	var opts []nvml.LibraryOption
	if path != "" {
		opts = append(opts, nvml.WithLibraryPath(path))
	} else {
		path = "libnvidia-ml.so.1"
	}
	lib := nvml.New(opts...)
	if ret := lib.Init(); ret != nvml.SUCCESS {
		if ret == nvml.ERROR_LIBRARY_NOT_FOUND {
			return nil, fmt.Errorf("nvml: %s not found (no NVIDIA driver on this host?)", path)
		}
		return nil, &nvmlError{"nvmlInit", ret, lib}
	}
	m := &NVML{lib: lib, xids: map[int][]uint64{}, byUUID: map[string]int{}}
	m.watchXIDs()
	return m, nil
}

// watchXIDs registers every device for critical XID events; devices (or
// drivers) that do not support them are simply not watched.
func (m *NVML) watchXIDs() {
	set, ret := m.lib.EventSetCreate()
	if ret != nvml.SUCCESS {
		return
	}
	n, ret := m.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		set.Free()
		return
	}
	registered := 0
	for i := 0; i < n; i++ {
		d, ret := m.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			continue
		}
		if uuid, ret := d.GetUUID(); ret == nvml.SUCCESS {
			m.byUUID[uuid] = i
		}
		if d.RegisterEvents(nvml.EventTypeXidCriticalError, set) == nvml.SUCCESS {
			registered++
		}
	}
	if registered == 0 {
		set.Free()
		return
	}
	m.events = set
}

// drainXIDs collects the XID events that arrived since the last call,
// without waiting.
func (m *NVML) drainXIDs() {
	if m.events == nil {
		return
	}
	for {
		e, ret := m.events.Wait(0)
		if ret != nvml.SUCCESS {
			return // ERROR_TIMEOUT: nothing more pending
		}
		idx := -1
		if e.Device != nil {
			if uuid, ret := e.Device.GetUUID(); ret == nvml.SUCCESS {
				if i, ok := m.byUUID[uuid]; ok {
					idx = i
				}
			}
		}
		x := append(m.xids[idx], e.EventData)
		if len(x) > maxXIDs {
			x = x[len(x)-maxXIDs:]
		}
		m.xids[idx] = x
	}
}

func (m *NVML) Devices() ([]DeviceInfo, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, ret := m.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, &nvmlError{"nvmlDeviceGetCount", ret, m.lib}
	}
	out := make([]DeviceInfo, 0, n)
	for i := 0; i < n; i++ {
		d, ret := m.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, &nvmlError{fmt.Sprintf("nvmlDeviceGetHandleByIndex(%d)", i), ret, m.lib}
		}
		info := DeviceInfo{Index: i}
		info.Name, _ = d.GetName()
		info.UUID, _ = d.GetUUID()
		if pci, ret := d.GetPciInfo(); ret == nvml.SUCCESS {
			info.PCIBusID = cString(pci.BusId[:])
		}
		mem, ret := d.GetMemoryInfo()
		if ret != nvml.SUCCESS {
			return nil, &nvmlError{fmt.Sprintf("nvmlDeviceGetMemoryInfo(%d)", i), ret, m.lib}
		}
		info.MemoryTotal, info.MemoryFree = mem.Total, mem.Free
		out = append(out, info)
	}
	return out, nil
}

// Health reads one device's counters. Calls the device does not support
// leave their fields nil; other failures are errors.
func (m *NVML) Health(index int) (Health, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	d, ret := m.lib.DeviceGetHandleByIndex(index)
	if ret != nvml.SUCCESS {
		return Health{}, &nvmlError{fmt.Sprintf("nvmlDeviceGetHandleByIndex(%d)", index), ret, m.lib}
	}
	h := Health{Device: index}
	h.Name, _ = d.GetName()
	mem, ret := d.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return Health{}, &nvmlError{"nvmlDeviceGetMemoryInfo", ret, m.lib}
	}
	h.MemoryTotal, h.MemoryFree = mem.Total, mem.Free
	if cur, _, ret := d.GetEccMode(); ret == nvml.SUCCESS && cur == nvml.FEATURE_ENABLED {
		if n, ret := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.VOLATILE_ECC); ret == nvml.SUCCESS {
			h.ECCCorrected = &n
		}
		if n, ret := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC); ret == nvml.SUCCESS {
			h.ECCUncorrected = &n
		}
	}
	sbe, ret1 := d.GetRetiredPages(nvml.PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
	dbe, ret2 := d.GetRetiredPages(nvml.PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
	if ret1 == nvml.SUCCESS && ret2 == nvml.SUCCESS {
		n := len(sbe) + len(dbe)
		h.RetiredPages = &n
		if st, ret := d.GetRetiredPagesPendingStatus(); ret == nvml.SUCCESS {
			p := st == nvml.FEATURE_ENABLED
			h.RetiredPagesPending = &p
		}
	}
	if _, unc, pending, failed, ret := d.GetRemappedRows(); ret == nvml.SUCCESS {
		h.RemappedUncorrected, h.RemapPending, h.RemapFailed = &unc, &pending, &failed
	}
	m.drainXIDs()
	h.XIDs = append([]uint64(nil), m.xids[index]...)
	h.Diagnose()
	return h, nil
}

// Close stops watching events and shuts NVML down.
func (m *NVML) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.events != nil {
		m.events.Free()
		m.events = nil
	}
	if ret := m.lib.Shutdown(); ret != nvml.SUCCESS {
		return &nvmlError{"nvmlShutdown", ret, m.lib}
	}
	return nil
}

func cString(b []int8) string {
	out := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		out = append(out, byte(c))
	}
	return string(out)
}
