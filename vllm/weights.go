package vllm

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"time"
)

// InitInfo is the trainer's side of init_weight_transfer_engine. Which
// fields reach the wire depends on the generation (see InitWeightTransfer).
type InitInfo struct {
	// Disk selects the disk backend and IPC the ipc backend (trainer and
	// server on the same GPU, CUDA IPC handles in update_info): for both
	// init_info is {} and every other field must be zero.
	Disk, IPC bool

	MasterAddress string // the trainer's TCPStore host (bound exactly by rank 0)
	MasterPort    int
	RankOffset    int // this server's first rank; the first server gets 1
	WorldSize     int // the whole group: 1 (trainer) + every server's world size

	// Packed settings are sent in init_info only on D and E; B and C take
	// them in update_info (UpdateInfo), so here they are dropped for B/C/A.
	Packed                bool
	PackedBufferSizeBytes int64 // 0: the server's default (1 GiB)
	PackedNumBuffers      int   // 0: the server's default (2)

	// NCCLUniqueIDB64 (E, and the newest D builds) replaces MasterAddress
	// and MasterPort: the id travels in the request, no TCPStore is involved.
	NCCLUniqueIDB64 string
}

// UpdateInfo describes one update_weights call: tensor metadata (Names,
// DTypeNames, Shapes, in broadcast order on NCCL) with IPCHandlesPickled
// for the ipc backend, or, for the disk backend, Path.
type UpdateInfo struct {
	Names      []string
	DTypeNames []string  // torch names: "bfloat16", "float32", ...
	Shapes     [][]int64 // one per name; [] for a scalar

	// Packed settings are sent in update_info on A (packed only), B and C.
	// On D and E they were fixed by init_info and are not sent here (a 500 there),
	// but pass the same values so the caller's broadcast plan is the same.
	Packed                bool
	PackedBufferSizeBytes int64
	PackedNumBuffers      int

	// Path is the absolute checkpoint directory (*.safetensors) for the
	// disk backend (C and D); it excludes the NCCL fields.
	Path string

	// IPCHandlesPickled selects the ipc backend (C, D and E; not packed):
	// EncodeIPCHandles's output for the tensors of Names, in that order.
	IPCHandlesPickled string

	// CheckpointBytes sizes the deadline when Timeouts.Update is zero
	// (UpdateTimeoutFor); it is never sent.
	CheckpointBytes int64
}

// Wire shapes. Field order is the JSON order; omitempty keeps keys a
// generation does not know off the wire.
type (
	ncclInitInfo struct {
		MasterAddress         string `json:"master_address,omitempty"`
		MasterPort            int    `json:"master_port,omitempty"`
		RankOffset            int    `json:"rank_offset"`
		WorldSize             int    `json:"world_size"`
		Packed                bool   `json:"packed,omitempty"`
		PackedBufferSizeBytes int64  `json:"packed_buffer_size_bytes,omitempty"`
		PackedNumBuffers      int    `json:"packed_num_buffers,omitempty"`
		NCCLUniqueIDB64       string `json:"nccl_unique_id_b64,omitempty"`
	}
	ncclUpdateInfo struct {
		Names                 []string  `json:"names"`
		DTypeNames            []string  `json:"dtype_names"`
		Shapes                [][]int64 `json:"shapes"`
		Packed                bool      `json:"packed,omitempty"`
		PackedBufferSizeBytes int64     `json:"packed_buffer_size_bytes,omitempty"`
		PackedNumBuffers      int       `json:"packed_num_buffers,omitempty"`
	}
	diskUpdateInfo struct {
		Path string `json:"path"`
	}
	ipcUpdateInfo struct {
		Names             []string  `json:"names"`
		DTypeNames        []string  `json:"dtype_names"`
		Shapes            [][]int64 `json:"shapes"`
		IPCHandlesPickled string    `json:"ipc_handles_pickled"`
	}
)

// InitWeightTransfer calls init_weight_transfer_engine (/init_weight_transfer
// on A). On the NCCL backend the call blocks until every worker joined the
// trainer's group: the trainer must host its TCPStore and take part in the
// NCCL init concurrently (call this from another goroutine). Never retried.
//
// Placement: A, B, C send {master_address, master_port, rank_offset,
// world_size}; D and E add packed, packed_buffer_size_bytes,
// packed_num_buffers (when Packed) and may replace address and port by
// nccl_unique_id_b64. The disk and ipc backends send {} (C, D, E).
func (c *Client) InitWeightTransfer(ctx context.Context, info InitInfo) error {
	cl := call{method: http.MethodPost, path: "/init_weight_transfer_engine", timeout: c.opts.Timeouts.init(), timeoutOf: "Init"}
	gen, err := c.generation(ctx)
	if err != nil {
		return err
	}
	if gen == GenA {
		cl.path = "/init_weight_transfer"
	}
	payload, err := initPayload(gen, info)
	if err != nil {
		return c.errorf(cl, 0, nil, "%v", err)
	}
	_, err = c.do(ctx, withBody(cl, map[string]any{"init_info": payload}), nil)
	return err
}

