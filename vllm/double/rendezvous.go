package double

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rlflow/rlflow/nccl/ncclid"
	"github.com/rlflow/rlflow/nccl/tcpstore"
)

// initNCCL performs a worker's side of init_weight_transfer_engine: it
// validates init_info, obtains the NCCL unique id (TCPStore rendezvous, or
// nccl_unique_id_b64 on D and E) and records the result. Re-initialising
// replaces the previous group, as vLLM replaces its single communicator.
// The pickled id may name the legacy module on every generation and the
// vllm.backends one only on E, whose layout has that module (and resolves
// the legacy name through a compat shim); older workers fail to import it.
func (s *Server) initNCCL(ctx context.Context, info map[string]json.RawMessage) error {
	in := NCCLInit{}
	in.MasterAddress, _ = get[string](info, "master_address")
	in.MasterPort, _ = get[int](info, "master_port")
	rankOffset, _ := get[int](info, "rank_offset")
	in.WorldSize, _ = get[int](info, "world_size")
	in.Packed, _ = get[bool](info, "packed")
	in.PackedBufferSizeBytes, _ = get[int64](info, "packed_buffer_size_bytes")
	in.PackedNumBuffers, _ = get[int](info, "packed_num_buffers")
	b64, hasID := get[string](info, "nccl_unique_id_b64")
	hasStore := in.MasterAddress != "" || in.MasterPort != 0
	ranks := s.cfg.WorldSize * s.cfg.DataParallel
	switch {
	case hasID && hasStore:
		return workerError("ValueError: pass either nccl_unique_id_b64 or master_address/master_port, not both")
	case !hasID && (in.MasterAddress == "" || in.MasterPort == 0):
		return workerError("ValueError: master_address and master_port are required (or nccl_unique_id_b64)")
	case hasStore && (in.MasterPort < 1 || in.MasterPort > 65535):
		return workerError("ValueError: master_port %d out of range 1..65535", in.MasterPort)
	case rankOffset < 1:
		return workerError("ValueError: rank_offset %d, want >= 1 (rank 0 is the trainer)", rankOffset)
	case rankOffset+ranks > in.WorldSize:
		return workerError("ValueError: world_size %d is too small for rank_offset %d + %d worker ranks", in.WorldSize, rankOffset, ranks)
	case in.PackedBufferSizeBytes < 0 || in.PackedNumBuffers < 0:
		return workerError("ValueError: packed_buffer_size_bytes and packed_num_buffers must be positive")
	}
	for r := range ranks {
		in.Ranks = append(in.Ranks, rankOffset+r)
	}

	// The new group replaces the old one whatever the outcome.
	s.mu.Lock()
	old := s.rdv
	s.rdv, s.wstate.init, s.wstate.pickleModule = nil, nil, ""
	s.mu.Unlock()
	old.close()

	var rdv *rendezvous
	if hasID {
		id, err := ncclid.DecodeB64(b64)
		if err != nil {
			return workerError("ValueError: nccl_unique_id_b64: %v", err)
		}
		in.UniqueID = id[:]
	} else {
		addr := net.JoinHostPort(in.MasterAddress, strconv.Itoa(in.MasterPort))
		var err error
		var module string
		rdv, in.UniqueID, module, err = join(ctx, addr, ranks, s.cfg.RendezvousTimeout)
		if err != nil {
			return workerError("RuntimeError: TCPStore rendezvous with %s: %v", addr, err)
		}
		s.mu.Lock()
		s.wstate.pickleModule = module
		s.mu.Unlock()
		if module != ncclid.ModulePath && !s.cfg.Generation.backendsLayout() {
			rdv.close()
			top, _, _ := strings.Cut(strings.TrimPrefix(module, "vllm."), ".")
			return workerError("ModuleNotFoundError: No module named 'vllm.%s' (unpickling the ncclUniqueId under %s: generation %s keeps it in %s)",
				top, tcpstore.UniqueIDKey, s.cfg.Generation, ncclid.ModulePath)
		}
	}
	if s.cfg.NCCLReceiver != nil {
		if err := s.cfg.NCCLReceiver.Init(ctx, in); err != nil {
			rdv.close()
			return workerError("RuntimeError: NCCL init failed: %v", err)
		}
	}
	s.mu.Lock()
	s.rdv, s.wstate.init = rdv, &in
	s.mu.Unlock()
	return nil
}

