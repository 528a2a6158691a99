// Package gpuhealthtest holds a test double of gpuhealth.Monitor.
package gpuhealthtest

import (
	"fmt"
	"sync"

	"github.com/rlflow/rlflow/gpuhealth"
)

// Monitor is a test double for gpuhealth.Monitor: it reports the devices and
// health it is given. It is not a GPU and never pretends to be one outside
// tests.
type Monitor struct {
	mu     sync.Mutex
	devs   []gpuhealth.DeviceInfo
	health map[int]gpuhealth.Health
}

// NewMonitor returns a Monitor listing devs, all healthy.
func NewMonitor(devs ...gpuhealth.DeviceInfo) *Monitor {
	return &Monitor{devs: devs, health: map[int]gpuhealth.Health{}}
}

// SetHealth replaces what Health reports for a device (Problems are
// derived from the counters).
func (f *Monitor) SetHealth(h gpuhealth.Health) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.health[h.Device] = h
}

func (f *Monitor) Devices() ([]gpuhealth.DeviceInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]gpuhealth.DeviceInfo(nil), f.devs...), nil
}

func (f *Monitor) Health(index int) (gpuhealth.Health, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, d := range f.devs {
		if d.Index != index {
			continue
		}
		h, ok := f.health[index]
		if !ok {
			h = gpuhealth.Health{Device: index}
		}
		if h.Name == "" {
			h.Name = d.Name
		}
		if h.MemoryTotal == 0 {
			h.MemoryTotal, h.MemoryFree = d.MemoryTotal, d.MemoryFree
		}
		h.Diagnose()
		return h, nil
	}
	return gpuhealth.Health{}, fmt.Errorf("gpuhealthtest: fake monitor has no device %d", index)
}

func (f *Monitor) Close() error { return nil }
