package staging

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/ncclid"
	"github.com/rlflow/rlflow/nccl/tcpstore"
)

// RendezvousConfig describes rank 0's side of vLLM's rendezvous.
type RendezvousConfig struct {
	// MasterAddress is the address the TCPStore binds, exactly (not
	// 0.0.0.0, as a Python rank 0 does); the workers are told the same
	// address in init_info.master_address.
	MasterAddress string
	// MasterPort is the TCPStore port; 0 picks a free one, which is passed
	// to the init call.
	MasterPort int
	// WorldSize is 1 + the sum of the vLLM instances' world sizes.
	WorldSize int
	// Device is the CUDA device of rank 0.
	Device int
	// Store bounds what TCPStore clients may do.
	Store tcpstore.Options
	// Comm options for NewComm.
	Comm []nccl.CommOption
	// PickleModule is the module the pickled id in the TCPStore names (one
	// of ncclid.Modules; "" = ncclid.ModulePath, the legacy layout's).
	PickleModule string
}

// InitCall is the caller's side of the rendezvous that runs alongside NCCL
// init: in rlflow the HTTP POST /init_weight_transfer_engine with
// init_info.master_port = port (or, for servers that take it, the unique
// id itself as nccl_unique_id_b64), which returns only after every worker
// joined the communicator. It must honour ctx.
type InitCall func(ctx context.Context, port int, id nccl.UniqueID) error

// Rendezvous is rank 0's half of vLLM's weight-transfer rendezvous: it binds
// a TCPStore server to exactly cfg.MasterAddress, draws an ncclUniqueId,
// publishes its pickle under tcpstore.UniqueIDKey (for the workers that
// meet through the store; others get the id in their init call), then runs
// NewComm (rank 0, with the warm-up all-reduce) concurrently with init. Both must succeed: if
// init fails first, the half-built communicator is aborted at once instead
// of waiting for workers that will never come; if NCCL fails first, init's
// context is cancelled. The TCPStore is closed before Rendezvous returns.
// On success the caller owns the Comm.
func Rendezvous(ctx context.Context, cfg RendezvousConfig, api nccl.API, init InitCall) (*nccl.Comm, error) {
	if cfg.MasterAddress == "" {
		return nil, errors.New("staging: rendezvous: no master address")
	}
	if cfg.WorldSize < 2 {
		return nil, fmt.Errorf("staging: rendezvous: world size %d (rank 0 and at least one worker)", cfg.WorldSize)
	}
	module := cfg.PickleModule
	if module == "" {
		module = ncclid.ModulePath
	}
	if _, err := ncclid.PickleIn(ncclid.ID{}, module); err != nil {
		return nil, fmt.Errorf("staging: rendezvous: %w", err)
	}
	srv, err := tcpstore.Listen(ctx, net.JoinHostPort(cfg.MasterAddress, strconv.Itoa(cfg.MasterPort)), cfg.Store)
	if err != nil {
		return nil, fmt.Errorf("staging: rendezvous: %w", err)
	}
	defer srv.Close()
	port := srv.Addr().(*net.TCPAddr).Port

	// ncclGetUniqueId also starts NCCL's bootstrap root in this process;
	// run it on a device thread like every other API call.
	dev, err := nccl.OpenDevice(api, cfg.Device)
	if err != nil {
		return nil, fmt.Errorf("staging: rendezvous: %w", err)
	}
	var id nccl.UniqueID
	err = dev.Do(ctx, func(api nccl.API) error {
		id, err = api.GetUniqueID()
		return err
	})
	dev.Close()
	if err != nil {
		return nil, fmt.Errorf("staging: rendezvous: %w", err)
	}
	pickled, _ := ncclid.PickleIn(ncclid.ID(id), module)
	srv.Set(tcpstore.UniqueIDKey, pickled)

	rctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	type commResult struct {
		c   *nccl.Comm
		err error
	}
	commDone := make(chan commResult, 1)
	initDone := make(chan error, 1)
	go func() {
		c, err := nccl.NewComm(rctx, api, cfg.Device, cfg.WorldSize, 0, id, cfg.Comm...)
		commDone <- commResult{c, err}
	}()
	go func() { initDone <- init(rctx, port, id) }()

	var comm *nccl.Comm
	var commErr, initErr error
	for pending := 2; pending > 0; pending-- {
		select {
		case r := <-commDone:
			comm, commErr = r.c, r.err
			if commErr != nil {
				cancel(commErr)
			}
		case initErr = <-initDone:
			if initErr != nil {
				// NewComm sees rctx end and aborts the communicator.
				cancel(initErr)
			}
		}
	}
	if commErr == nil && initErr == nil {
		return comm, nil
	}
	if comm != nil {
		comm.Abort(initErr)
		_ = comm.Close(context.Background())
	}
	joined := "no worker"
	if v, ok := srv.Get(tcpstore.InitKey); ok {
		joined = string(v) + " of " + strconv.Itoa(cfg.WorldSize-1) + " workers"
	}
	where := fmt.Sprintf("TCPStore %s:%d, world size %d, %s connected", cfg.MasterAddress, port, cfg.WorldSize, joined)
	switch {
	case ctx.Err() != nil:
		return nil, fmt.Errorf("staging: rendezvous (%s): %w (init call: %v; nccl: %v)", where, context.Cause(ctx), initErr, commErr)
	case initErr != nil && (commErr == nil || errors.Is(commErr, context.Canceled)):
		// The init call's failure is the cause; NCCL only gave up after it.
		return nil, fmt.Errorf("staging: rendezvous (%s): init call failed: %w", where, initErr)
	case initErr != nil:
		return nil, fmt.Errorf("staging: rendezvous (%s): init call failed: %w; nccl: %w", where, initErr, commErr)
	}
	return nil, fmt.Errorf("staging: rendezvous (%s): %w", where, commErr)
}
