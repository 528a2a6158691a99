package ncclengine

// The GPU test of the snapshot path (issue 18), beside gpu_test.go and with
// its conventions: real NCCL and CUDA through nccl.Load, rank 0 in this
// process, every vLLM server played by tests/gpu/receiver.py --http, and the
// resident trainer's snapshot played by tests/gpu/snapshot_export.py (torch
// on the trainer's GPU, exported with CUDA IPC exactly as PROTOCOL.md's
// publish reply describes). It skips, naming what is missing, where NCCL or
// the CUDA runtime cannot be loaded, no GPU is visible, or the Python cannot
// import torch with CUDA. nccl/GPU.md has the command.
//
// Environment: gpu_test.go's, and RLFLOW_SNAPSHOT_LAYERS (the exporter's
// --layers, default 8: about 0.15 GiB).

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/gpuhealth"
	"github.com/rlflow/rlflow/internal/testutil/gputest"
	"github.com/rlflow/rlflow/nccl/cudaipc"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/trainer"
	"github.com/rlflow/rlflow/transfer"
	"github.com/rlflow/rlflow/vllm"
)

// publishReply is snapshot_export.py's READY / PUBLISHED line: the publish
// reply of PROTOCOL.md plus the SHA-256 of every tensor.
type publishReply struct {
	Version         string            `json:"version"`
	IPC             string            `json:"ipc"`
	Handle          []byte            `json:"handle"` // standard base64 in the JSON
	StorageBytes    int64             `json:"storage_bytes"`
	StorageOffset   int64             `json:"storage_offset"`
	Device          int               `json:"device"`
	GPUUUID         string            `json:"gpu_uuid"`
	RawTensors      []replyTensor     `json:"tensors"`
	SnapshotSeconds float64           `json:"snapshot_seconds"`
	PID             int               `json:"pid"`
	Torch           string            `json:"torch"`
	SHA256          map[string]string `json:"sha256"`
}

type replyTensor struct {
	Name   string  `json:"name"`
	DType  string  `json:"dtype"`
	Shape  []int64 `json:"shape"`
	Offset int64   `json:"offset"`
	Bytes  int64   `json:"bytes"`
}

// snapshot is the reply as the GPU worker hands it to the engine.
func (r publishReply) snapshot() *trainer.Snapshot {
	s := &trainer.Snapshot{Version: r.Version, IPC: r.IPC, Handle: r.Handle, StorageBytes: r.StorageBytes,
		StorageOffset: r.StorageOffset, Device: r.Device, GPUUUID: r.GPUUUID, Owner: fmt.Sprintf("pid-%d/gen-1", r.PID),
		SnapshotSeconds: r.SnapshotSeconds}
	for _, t := range r.RawTensors {
		s.Tensors = append(s.Tensors, trainer.Tensor{Name: t.Name, DType: t.DType, Shape: t.Shape, Offset: t.Offset, Bytes: t.Bytes})
	}
	return s
}

// snapshotExporter is snapshot_export.py, alive until "exit" (its stdin is
// the importer's hold on it).
type snapshotExporter struct {
	stdin io.WriteCloser
	lines chan string   // stdout lines
	done  chan struct{} // closed once it exited
	log   string
}

func startSnapshotExporter(t *testing.T, device, layers int) *snapshotExporter {
	t.Helper()
	py := gputest.Python()
	args := []string{gputest.Script(t, "snapshot_export.py"), "--device", strconv.Itoa(device), "--layers", strconv.Itoa(layers)}
	logPath := filepath.Join(gputest.LogDir(t, "gpu-logs"), strings.ReplaceAll(t.Name(), "/", "_")+".exporter.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(logf, "$ %s %s\n", py, strings.Join(args, " "))
	cmd := exec.Command(py, args...)
	cmd.Env = append(os.Environ(), "PYTHONUNBUFFERED=1")
	cmd.Stderr = logf
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start the exporter %s: %v", py, err)
	}
	e := &snapshotExporter{stdin: stdin, lines: make(chan string, 16), done: make(chan struct{}), log: logPath}
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 16<<20)
		for sc.Scan() {
			fmt.Fprintln(logf, "stdout:", sc.Text())
			select {
			case e.lines <- sc.Text():
			default: // nobody waits for it any more: the log has it
			}
		}
		cmd.Wait()
		logf.Close()
		close(e.done)
	}()
	t.Cleanup(func() {
		select {
		case <-e.done:
		default:
			_ = cmd.Process.Signal(syscall.SIGKILL)
			<-e.done
		}
	})
	return e
}

