package transfer

import (
	"context"
	"errors"
	"strings"
	"sync"

	"github.com/rlflow/rlflow/vllm"
)

// Sessions runs one update's session on every server of a fleet (start,
// the backend's update_weights, finish with the version) and remembers
// which sessions it opened and finished, so that a failed update can close
// exactly the ones it left open. Both backends update through it.
type Sessions struct {
	fleet vllm.Fleet
	// closeStale: an open session on a server belongs to a trainer that is
	// gone, so a refused start closes it and starts again.
	closeStale bool
	// Written by server i's goroutine only, read after every run returned.
	// unsure: a start that got no answer (cut short when the update failed
	// on another server, or lost on the way back) may have opened the
	// session on the server all the same.
	opened, finished, unsure []bool
	// selfClosed: the server answered the failed update_weights and its
	// generation closes a failed update's session itself (E).
	selfClosed []bool
}

// NewSessions prepares the sessions of one update. closeStale says that
// any session a server already has open belongs to a trainer that is gone.
func NewSessions(fleet vllm.Fleet, closeStale bool) *Sessions {
	n := len(fleet)
	return &Sessions{fleet: fleet, closeStale: closeStale, opened: make([]bool, n), finished: make([]bool, n), unsure: make([]bool, n), selfClosed: make([]bool, n)}
}

// Run is server i's session: update runs between start and finish. Each
// server's Run must be called from one goroutine, and CloseLeftOpen only
// after every Run returned.
func (s *Sessions) Run(ctx context.Context, i int, update func(context.Context, *vllm.Client) error, version string) error {
	c := s.fleet[i]
	if err := c.StartUpdateSession(ctx, s.closeStale); err != nil {
		s.unsure[i] = unanswered(err)
		return err
	}
	s.opened[i] = true
	if err := update(ctx, c); err != nil {
		// A 400 is the router's refusal before the engine: the session
		// stays open; a worker's failure (5xx) closed it on E.
		s.selfClosed[i] = c.Generation().ClosesFailedSession() && workerFailed(err)
		return err
	}
	if err := c.FinishWeightUpdate(ctx, version); err != nil {
		return err
	}
	s.finished[i] = true
	return nil
}

// CloseLeftOpen closes every session this update opened and did not
// finish, recording version+"-failed": part of the checkpoint may have
// loaded, so neither the old label nor the new one would be true. A server
// that closed the session itself (E after a failed update_weights, or any
// server answering that none is open) is not finished again: its weights
// are labelled with update_weight_version instead. It returns a note for
// the update's error saying what happened, naming the servers where
// closing failed; "" when no session was left open.
func (s *Sessions) CloseLeftOpen(ctx context.Context, version string) string {
	var left vllm.Fleet
	var idx []int
	for i, c := range s.fleet {
		if (s.opened[i] && !s.finished[i]) || s.unsure[i] {
			left = append(left, c)
			idx = append(idx, i)
		}
	}
	if len(left) == 0 {
		return ""
	}
	byServer := make([]bool, len(left)) // the server had closed it already
	err := left.Each("close update session", func(k int, c *vllm.Client) error {
		i := idx[k]
		if s.selfClosed[i] {
			byServer[k] = true
			if version == "" {
				return nil
			}
			return c.LabelWeights(ctx, failedVersion(version))
		}
		err := c.CloseUpdateSession(ctx, failedVersion(version))
		if vllm.NoSessionOpen(err) {
			byServer[k] = true
			if version == "" {
				return nil
			}
			return c.LabelWeights(ctx, failedVersion(version))
		}
		if s.unsure[i] {
			return nil // it may never have opened: a refusal says only that
		}
		return err
	})
	var closedBy []string
	for k, c := range left {
		if byServer[k] {
			closedBy = append(closedBy, c.URL())
		}
	}
	note := "update sessions closed"
	switch {
	case len(closedBy) == len(left):
		note = "the server closed its update session itself"
		if len(left) > 1 {
			note = "the servers closed their update sessions themselves"
		}
	case len(closedBy) > 0:
		note = "update sessions closed (" + strings.Join(closedBy, ", ") + " had closed its own)"
	}
	if version != "" {
		note += ", weights labelled " + failedVersion(version)
	}
	if err == nil {
		return note
	}
	return "could not close every update session or label its weights, a server may be left mid-update: " + err.Error()
}

// initedGroups remembers which groups this process initialised, for the
// backends whose init is one call per server (disk, ipc): an update
// initialises a group on first use and again after a worker restart.
type initedGroups struct {
	mu   sync.Mutex
	keys map[string]bool
}

func (g *initedGroups) has(key string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.keys[key]
}

func (g *initedGroups) add(key string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.keys == nil {
		g.keys = map[string]bool{}
	}
	g.keys[key] = true
}

// updateFleet runs update on every server of f with one Sessions for the
// sessions it opens (any a server has open is a dead attempt's: updates of
// one group do not overlap). On failure it closes the ones left open,
// labelling version failed, and wraps the error as what on f's servers,
// saying what the closing did.
func updateFleet(ctx context.Context, f vllm.Fleet, version, what string, update func(s *Sessions, i int, c *vllm.Client) error) error {
	s := NewSessions(f, true)
	err := f.Each("update weights", func(i int, c *vllm.Client) error { return update(s, i, c) })
	if err == nil {
		return nil
	}
	if note := s.CloseLeftOpen(ctx, version); note != "" {
		return TransportErrorf(ctx, err, "%s on %s (%s)", what, ServerList(f), note)
	}
	return TransportErrorf(ctx, err, "%s on %s", what, ServerList(f))
}

// workerFailed reports whether err is the server's answer that the call
// failed inside the engine (HTTP 5xx).
func workerFailed(err error) bool {
	var e *vllm.Error
	return errors.As(err, &e) && e.Status >= 500
}

// unanswered reports whether a call failed without the server's answer:
// the server may have done what was asked.
func unanswered(err error) bool {
	var e *vllm.Error
	return !errors.As(err, &e) || e.Status == 0 && e.Err != nil
}

// failedVersion labels the weights of a server whose update failed.
func failedVersion(version string) string {
	if version == "" {
		return ""
	}
	return version + "-failed"
}

// ServerList names the fleet's servers for an error message.
func ServerList(f vllm.Fleet) string {
	urls := make([]string, len(f))
	for i, c := range f {
		urls[i] = c.URL()
	}
	return strings.Join(urls, ", ")
}
