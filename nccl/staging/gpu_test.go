package staging

// GPU tests and benchmarks: real NCCL and CUDA through nccl.Load, rank 0 in
// this process and tests/gpu/receiver.py (a vLLM-like worker) or
// tests/gpu/bench_torch.py as the other ranks, placed by gputest.Place:
// with one GPU (or RLFLOW_GPU_PLACEMENT=single) all on one GPU with a
// distinct NCCL_HOSTID per process; with at least as many GPUs as ranks
// rank r on GPU r, no NCCL_HOSTID, NCCL_NVLS_ENABLE=0 (P2P/NVLink). They
// skip, naming the missing library, where NCCL or the CUDA runtime cannot
// be loaded or no GPU is visible. nccl/GPU.md has the commands.
//
// Environment:
//
//	RLFLOW_GPU_DIR     where the generated checkpoints live (default $TMPDIR/rlflow-gpu)
//	RLFLOW_GPU_LAYERS  decoder layers of the big checkpoint (default 40: ~4.1 GiB bf16, 371 tensors)
//	RLFLOW_GPU_LOGS    where process logs and figures.json go (default ./gpu-logs)
//	RLFLOW_GPU_SCRIPTS directory of receiver.py and bench_torch.py (default: the repository's tests/gpu)
//	RLFLOW_PYTHON      the Python with torch (default python3)
//	RLFLOW_GPU_DEVICE  CUDA device for every rank in single placement (default 0)
//	RLFLOW_GPU_PLACEMENT single|spread (default: spread where the GPUs are at least the ranks)
//	RLFLOW_GPU_BENCH_WORLD ranks of TestGPUBenchE2E and TestGPUBenchRaw (default 2)

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil/gputest"
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/safetensors"
)

// ---- figures ----

var figures struct {
	sync.Mutex
	m map[string]any
}

// figure records a measured value for the final report and figures.json.
func figure(t *testing.T, key string, v any) {
	figures.Lock()
	defer figures.Unlock()
	if figures.m == nil {
		figures.m = map[string]any{}
	}
	figures.m[key] = v
	t.Logf("FIGURE %s = %v", key, v)
	b, _ := json.MarshalIndent(figures.m, "", "  ")
	_ = os.WriteFile(filepath.Join(gputest.LogDir(t, "gpu-logs"), "figures.json"), b, 0o644)
}

// ---- checkpoints ----

// splitmix64 fills tensors quickly with distinct bytes.
func splitmix(seed uint64, b []byte) {
	x := seed
	for i := 0; i+8 <= len(b); i += 8 {
		x += 0x9e3779b97f4a7c15
		z := x
		z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		binary.LittleEndian.PutUint64(b[i:], z^z>>31)
	}
	for i := len(b) &^ 7; i < len(b); i++ {
		b[i] = byte(seed>>3) + byte(i)
	}
}

type genSpec struct {
	name  string
	dtype safetensors.DType
	shape []int64
}