// next returns the next stdout line's word and the rest, skipping lines
// with other words.
func (e *snapshotExporter) next(ctx context.Context, words ...string) (string, string, error) {
	for {
		select {
		case l := <-e.lines:
			if w, rest, _ := strings.Cut(l, " "); slices.Contains(words, w) {
				return w, rest, nil
			}
		case <-e.done:
			select {
			case l := <-e.lines:
				if w, rest, _ := strings.Cut(l, " "); slices.Contains(words, w) {
					return w, rest, nil
				}
				continue
			default:
			}
			return "", "", fmt.Errorf("the exporter exited before printing %s (see %s)", strings.Join(words, " or "), e.log)
		case <-ctx.Done():
			return "", "", fmt.Errorf("waiting for the exporter's %s: %w", strings.Join(words, " or "), ctx.Err())
		}
	}
}

// publish asks for new bytes in the same buffer and returns the reply.
func (e *snapshotExporter) publish(ctx context.Context, seed int) (publishReply, error) {
	var r publishReply
	if _, err := io.WriteString(e.stdin, fmt.Sprintf("publish %d\n", seed)); err != nil {
		return r, err
	}
	_, rest, err := e.next(ctx, "PUBLISHED")
	if err != nil {
		return r, err
	}
	return r, json.Unmarshal([]byte(rest), &r)
}

// snapshotCase is one group of receiver.py --http servers fed from the
// exporter's snapshot.
type snapshotCase struct {
	name string
	apis []vllm.Generation
	wt   pipelines.WeightTransfer
}