func withBody(cl call, body any) call { cl.body = body; return cl }

func initPayload(gen Generation, info InitInfo) (any, error) {
	if info.Disk || info.IPC {
		return emptyInitInfo(gen, info)
	}
	if info.NCCLUniqueIDB64 != "" {
		if gen != GenD && gen != GenE {
			return nil, fmt.Errorf("nccl_unique_id_b64 needs generation D (newest builds) or E, server is %s", gen)
		}
		if info.MasterAddress != "" || info.MasterPort != 0 {
			return nil, fmt.Errorf("nccl_unique_id_b64 replaces master_address/master_port: set one or the other")
		}
		if err := checkUniqueID(info.NCCLUniqueIDB64); err != nil {
			return nil, err
		}
	} else {
		if info.MasterAddress == "" {
			return nil, fmt.Errorf("init_info: master_address is empty")
		}
		if info.MasterPort < 1 || info.MasterPort > 65535 {
			return nil, fmt.Errorf("init_info: master_port %d out of range 1..65535", info.MasterPort)
		}
	}
	if info.RankOffset < 1 {
		return nil, fmt.Errorf("init_info: rank_offset %d, want >= 1 (rank 0 is the trainer)", info.RankOffset)
	}
	if info.WorldSize <= info.RankOffset {
		return nil, fmt.Errorf("init_info: world_size %d must exceed rank_offset %d", info.WorldSize, info.RankOffset)
	}
	if err := checkPacked(info.Packed, info.PackedBufferSizeBytes, info.PackedNumBuffers); err != nil {
		return nil, err
	}
	p := ncclInitInfo{
		MasterAddress:   info.MasterAddress,
		MasterPort:      info.MasterPort,
		RankOffset:      info.RankOffset,
		WorldSize:       info.WorldSize,
		NCCLUniqueIDB64: info.NCCLUniqueIDB64,
	}
	if gen == GenD || gen == GenE {
		p.Packed, p.PackedBufferSizeBytes, p.PackedNumBuffers = info.Packed, info.PackedBufferSizeBytes, info.PackedNumBuffers
	}
	return p, nil
}

// emptyInitInfo is init_info of the backends without a rendezvous, disk
// and ipc: {}, on the generations with sessions.
func emptyInitInfo(gen Generation, info InitInfo) (any, error) {
	if info.Disk && info.IPC {
		return nil, fmt.Errorf("init_info: the disk and ipc backends are exclusive")
	}
	backend := "disk"
	if info.IPC {
		backend = "ipc"
	}
	if info != (InitInfo{Disk: info.Disk, IPC: info.IPC}) {
		return nil, fmt.Errorf("%s backend: init_info is {}, but NCCL fields are set", backend)
	}
	if err := sessionBackend(gen, backend); err != nil {
		return nil, err
	}
	return struct{}{}, nil
}

// sessionBackend refuses the disk and ipc backends on a generation
// without update sessions.
func sessionBackend(gen Generation, backend string) error {
	if !gen.HasSessions() {
		return fmt.Errorf("generation %s has no %s backend (C, D or E needed)", gen, backend)
	}
	return nil
}

func checkPacked(packed bool, size int64, buffers int) error {
	if size < 0 || buffers < 0 {
		return fmt.Errorf("packed_buffer_size_bytes %d and packed_num_buffers %d must not be negative", size, buffers)
	}
	if !packed && (size != 0 || buffers != 0) {
		return fmt.Errorf("packed buffer settings given but packed is false")
	}
	return nil
}

// StartWeightUpdate opens an update session (C, D). A and B have no
// sessions: it returns nil without a request. Never retried: a retry after a
// lost answer would hit "session already open".
func (c *Client) StartWeightUpdate(ctx context.Context) error {
	gen, err := c.generation(ctx)
	if err != nil || !gen.HasSessions() {
		return err
	}
	// {} rather than no body: some C builds parse the body (optional
	// is_checkpoint_format) and answer 400 to an empty one.
	cl := call{method: http.MethodPost, path: "/start_weight_update", body: struct{}{}, timeout: c.opts.Timeouts.control(), timeoutOf: "Control"}
	_, err = c.do(ctx, cl, nil)
	return err
}