// bigSpec is a decoder-shaped bf16 model (hidden 2048, MLP 5632, vocab
// 32000) plus tensors of awkward sizes and other dtypes.
func bigSpec(layers int) []genSpec {
	const h, inter, vocab = 2048, 5632, 32000
	s := []genSpec{
		{"model.embed_tokens.weight", safetensors.BF16, []int64{vocab, h}},
		{"odd.one", safetensors.BF16, []int64{1}},
		{"odd.three", safetensors.BF16, []int64{3}},
		{"odd.4097", safetensors.BF16, []int64{4097}},
		{"odd.3x5x7", safetensors.BF16, []int64{3, 5, 7}},
		{"odd.scalar", safetensors.F32, []int64{}},
		{"odd.65537", safetensors.BF16, []int64{65537}},
		{"odd.i64", safetensors.I64, []int64{7}},
		{"odd.f32", safetensors.F32, []int64{1023}},
	}
	for l := 0; l < layers; l++ {
		p := fmt.Sprintf("model.layers.%d.", l)
		s = append(s,
			genSpec{p + "input_layernorm.weight", safetensors.BF16, []int64{h}},
			genSpec{p + "self_attn.q_proj.weight", safetensors.BF16, []int64{h, h}},
			genSpec{p + "self_attn.k_proj.weight", safetensors.BF16, []int64{h, h}},
			genSpec{p + "self_attn.v_proj.weight", safetensors.BF16, []int64{h, h}},
			genSpec{p + "self_attn.o_proj.weight", safetensors.BF16, []int64{h, h}},
			genSpec{p + "post_attention_layernorm.weight", safetensors.BF16, []int64{h}},
			genSpec{p + "mlp.gate_proj.weight", safetensors.BF16, []int64{inter, h}},
			genSpec{p + "mlp.up_proj.weight", safetensors.BF16, []int64{inter, h}},
			genSpec{p + "mlp.down_proj.weight", safetensors.BF16, []int64{h, inter}},
		)
	}
	return append(s,
		genSpec{"model.norm.weight", safetensors.BF16, []int64{h}},
		genSpec{"lm_head.weight", safetensors.BF16, []int64{vocab, h}},
	)
}

// f32Spec is a small all-F32 model (finite values) for the F32 -> BF16 test.
func f32Spec() []genSpec {
	s := []genSpec{{"odd.one", safetensors.F32, []int64{1}}, {"odd.4097", safetensors.F32, []int64{4097}},
		{"odd.empty", safetensors.F32, []int64{0, 16}}} // a zero-size tensor: vLLM broadcasts it too (count 0)
	for l := 0; l < 8; l++ {
		s = append(s, genSpec{fmt.Sprintf("layers.%d.w", l), safetensors.F32, []int64{1024, 1024 + int64(l)}},
			genSpec{fmt.Sprintf("layers.%d.b", l), safetensors.F32, []int64{1024 + int64(l)}})
	}
	return s
}

var ckptMu sync.Mutex

// genCheckpoint writes (or reuses) the checkpoint for spec under name.
func genCheckpoint(t *testing.T, name string, spec []genSpec, finite bool) string {
	t.Helper()
	ckptMu.Lock()
	defer ckptMu.Unlock()
	dir := os.Getenv("RLFLOW_GPU_DIR")
	if dir == "" {
		dir = filepath.Join(os.TempDir(), "rlflow-gpu")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, name+".safetensors")
	sig := fmt.Sprintf("%d tensors, first %s, last %s %v, finite %v, v1", len(spec), spec[0].name, spec[len(spec)-1].name, spec[len(spec)-1].shape, finite)
	if f, err := safetensors.Open(path); err == nil {
		ok := f.Metadata()["rlflow_gen"] == sig
		f.Close()
		if ok {
			t.Logf("reusing %s", path)
			return path
		}
	}
	start := time.Now()
	wt := make([]safetensors.WriteTensor, len(spec))
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	var total int64
	for i, s := range spec {
		n := int64(1)
		for _, d := range s.shape {
			n *= d
		}
		data := make([]byte, n*int64(s.dtype.ItemSize()))
		total += int64(len(data))
		wt[i] = safetensors.WriteTensor{Name: s.name, DType: s.dtype, Shape: s.shape, Data: data}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if finite && s.dtype == safetensors.F32 {
				for j := 0; j < len(data); j += 4 {
					v := float32(math.Sin(float64(i*7919+j))) * 3
					binary.LittleEndian.PutUint32(data[j:], math.Float32bits(v))
				}
				return
			}
			splitmix(uint64(i+1)*0x1234567, data)
		}()
	}
	wg.Wait()
	if err := safetensors.Write(path, wt, map[string]string{"rlflow_gen": sig}); err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %s: %d tensors, %d bytes in %v", path, len(spec), total, time.Since(start))
	return path
}

// ---- layouts and metadata ----

