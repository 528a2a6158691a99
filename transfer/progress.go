package transfer

import "sync"

// Progress holds a transfer's progress: the engine writes it, whoever
// reports it (the activity's heartbeat) reads it. A nil *Progress ignores
// every write, so engines need not check.
type Progress struct {
	mu     sync.Mutex
	r      Report
	health func() any
}

// Report is a snapshot of a Progress, the heartbeat detail of
// init_transfer and broadcast.
type Report struct {
	Phase      string `json:"phase"` // "init" or "broadcast"
	Group      string `json:"group,omitempty"`
	BytesSent  int64  `json:"bytes_sent"`
	BytesTotal int64  `json:"bytes_total"`
	// Health is the GPU's health when the engine reads one (a
	// gpuhealth.Health on a GPU worker): for the operator watching the
	// step.
	Health any `json:"health,omitempty"`
}

// SetPhase records the phase and the group it serves.
func (p *Progress) SetPhase(phase, group string) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.r.Phase, p.r.Group = phase, group
	p.mu.Unlock()
}

// SetTotal records the bytes the update will send, and none sent yet.
func (p *Progress) SetTotal(total int64) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.r.BytesSent, p.r.BytesTotal = 0, total
	p.mu.Unlock()
}

// SetSent records the bytes known to be on the wire.
func (p *Progress) SetSent(n int64) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.r.BytesSent = n
	p.mu.Unlock()
}

// Sent returns the bytes known to be on the wire.
func (p *Progress) Sent() int64 {
	if p == nil {
		return 0
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.r.BytesSent
}

// WatchHealth makes every Report carry health(), read when reported.
func (p *Progress) WatchHealth(health func() any) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.health = health
	p.mu.Unlock()
}

// Report returns a snapshot, with the device's health read now.
func (p *Progress) Report() Report {
	if p == nil {
		return Report{}
	}
	p.mu.Lock()
	r, health := p.r, p.health
	p.mu.Unlock()
	if health != nil {
		r.Health = health()
	}
	return r
}