// UpdateWeights calls update_weights. On NCCL it blocks until every
// broadcast of the update was received and loaded: run the trainer's
// broadcasts concurrently. Never retried.
//
// Placement: A sends {names, dtype_names, shapes, packed}; B and C add
// packed_buffer_size_bytes and packed_num_buffers; D and E send only names,
// dtype_names and shapes. The disk backend sends {path}; the ipc backend
// (C, D, E) {names, dtype_names, shapes, ipc_handles_pickled}.
func (c *Client) UpdateWeights(ctx context.Context, info UpdateInfo) error {
	cl := call{method: http.MethodPost, path: "/update_weights", timeout: c.opts.Timeouts.update(info.CheckpointBytes), timeoutOf: "Update"}
	gen, err := c.generation(ctx)
	if err != nil {
		return err
	}
	payload, err := updatePayload(gen, info)
	if err != nil {
		return c.errorf(cl, 0, nil, "%v", err)
	}
	_, err = c.do(ctx, withBody(cl, map[string]any{"update_info": payload}), nil)
	return err
}

// UpdateWeightsPerWorker calls update_weights with update_info as a list:
// infos[k] is the payload of inference worker k, k = data_parallel_index *
// (TP*PP) + rank, so there is one per rank of the server's world size with
// data parallelism (GET /get_world_size). Only E takes a list; dense NCCL
// and disk updates send one object (UpdateWeights), and so do ipc ones,
// which are refused here (their handles are keyed by GPU UUID, so one
// object serves every worker). Never retried.
func (c *Client) UpdateWeightsPerWorker(ctx context.Context, infos []UpdateInfo) error {
	var size int64
	for _, in := range infos {
		size = max(size, in.CheckpointBytes)
	}
	cl := call{method: http.MethodPost, path: "/update_weights", timeout: c.opts.Timeouts.update(size), timeoutOf: "Update"}
	gen, err := c.generation(ctx)
	if err != nil {
		return err
	}
	if !gen.TakesUpdateInfoList() {
		return c.errorf(cl, 0, nil, "update_info as a list (one payload per inference worker) needs generation E, server is %s", gen)
	}
	for k, in := range infos {
		if in.IPCHandlesPickled != "" {
			return c.errorf(cl, 0, nil, "update_info[%d]: the ipc backend sends one update_info object (UpdateWeights), not one per worker", k)
		}
	}
	workers, err := c.WorldSize(ctx, true)
	if err != nil {
		return err
	}
	if len(infos) != workers {
		return c.errorf(cl, 0, nil, "update_info list has %d payloads, the server has %d inference workers (world size with data parallelism): one each", len(infos), workers)
	}
	payloads := make([]any, len(infos))
	for k, in := range infos {
		p, err := updatePayload(gen, in)
		if err != nil {
			return c.errorf(cl, 0, nil, "update_info[%d]: %v", k, err)
		}
		payloads[k] = p
	}
	_, err = c.do(ctx, withBody(cl, map[string]any{"update_info": payloads}), nil)
	return err
}