// gpuLayout is the production layout (Plan, i.e. nccl/plan); receiver.py
// plans the same sequence on its own from the metadata and would hang or
// report wrong bytes if they disagreed.
func gpuLayout(t *testing.T, ck *safetensors.Checkpoint, packed bool, threshold int64, toBF16 bool) Update {
	t.Helper()
	wire := KeepDType
	if toBF16 {
		wire = F32ToBF16
	}
	u, err := Plan(ck.Tensors(), packed, threshold, wire)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// writeMeta writes what update_info would carry (names, dtype_names,
// shapes from Update.UpdateInfo, plus the packed fields) for the receivers.
func writeMeta(t *testing.T, ckptPath string, u Update) string {
	t.Helper()
	info, err := u.Metadata()
	if err != nil {
		t.Fatal(err)
	}
	meta := map[string]any{
		"names": info.Names, "dtype_names": info.DTypeNames, "shapes": info.Shapes,
		"packed": u.Packed, "packed_buffer_size_bytes": u.Threshold, "checkpoint": ckptPath,
	}
	b, _ := json.Marshal(meta)
	p := filepath.Join(t.TempDir(), "meta.json")
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// ---- processes ----

type proc struct {
	name   string
	cmd    *exec.Cmd
	lines  chan string // "READY ..." / "PROGRESS ..." / "RESULT ..." from stdout
	result map[string]any
	done   chan struct{}
	err    error
	mu     sync.Mutex
}

// launch runs a Python script with its own NCCL_HOSTID, logging its output.
func launch(t *testing.T, name, hostID string, args ...string) *proc {
	t.Helper()
	return launchEnv(t, name, []string{"NCCL_HOSTID=" + hostID}, args...)
}

// launchEnv runs a Python script with env added to this process's
// environment (a Placement's ProcEnv: its own NCCL_HOSTID in single
// placement, nothing in spread), logging its output.
func launchEnv(t *testing.T, name string, env []string, args ...string) *proc {
	t.Helper()
	py := gputest.Python()
	cmd := exec.Command(py, args...)
	cmd.Env = append(append(os.Environ(), env...), "PYTHONUNBUFFERED=1")
	// A process of the same name launched again in the same test (the
	// benchmarks' rounds) gets name.2.log, name.3.log, ...: none is lost.
	base := filepath.Join(gputest.LogDir(t, "gpu-logs"), strings.NewReplacer("/", "_", " ", "_").Replace(t.Name())+"."+name)
	var logf *os.File
	for i := 1; logf == nil; i++ {
		logPath := base + ".log"
		if i > 1 {
			logPath = fmt.Sprintf("%s.%d.log", base, i)
		}
		f, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		switch {
		case err == nil:
			logf = f
		case !errors.Is(err, fs.ErrExist):
			t.Fatal(err)
		}
	}
	cmd.Stderr = logf
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(logf, "$ %s%s %s\n", strings.Join(append(env, ""), " "), py, strings.Join(args, " "))
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{name: name, cmd: cmd, lines: make(chan string, 1024), done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 1<<20), 16<<20)
		for sc.Scan() {
			line := sc.Text()
			fmt.Fprintln(logf, "stdout:", line)
			if strings.HasPrefix(line, "RESULT ") {
				var m map[string]any
				if json.Unmarshal([]byte(line[len("RESULT "):]), &m) == nil {
					p.mu.Lock()
					p.result = m
					p.mu.Unlock()
				}
			}
			select {
			case p.lines <- line:
			default:
			}
		}
		p.err = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	t.Cleanup(func() { p.kill(); <-p.done })
	return p
}

func (p *proc) kill() {
	select {
	case <-p.done:
	default:
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
	}
}

// waitFor waits for a stdout line with the prefix, or the process's exit.
func (p *proc) waitFor(ctx context.Context, prefix string) (string, error) {
	for {
		select {
		case l := <-p.lines:
			if strings.HasPrefix(l, prefix) {
				return l, nil
			}
		case <-p.done:
			// Drain what was printed before the exit.
			for {
				select {
				case l := <-p.lines:
					if strings.HasPrefix(l, prefix) {
						return l, nil
					}
				default:
					return "", fmt.Errorf("%s exited (%v) before printing %s", p.name, p.err, prefix)
				}
			}
		case <-ctx.Done():
			return "", fmt.Errorf("%s: waiting for %s: %w", p.name, prefix, ctx.Err())
		}
	}
}

// finish waits for the process and returns its RESULT line.
func (p *proc) finish(ctx context.Context) (map[string]any, error) {
	select {
	case <-p.done:
	case <-ctx.Done():
		p.kill()
		<-p.done
		return nil, fmt.Errorf("%s: %w", p.name, ctx.Err())
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.result == nil {
		return nil, fmt.Errorf("%s exited (%v) without a RESULT line (see its log)", p.name, p.err)
	}
	return p.result, nil
}

func num(m map[string]any, k string) float64 {
	f, _ := m[k].(float64)
	return f
}

// rendezvousWith starts the receivers (ranks 1..pl.World-1) from init (as
// the HTTP call would make vLLM's workers join) and returns once every one
// of them is READY; rank 0 is on pl.Trainer.
func rendezvousWith(ctx context.Context, t *testing.T, lib nccl.API, pl gputest.Placement, receiverArgs func(rank, port int) []string) (*nccl.Comm, []*proc, error) {
	var procs []*proc
	init := func(ctx context.Context, port int, _ nccl.UniqueID) error {
		for r := 1; r < pl.World; r++ {
			procs = append(procs, launchEnv(t, fmt.Sprintf("rank%d", r), pl.ProcEnv(fmt.Sprintf("rlflow-worker%d", r)), receiverArgs(r, port)...))
		}
		for _, p := range procs {
			if _, err := p.waitFor(ctx, "READY"); err != nil {
				return err
			}
		}
		return nil
	}
	comm, err := Rendezvous(ctx, RendezvousConfig{MasterAddress: "127.0.0.1", WorldSize: pl.World, Device: pl.Trainer}, lib, init)
	return comm, procs, err
}

// receiverArgs is receiver.py's command line for rank: world pl.World, on
// the rank's device.
func receiverArgs(t *testing.T, pl gputest.Placement, meta string, extra ...string) func(rank, port int) []string {
	script := gputest.Script(t, "receiver.py")
	return func(rank, port int) []string {
		return append([]string{script, "--host", "127.0.0.1", "--port", strconv.Itoa(port),
			"--world-size", strconv.Itoa(pl.World), "--rank", strconv.Itoa(rank), "--device", strconv.Itoa(pl.Device(rank)),
			"--meta", meta}, extra...)
	}
}

// ---- tests ----

// TestGPUBroadcastToReceivers: the real wire sequence to vLLM-like
// receivers, world sizes 2 and 3 (and 4 and 8 where spread placement has
// that many GPUs), packed and not, checked byte for byte.
func TestGPUBroadcastToReceivers(t *testing.T) {
	lib := gputest.Lib(t)
	path := genCheckpoint(t, "big", bigSpec(gputest.EnvInt(t, "RLFLOW_GPU_LAYERS", 40)), false)
	f32path := genCheckpoint(t, "f32", f32Spec(), true)
	cases := []struct {
		name      string
		path      string
		world     int
		packed    bool
		threshold int64
		toBF16    bool
		spread    bool // only with spread placement (one GPU per rank)
	}{
		{"W2-packed-256MiB", path, 2, true, 256 << 20, false, false},
		{"W2-nonpacked", path, 2, false, 0, false, false},
		{"W3-packed-1GiB", path, 3, true, 1 << 30, false, false},
		{"W3-nonpacked", path, 3, false, 0, false, false},
		{"W2-packed-f32-to-bf16", f32path, 2, true, 1 << 20, true, false},
		// Also broadcasts a zero-size tensor (count 0), as vLLM does.
		{"W2-nonpacked-f32-to-bf16-with-empty", f32path, 2, false, 0, true, false},
		// Multi-GPU hosts (issue 5): one GPU per rank, P2P/NVLink.
		{"W4-packed-1GiB", path, 4, true, 1 << 30, false, true},
		{"W4-nonpacked", path, 4, false, 0, false, true},
		{"W8-packed-1GiB", path, 8, true, 1 << 30, false, true},
		{"W8-nonpacked", path, 8, false, 0, false, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pl := gputest.Place(t, tc.world)
			if tc.spread && !pl.Spread() {
				t.Skipf("skipping: world size %d runs only with spread placement (one GPU per rank): %d GPUs visible, %s=%q",
					tc.world, pl.Devices, gputest.EnvPlacement, os.Getenv(gputest.EnvPlacement))
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			ck, err := safetensors.OpenCheckpoint(tc.path)
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			u := gpuLayout(t, ck, tc.packed, tc.threshold, tc.toBF16)
			chunks := u.Chunks
			meta := writeMeta(t, tc.path, u)
			t0 := time.Now()
			comm, procs, err := rendezvousWith(ctx, t, lib, pl, receiverArgs(t, pl, meta))
			if err != nil {
				gputest.Verdict(t, false, "rendezvous: %v", err)
				return
			}
			defer comm.Close(context.Background())
			rdv := time.Since(t0)
			pipe, err := NewStager(ctx, comm.Device(), MaxChunk(chunks), Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer pipe.Close(context.Background())
			res, err := pipe.Broadcast(ctx, comm, ck, chunks)
			if err != nil {
				gputest.Verdict(t, false, "broadcast: %v", err)
				return
			}
			t.Logf("rendezvous %v; %v", rdv, res)
			figure(t, tc.name+".placement", pl.Mode)
			figure(t, tc.name+".go_wall_s", res.Wall.Seconds())
			figure(t, tc.name+".go_GBps", res.Throughput()/1e9)
			for _, p := range procs {
				r, err := p.finish(ctx)
				if err != nil {
					gputest.Verdict(t, false, "%s: %v", p.name, err)
					continue
				}
				ok := r["verdict"] == "PASS" && int(num(r, "broadcasts")) == len(chunks) && int64(num(r, "bytes")) == res.Bytes
				gputest.Verdict(t, ok, "%s: %v, %d broadcasts, %d bytes, %d tensors verified byte for byte (%.0f converted), receiver %.2f GB/s; mismatches %v",
					p.name, r["verdict"], int(num(r, "broadcasts")), int64(num(r, "bytes")), int(num(r, "tensors")), num(r, "converted"), num(r, "gbps"), r["mismatches"])
			}
		})
	}
}

// TestGPUKilledReceiver: SIGKILL the receiver mid-transfer; the broadcast
// must end within its deadline with a clear error, not hang.
func TestGPUKilledReceiver(t *testing.T) {
	lib := gputest.Lib(t)
	pl := gputest.Place(t, 2)
	path := genCheckpoint(t, "big", bigSpec(gputest.EnvInt(t, "RLFLOW_GPU_LAYERS", 40)), false)
	ck, err := safetensors.OpenCheckpoint(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	const threshold = 64 << 20
	u := gpuLayout(t, ck, true, threshold, false)
	chunks := u.Chunks
	meta := writeMeta(t, path, u)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	comm, procs, err := rendezvousWith(ctx, t, lib, pl, receiverArgs(t, pl, meta, "--progress", "--no-verify"))
	if err != nil {
		t.Fatal(err)
	}
	defer comm.Close(context.Background())
	pipe, err := NewStager(ctx, comm.Device(), MaxChunk(chunks), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer pipe.Close(context.Background())

	const deadline = 60 * time.Second
	var killedAt time.Time
	go func() {
		// Kill once the receiver has two chunks: the trainer is then deep in
		// the sequence with broadcasts in flight.
		for {
			l, err := procs[0].waitFor(ctx, "PROGRESS")
			if err != nil {
				return
			}
			var m map[string]any
			_ = json.Unmarshal([]byte(strings.TrimPrefix(l, "PROGRESS ")), &m)
			if num(m, "index") >= 1 {
				killedAt = time.Now()
				procs[0].kill()
				return
			}
		}
	}()
	bctx, bcancel := context.WithTimeout(ctx, deadline)
	defer bcancel()
	start := time.Now()
	_, err = pipe.Broadcast(bctx, comm, ck, chunks)
	took := time.Since(start)
	<-procs[0].done
	if killedAt.IsZero() {
		gputest.Verdict(t, false, "receiver was never killed (broadcast returned %v after %v)", err, took)
		return
	}
	after := time.Since(killedAt)
	figure(t, "killed_receiver.error_after_kill_s", after.Seconds())
	ok := err != nil && errors.Is(err, nccl.ErrAborted) && took < deadline+10*time.Second
	how := "the deadline"
	if err != nil && !errors.Is(err, context.DeadlineExceeded) {
		how = "an NCCL error"
	}
	gputest.Verdict(t, ok, "broadcast ended %.1fs after the kill through %s (deadline %v): %v", after.Seconds(), how, deadline, err)
	if !errors.Is(comm.Err(), nccl.ErrAborted) {
		gputest.Verdict(t, false, "communicator not poisoned after the failure")
	}
}

// TestGPUPeerNeverJoins: real non-blocking init with a missing peer ends at
// the deadline and aborts cleanly.
func TestGPUPeerNeverJoins(t *testing.T) {
	lib := gputest.Lib(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	_, err := Rendezvous(ctx, RendezvousConfig{MasterAddress: "127.0.0.1", WorldSize: 2, Device: gputest.Device(t)}, lib,
		func(ctx context.Context, port int, _ nccl.UniqueID) error { <-ctx.Done(); return ctx.Err() })
	took := time.Since(start)
	gputest.Verdict(t, errors.Is(err, context.DeadlineExceeded) && took < 20*time.Second,
		"rendezvous without a peer ended after %.1fs: %v", took.Seconds(), err)
}

// TestPlacedReceivers (CPU): the receivers' command lines and environment
// follow the placement: single keeps every rank on RLFLOW_GPU_DEVICE with
// its own NCCL_HOSTID, spread puts rank r on GPU r with none.
func TestPlacedReceivers(t *testing.T) {
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 not on PATH: this test runs the GPU tests' Python scripts (tests/gpu); .ci/run installs it")
	}
	t.Setenv("RLFLOW_GPU_LOGS", t.TempDir())
	t.Setenv("NCCL_HOSTID", "")
	os.Unsetenv("NCCL_HOSTID")
	script := filepath.Join(t.TempDir(), "env.py")
	os.WriteFile(script, []byte(`import os, json
print("RESULT " + json.dumps({"verdict": "PASS", "hostid": os.environ.get("NCCL_HOSTID", "")}), flush=True)
`), 0o644)
	for _, c := range []struct {
		devices, world int
		devs           string
		host           string
	}{
		{1, 3, "[2 2]", "rlflow-worker2"}, // single: RLFLOW_GPU_DEVICE=2 for everyone
		{4, 3, "[1 2]", ""},               // spread
	} {
		pl, err := gputest.Decide("", c.devices, c.world, 2)
		if err != nil {
			t.Fatal(err)
		}
		var devs []string
		for r := 1; r < pl.World; r++ {
			a := receiverArgs(t, pl, "meta.json")(r, 1234)
			for i := range a {
				if a[i] == "--device" {
					devs = append(devs, a[i+1])
				}
				if a[i] == "--world-size" && a[i+1] != strconv.Itoa(c.world) {
					t.Errorf("%v: --world-size %s", pl, a[i+1])
				}
			}
		}
		if got := "[" + strings.Join(devs, " ") + "]"; got != c.devs {
			t.Errorf("%v: receiver devices %s, want %s", pl, got, c.devs)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		r, err := launchEnv(t, fmt.Sprintf("env-%s", pl.Mode), pl.ProcEnv("rlflow-worker2"), script).finish(ctx)
		cancel()
		if err != nil || r["hostid"] != c.host {
			t.Errorf("%v: receiver NCCL_HOSTID %q (%v), want %q", pl, r["hostid"], err, c.host)
		}
	}
}
