package trainer

// Test hooks for the external tests.

// UpdateGolden is the package tests' -update flag.
func UpdateGolden() bool { return *update }

// SetIdleStopped has m call f after its idle timer stopped a run's trainer.
func SetIdleStopped(m *Manager, f func(runID string)) { m.idleStopped = f }

// Exited is closed once the run's current trainer process has exited and
// been reaped (nil: no trainer).
func Exited(m *Manager, runID string) <-chan struct{} {
	r := m.lookup(runID)
	if r == nil {
		return nil
	}
	if p := r.current(); p != nil {
		return p.done
	}
	return nil
}
