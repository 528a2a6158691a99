package double

import (
	"context"
	"sync"
	"time"
)

// Pause modes.
const (
	pauseAbort = "abort"
	pauseWait  = "wait"
	pauseKeep  = "keep"
)

// scheduler emulates vLLM's admission and pause semantics for sequences:
//   - while paused (any mode) new sequences wait for resume, as vLLM's
//     AsyncLLM blocks new requests until resume_generation;
//   - abort ends every admitted sequence at once (finish reason "abort");
//   - wait lets admitted sequences run to the end, and the pause call
//     returns only when none is left;
//   - keep freezes admitted sequences where they are until resume.
//
// A sequence holds one of the slots (if bounded) for its latency.
type scheduler struct {
	slots chan struct{} // nil: unbounded

	mu       sync.Mutex
	paused   bool
	mode     string
	epoch    uint64        // bumped by every abort
	ctl      chan struct{} // closed and replaced on pause, resume and abort
	inflight int           // admitted, not yet finished sequences
	open     int           // sequences in run: waiting for admission or admitted
	idle     chan struct{} // closed when inflight drops to 0; nil if nobody waits
	running  int           // sequences holding a slot (all admitted ones when unbounded)
	peak     int           // the most running at once since the server started
	// unsent counts the sequences run has finished (done or aborted) whose
	// response is not yet written (sent): after a pause with mode keep it
	// only falls, so a test can wait for every answer to be out.
	unsent int
}

// peakRunning is the most sequences that held a slot at the same time.
func (s *scheduler) peakRunning() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.peak
}

// openCount is the sequences waiting for admission or being served.
func (s *scheduler) openCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.open
}

// unsentCount is the sequences finished but not yet answered.
func (s *scheduler) unsentCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.unsent
}

// sent marks n finished sequences as answered (or dropped).
func (s *scheduler) sent(n int) {
	s.mu.Lock()
	s.unsent -= n
	s.mu.Unlock()
}

// slotTaken and slotLeft count the sequences being served.
func (s *scheduler) slotTaken() {
	s.mu.Lock()
	s.running++
	s.peak = max(s.peak, s.running)
	s.mu.Unlock()
}

func (s *scheduler) slotLeft() {
	s.mu.Lock()
	s.running--
	s.mu.Unlock()
}

func newScheduler(maxConcurrent int) *scheduler {
	s := &scheduler{ctl: make(chan struct{})}
	if maxConcurrent > 0 {
		s.slots = make(chan struct{}, maxConcurrent)
	}
	return s
}

// changedLocked wakes every sequence to re-read the control state.
func (s *scheduler) changedLocked() {
	close(s.ctl)
	s.ctl = make(chan struct{})
}

func (s *scheduler) pause(ctx context.Context, mode string) error {
	s.mu.Lock()
	s.paused, s.mode = true, mode
	if mode == pauseAbort {
		s.epoch++
	}
	s.changedLocked()
	if mode != pauseWait || s.inflight == 0 {
		s.mu.Unlock()
		return nil
	}
	if s.idle == nil {
		s.idle = make(chan struct{})
	}
	idle := s.idle
	s.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *scheduler) resume() {
	s.mu.Lock()
	s.paused = false
	s.changedLocked()
	s.mu.Unlock()
}

func (s *scheduler) isPaused() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.paused
}

// abortAll aborts the admitted sequences without pausing; it returns how
// many there were.
func (s *scheduler) abortAll() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.epoch++
	s.changedLocked()
	return s.inflight
}

// outcome of one sequence.
type outcome struct {
	done    float64 // fraction of the latency served, 0..1
	aborted bool
}

// run admits one sequence and serves its latency d; it returns early with
// aborted set when an abort hits it, or ctx's error when the client left.
// A sequence it returns (done or aborted) counts as unsent until the
// caller's sent. One whose latency ends as a keep pause begins is frozen
// at its end: once pause returned, no sequence finishes until resume.
func (s *scheduler) run(ctx context.Context, d time.Duration) (outcome, error) {
	s.mu.Lock()
	s.open++
	defer func() {
		s.mu.Lock()
		s.open--
		s.mu.Unlock()
	}()
	for s.paused {
		ctl := s.ctl
		s.mu.Unlock()
		select {
		case <-ctl:
		case <-ctx.Done():
			return outcome{}, ctx.Err()
		}
		s.mu.Lock()
	}
	s.inflight++
	epoch := s.epoch
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.inflight--
		if s.inflight == 0 && s.idle != nil {
			close(s.idle)
			s.idle = nil
		}
		s.mu.Unlock()
	}()

	served := func(left time.Duration) float64 {
		if d <= 0 {
			return 1
		}
		return 1 - float64(left)/float64(d)
	}
	left := d
	haveSlot := s.slots == nil
	if haveSlot {
		s.slotTaken()
	}
	defer func() {
		if haveSlot {
			s.slotLeft()
			if s.slots != nil {
				<-s.slots
			}
		}
	}()
	for {
		s.mu.Lock()
		aborted := s.epoch != epoch
		frozen := s.paused && s.mode == pauseKeep
		ctl := s.ctl
		finished := aborted || (!frozen && haveSlot && left <= 0)
		if finished {
			s.unsent++ // under the lock pause takes
		}
		s.mu.Unlock()
		switch {
		case aborted:
			return outcome{done: served(left), aborted: true}, nil
		case finished:
			return outcome{done: 1}, nil
		case frozen:
			select {
			case <-ctl:
			case <-ctx.Done():
				return outcome{}, ctx.Err()
			}
			continue
		case !haveSlot:
			select {
			case s.slots <- struct{}{}:
				haveSlot = true
				s.slotTaken()
			case <-ctl:
			case <-ctx.Done():
				return outcome{}, ctx.Err()
			}
			continue
		}
		start := time.Now()
		t := time.NewTimer(left)
		select {
		case <-t.C:
			left = 0 // finished, unless a pause or abort came first
		case <-ctl:
			t.Stop()
			left -= time.Since(start)
		case <-ctx.Done():
			t.Stop()
			return outcome{}, ctx.Err()
		}
	}
}