func updatePayload(gen Generation, info UpdateInfo) (any, error) {
	if info.Path != "" {
		if info.IPCHandlesPickled != "" {
			return nil, fmt.Errorf("update_info: path (disk) and ipc_handles_pickled (ipc) are exclusive")
		}
		if len(info.Names) > 0 || len(info.DTypeNames) > 0 || len(info.Shapes) > 0 || info.Packed {
			return nil, fmt.Errorf("update_info: path (disk) and NCCL tensor metadata are exclusive")
		}
		if !filepath.IsAbs(info.Path) {
			return nil, fmt.Errorf("update_info: path %q must be absolute (every worker resolves it)", info.Path)
		}
		if err := sessionBackend(gen, "disk"); err != nil {
			return nil, err
		}
		return diskUpdateInfo{Path: info.Path}, nil
	}
	// A length mismatch makes vLLM wait for bytes that never come (or send
	// the trainer's broadcasts nowhere): refuse it before any byte moves.
	n := len(info.Names)
	if n == 0 {
		return nil, fmt.Errorf("update_info: no tensors (names is empty) and no path")
	}
	if len(info.DTypeNames) != n || len(info.Shapes) != n {
		return nil, fmt.Errorf("update_info: %d names, %d dtype_names, %d shapes: lengths must match", n, len(info.DTypeNames), len(info.Shapes))
	}
	shapes := make([][]int64, n)
	for i, s := range info.Shapes {
		for _, d := range s {
			if d < 0 {
				return nil, fmt.Errorf("update_info: tensor %q has negative dimension in shape %v", info.Names[i], s)
			}
		}
		shapes[i] = append([]int64{}, s...) // [] for a scalar, never null
	}
	if info.IPCHandlesPickled != "" {
		return ipcPayload(gen, info, shapes)
	}
	if err := checkPacked(info.Packed, info.PackedBufferSizeBytes, info.PackedNumBuffers); err != nil {
		return nil, err
	}
	p := ncclUpdateInfo{Names: info.Names, DTypeNames: info.DTypeNames, Shapes: shapes}
	switch gen {
	case GenA:
		if info.PackedBufferSizeBytes != 0 || info.PackedNumBuffers != 0 {
			return nil, fmt.Errorf("generation A derives the packed chunk size itself: packed buffer settings cannot be sent")
		}
		p.Packed = info.Packed
	case GenB, GenC:
		p.Packed, p.PackedBufferSizeBytes, p.PackedNumBuffers = info.Packed, info.PackedBufferSizeBytes, info.PackedNumBuffers
	}
	return p, nil
}

// ipcPayload is update_info of the ipc backend, one object on every
// generation that has it. The handles' count cannot be checked without
// unpickling them; EncodeIPCHandles wrote one per tensor.
func ipcPayload(gen Generation, info UpdateInfo, shapes [][]int64) (any, error) {
	if info.Packed || info.PackedBufferSizeBytes != 0 || info.PackedNumBuffers != 0 {
		return nil, fmt.Errorf("update_info: the ipc backend is not packed here (vLLM's packed ipc variant is not built)")
	}
	if _, err := base64.StdEncoding.Strict().DecodeString(info.IPCHandlesPickled); err != nil {
		return nil, fmt.Errorf("update_info: ipc_handles_pickled is not standard base64: %w", err)
	}
	if err := sessionBackend(gen, "ipc"); err != nil {
		return nil, err
	}
	return ipcUpdateInfo{Names: info.Names, DTypeNames: info.DTypeNames, Shapes: shapes, IPCHandlesPickled: info.IPCHandlesPickled}, nil
}

// FinishWeightUpdate closes the update session (C, D), recording version
// when it is not empty ({"weight_version": version}). On A it calls
// /finalize_weight_update; B has neither, so it returns nil without a
// request. A and B do not track versions: version is not sent there. Never
// retried.
func (c *Client) FinishWeightUpdate(ctx context.Context, version string) error {
	gen, err := c.generation(ctx)
	if err != nil {
		return err
	}
	cl := call{method: http.MethodPost, path: "/finish_weight_update", body: struct{}{}, timeout: c.opts.Timeouts.control(), timeoutOf: "Control"}
	switch {
	case gen == GenA:
		cl.path = "/finalize_weight_update"
	case gen == GenB:
		return nil
	case version != "":
		cl.body = map[string]string{"weight_version": version}
	}
	_, err = c.do(ctx, cl, nil)
	return err
}

// SessionCloseTimeout bounds closing an update session after a failed
// update (CloseUpdateSession): cleanup must not turn a failure into a hang.
const SessionCloseTimeout = 10 * time.Second

// StartUpdateSession opens an update session (StartWeightUpdate). With
// closeStale, the caller knows that any session already open belongs to a
// trainer that is gone (a killed worker, a lost group): a start refused
// with a 5xx then closes that session and starts once more.
func (c *Client) StartUpdateSession(ctx context.Context, closeStale bool) error {
	err := c.StartWeightUpdate(ctx)
	var e *Error
	if err == nil || !closeStale || !errors.As(err, &e) || e.Status < http.StatusInternalServerError {
		return err
	}
	if c.CloseUpdateSession(ctx, "") != nil {
		return err
	}
	if err2 := c.StartWeightUpdate(ctx); err2 != nil {
		return fmt.Errorf("%w (closed a session left open, then start failed again: %v)", err, err2)
	}
	return nil
}

// CloseUpdateSession finishes the update session, recording version when
// it is not empty, even when ctx is already done and within
// SessionCloseTimeout: a cancelled or failed update must not leave the
// server mid-update, and a server that does not answer must not hang it.
// A server that answers that no session is open (NoSessionOpen) had none
// to close: that is returned as the error, for the caller to tell apart.
func (c *Client) CloseUpdateSession(ctx context.Context, version string) error {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), SessionCloseTimeout)
	defer cancel()
	return c.FinishWeightUpdate(cctx, version)
}