// rendezvous holds the TCPStore connections of the emulated workers: a
// torch worker stays connected, idle, after reading the id.
type rendezvous struct {
	once    sync.Once
	closers []func() error
}

func (r *rendezvous) close() {
	if r == nil {
		return
	}
	r.once.Do(func() {
		for _, c := range r.closers {
			c()
		}
	})
}

var errRendezvousTimeout = errors.New("timed out")

// rendezvousDeadline bounds ctx by timeout, naming the timeout in errors.
func rendezvousDeadline(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeoutCause(ctx, timeout, fmt.Errorf("%w after %v (Config.RendezvousTimeout)", errRendezvousTimeout, timeout))
}

// join emulates the workers' side of vLLM's StatelessProcessGroup.create
// against the trainer's TCPStore at addr: each of the workers connects
// (retrying while the store is not up yet, as torch clients do), sends
// ADD "init/" 1, waits for and reads "/broadcast_from/0/0", and stays
// connected. It returns the unpickled ncclUniqueId and the module its
// pickle names; every worker must have read the same one. All of it is
// bounded by timeout.
func join(ctx context.Context, addr string, workers int, timeout time.Duration) (*rendezvous, []byte, string, error) {
	ctx, cancel := rendezvousDeadline(ctx, timeout)
	defer cancel()
	rdv := &rendezvous{}
	ids := make([][]byte, workers)
	errs := make([]error, workers)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			c, err := dialRetry(ctx, addr)
			if err != nil {
				errs[w] = err
				return
			}
			mu.Lock()
			rdv.closers = append(rdv.closers, c.Close)
			mu.Unlock()
			ids[w], errs[w] = c.JoinAsWorker(ctx)
		})
	}
	wg.Wait()
	for w, err := range errs {
		if err != nil {
			rdv.close()
			return nil, nil, "", fmt.Errorf("worker %d: %w", w, describe(err, timeout))
		}
	}
	id, module, err := ncclid.UnpickleModule(ids[0])
	if err != nil {
		rdv.close()
		return nil, nil, "", fmt.Errorf("%s does not hold a pickled ncclUniqueId: %w", tcpstore.UniqueIDKey, err)
	}
	for w := 1; w < workers; w++ {
		if string(ids[w]) != string(ids[0]) {
			rdv.close()
			return nil, nil, "", fmt.Errorf("workers 0 and %d read different ids under %s", w, tcpstore.UniqueIDKey)
		}
	}
	return rdv, id[:], module, nil
}

// dialRetry connects, retrying with backoff while ctx allows: the trainer
// may start its store just after it sent the init request.
func dialRetry(ctx context.Context, addr string) (*tcpstore.Client, error) {
	backoff := 20 * time.Millisecond
	for {
		c, err := tcpstore.Dial(ctx, addr)
		if err == nil {
			return c, nil
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("%w (last dial error: %v)", context.Cause(ctx), err)
		case <-t.C:
		}
		backoff = min(2*backoff, time.Second)
	}
}

// describe names the rendezvous timeout when err is a deadline: the store
// client may see its socket deadline (derived from ctx) pass just before
// ctx itself reports done, so ctx's cause cannot be relied on alone.
func describe(err error, timeout time.Duration) error {
	if errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, errRendezvousTimeout) {
		return fmt.Errorf("%w after %v (Config.RendezvousTimeout): %v", errRendezvousTimeout, timeout, err)
	}
	return err
}