// TestGPUSnapshotBroadcast: the engine broadcasts a torch process's
// snapshot straight from the memory it exported with CUDA IPC (mapped once
// per case, reused by the second publish into the same buffer) to
// generation D and E servers, packed and not; every receiver's SHA-256 per
// tensor must be the exporter's, and the exporter's buffer intact after.
func TestGPUSnapshotBroadcast(t *testing.T) {
	lib := gputest.Lib(t)
	im, err := cudaipc.New(lib)
	if err != nil {
		t.Fatal(err)
	}
	d, e := vllm.GenD, vllm.GenE
	cases := []snapshotCase{
		{"W3-DE-packed-8MiB", []vllm.Generation{d, e}, pipelines.WeightTransfer{Packed: true, BufferBytes: 8 << 20}},
		{"W3-ED-nonpacked", []vllm.Generation{e, d}, pipelines.WeightTransfer{}},
		{"W2-E-packed-default-1GiB", []vllm.Generation{e}, pipelines.WeightTransfer{Packed: true}},
	}
	pl := gputest.Place(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ex := startSnapshotExporter(t, pl.Trainer, gputest.EnvIntAtLeast(t, "RLFLOW_SNAPSHOT_LAYERS", 8, 0))
	word, rest, err := ex.next(ctx, "SKIP", "READY", "RESULT")
	switch {
	case err != nil:
		t.Fatal(err)
	case word == "SKIP":
		t.Skipf("skipping GPU test: %s", rest)
	case word == "RESULT":
		gputest.Verdict(t, false, "the exporter gave up before READY: %s", rest)
		t.FailNow()
	}
	var cur publishReply
	if err := json.Unmarshal([]byte(rest), &cur); err != nil {
		t.Fatalf("the exporter's READY line: %v", err)
	}
	t.Logf("exporter pid %d: torch %s, snapshot of %d tensors, %d bytes at block offset %d, handle %d bytes, device %d, GPU %q",
		cur.PID, cur.Torch, len(cur.RawTensors), cur.StorageBytes, cur.StorageOffset, len(cur.Handle), cur.Device, cur.GPUUUID)

	var mon gpuhealth.Monitor
	if m, err := gpuhealth.OpenNVML(""); err == nil {
		defer m.Close()
		mon = m
	} else {
		t.Logf("no NVML: %v", err)
	}

	if mon != nil && cur.GPUUUID != "" {
		// The engine compares the snapshot's GPU with NVML's: the
		// exporter's spelling (PROTOCOL.md: lowercase, no GPU-) must match.
		if devs, err := mon.Devices(); err == nil {
			for _, d := range devs {
				if d.Index != pl.Trainer {
					continue
				}
				nvml := strings.TrimPrefix(strings.ToLower(d.UUID), "gpu-")
				gputest.Verdict(t, nvml == cur.GPUUUID, "the exporter's gpu_uuid %q is NVML's %q (device %d) without GPU-, lowercase", cur.GPUUUID, d.UUID, d.Index)
				if nvml != cur.GPUUUID {
					mon = nil // the cases still run, without the UUID check
				}
			}
		}
	}

	seed := 1
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var rs []*httpReceiver
			target := transfer.Target{RunID: "gpu-snapshot", Settings: tc.wt}
			target.Settings.Backend = pipelines.BackendNCCL
			for i, api := range tc.apis {
				r := startReceiverAPI(ctx, t, pl, i, api)
				rs = append(rs, r)
				c, err := vllm.New(r.url, vllm.Options{Generation: api})
				if err != nil {
					t.Fatal(err)
				}
				target.Fleet = append(target.Fleet, c)
				target.Pins = append(target.Pins, api)
			}
			cfg := Config{API: lib, Device: pl.Trainer, Advertise: "127.0.0.1", IPC: im}
			if mon != nil {
				cfg.Monitor, cfg.MonitorIndex = mon, pl.Trainer
			}
			tr, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer tr.Close()
			for k := 1; k <= 2; k++ {
				if k == 2 {
					seed++
					if cur, err = ex.publish(ctx, seed); err != nil {
						gputest.Verdict(t, false, "publish %d: %v", seed, err)
						return
					}
				}
				snap := cur.snapshot()
				out, err := tr.Update(ctx, transfer.UpdateRequest{Target: target, Snapshot: snap, DType: "keep", Version: snap.Version,
					InitTimeout: vllm.DefaultInitTimeout, Progress: &transfer.Progress{}})
				if err != nil {
					gputest.Verdict(t, false, "update %d from snapshot %s: %v", k, snap.Version, err)
					return
				}
				gputest.Verdict(t, out.Source == transfer.SourceSnapshot && out.Opened == (k == 1) && out.Initialized == (k == 1) && out.Tensors == len(snap.Tensors),
					"update %d from snapshot %s: %d bytes, %d tensors in %.3fs (%.2f GB/s), opened the mapping %v (want %v), initialized %v, methods %v",
					k, snap.Version, out.Bytes, out.Tensors, out.Elapsed.Seconds(), float64(out.Bytes)/out.Elapsed.Seconds()/1e9, out.Opened, k == 1, out.Initialized, out.Methods)
				fmt.Printf("GPU-FIGURE snapshot %s update %d: %d bytes in %.3fs, %.2f GB/s from the imported pointer (zero copy)\n",
					tc.name, k, out.Bytes, out.Elapsed.Seconds(), float64(out.Bytes)/out.Elapsed.Seconds()/1e9)
				checkReceived(ctx, t, rs, cur.SHA256, k, fmt.Sprintf("update %d (snapshot %s)", k, snap.Version))
			}
			if err := tr.Close(); err != nil {
				gputest.Verdict(t, false, "closing the engine and its snapshot mapping: %v", err)
			}
		})
	}

	if _, err := io.WriteString(ex.stdin, "exit\n"); err != nil {
		t.Fatalf("send exit: %v", err)
	}
	_, rest, err = ex.next(ctx, "RESULT")
	if err != nil {
		t.Fatal(err)
	}
	var res struct{ Verdict string }
	_ = json.Unmarshal([]byte(rest), &res)
	gputest.Verdict(t, res.Verdict == "PASS", "the exporter's snapshot after the broadcasts: %s", rest)
}