// LabelWeights sets the weight version of a server whose session is
// already closed (update_weight_version), bounded like CloseUpdateSession
// and even when ctx is done: after an E server closed a failed update's
// session itself, this records that its weights are the failed version's.
func (c *Client) LabelWeights(ctx context.Context, version string) error {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), SessionCloseTimeout)
	defer cancel()
	return c.UpdateWeightVersion(cctx, version)
}

// noSessionMessages are how vLLM's workers (and the double) refuse to
// finish when no update session is open: the newest builds, whose worker
// closes a failed update's session itself, and the older wording.
var noSessionMessages = []string{
	"without a matching start_weight_update",
	"without an open weight update session",
}

// NoSessionOpen reports whether err is a server's refusal to finish an
// update session because none is open: after a failed update, the server
// closed it itself (spec section 8), so nothing was left mid-update.
func NoSessionOpen(err error) bool {
	var e *Error
	if !errors.As(err, &e) || e.Status < http.StatusInternalServerError || !strings.HasSuffix(e.Call, "/finish_weight_update") {
		return false
	}
	for _, m := range noSessionMessages {
		if strings.Contains(e.Message, m) {
			return true
		}
	}
	return false
}

// UpdateWeightVersion sets the server's weight version label (C, D).
func (c *Client) UpdateWeightVersion(ctx context.Context, version string) error {
	cl := call{method: http.MethodPost, path: "/update_weight_version", timeout: c.opts.Timeouts.control(), timeoutOf: "Control",
		body: map[string]string{"new_version": version}}
	if err := c.needSessions(ctx, cl); err != nil {
		return err
	}
	if version == "" {
		return c.errorf(cl, 0, nil, "new_version is empty")
	}
	_, err := c.do(ctx, cl, nil)
	return err
}

// WeightInfo returns the server's weight version (C, D); "" when the server
// reports none yet (null). A numeric version is returned in decimal.
func (c *Client) WeightInfo(ctx context.Context) (string, error) {
	cl := call{method: http.MethodGet, path: "/weight_info", timeout: c.opts.Timeouts.control(), idempotent: true, timeoutOf: "Control"}
	if err := c.needSessions(ctx, cl); err != nil {
		return "", err
	}
	var v struct {
		WeightVersion json.RawMessage `json:"weight_version"`
	}
	if _, err := c.do(ctx, cl, &v); err != nil {
		return "", err
	}
	raw := v.WeightVersion
	if len(raw) == 0 {
		return "", c.errorf(cl, http.StatusOK, nil, "response has no weight_version")
	}
	if string(raw) == "null" {
		return "", nil
	}
	if s, ok := ScalarText(raw); ok {
		return s, nil
	}
	return "", c.errorf(cl, http.StatusOK, nil, "weight_version %s is neither a string nor a number", clip(string(raw)))
}

// WeightChecker runs the server's weight checker (C, D, E): action
// "checksum" ({"checksums": {key: checksum}}, keys per shard:
// dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:{name}), "reset" (which zeroes the
// weights) or "compare" with baseline, the "checksums" map of an earlier
// checksum answer (nil omits it). Some routers lack the route (404), some
// answer 409 while paused, the newest do not. It reads every weight, so it
// runs under the update deadline. Not retried (reset changes state).
func (c *Client) WeightChecker(ctx context.Context, action string, baseline any) (json.RawMessage, error) {
	body := map[string]any{"action": action}
	if baseline != nil {
		body["baseline"] = baseline
	}
	cl := call{method: http.MethodPost, path: "/weight_checker", body: body, timeout: c.opts.Timeouts.update(0), timeoutOf: "Update"}
	if err := c.needSessions(ctx, cl); err != nil {
		return nil, err
	}
	if action == "" {
		return nil, c.errorf(cl, 0, nil, "action is empty (checksum, reset or compare)")
	}
	var out json.RawMessage
	if _, err := c.do(ctx, cl, &out); err != nil {
		return nil, err
	}
	return out, nil
}

func (c *Client) needSessions(ctx context.Context, cl call) error {
	gen, err := c.generation(ctx)
	if err != nil {
		return err
	}
	if !gen.HasSessions() {
		return c.errorf(cl, 0, nil, "not available on generation %s (C or D needed)", gen)
	}
	return nil
}
