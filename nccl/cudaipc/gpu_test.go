package cudaipc_test

// The feasibility probe of issue 18 on a GPU host: tests/gpu/ipc_export.py
// (torch) exports tensors with CUDA IPC, this process opens the handles
// through the CUDA runtime nccl.Load loaded and reads the bytes in place.
// It skips, saying why, where NCCL or the CUDA runtime cannot be loaded, no
// GPU is visible, or the Python cannot import torch with CUDA.
// nccl/GPU.md ("CUDA IPC feasibility (issue 18)") has the command.
//
// Environment:
//
//	RLFLOW_GPU_DEVICE       CUDA device of the exporter and the importer (default 0)
//	RLFLOW_IPC_SNAPSHOT_MIB size of the snapshot tensor for the copy figure (default 1024)
//	RLFLOW_GPU_LOGS         where the exporter's log goes (default ./gpu-logs)
//	RLFLOW_GPU_SCRIPTS      directory of ipc_export.py (default: the repository's tests/gpu)
//	RLFLOW_PYTHON           the Python with torch (default python3)

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
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

	"github.com/rlflow/rlflow/internal/testutil/gputest"
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/cudaipc"
)

// exportManifest is the exporter's READY line.
type exportManifest struct {
	PID              int             `json:"pid"`
	Torch            string          `json:"torch"`
	TorchCUDA        string          `json:"torch_cuda"`
	Device           int             `json:"device"`
	DeviceName       string          `json:"device_name"`
	AllocConf        string          `json:"alloc_conf"`
	AllocatorBackend string          `json:"allocator_backend"`
	ShareCUDALayout  json.RawMessage `json:"share_cuda_layout"`
	ReduceTensor     json.RawMessage `json:"reduce_tensor_layout"`
	Snapshot         string          `json:"snapshot"`
	Scratch          string          `json:"scratch"`
	Tensors          []exportedTensor
}

// exportedTensor is one tensor of the manifest: its storage's
// _share_cuda_() fields and the bytes the importer must find.
type exportedTensor struct {
	Name          string  `json:"name"`
	DType         string  `json:"dtype"`
	Shape         []int64 `json:"shape"`
	NBytes        int64   `json:"nbytes"`
	Handle        []byte  `json:"handle"` // base64 in the JSON
	HandleFraming struct {
		Framing string `json:"framing"`
	} `json:"handle_framing"`
	StorageSizeBytes   int64  `json:"storage_size_bytes"`
	StorageOffsetBytes int64  `json:"storage_offset_bytes"`
	ViewOffsetBytes    int64  `json:"view_offset_bytes"`
	EventSyncRequired  bool   `json:"event_sync_required"`
	SHA256             string `json:"sha256"`
}

// exporter is ipc_export.py, alive until it is sent "exit" (its stdin is
// the importer's hold on it).
type exporter struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string   // stdout lines; every one is sent before done closes
	done  chan struct{} // closed once the process exited; err is then set
	quit  chan struct{} // closed by the test's cleanup
	err   error
	log   string // its stderr and stdout
}

func startExporter(t *testing.T, args ...string) *exporter {
	t.Helper()
	py := gputest.Python()
	args = append([]string{gputest.Script(t, "ipc_export.py")}, args...)
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
	e := &exporter{cmd: cmd, stdin: stdin, lines: make(chan string, 64), done: make(chan struct{}), quit: make(chan struct{}), log: logPath}
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 16<<20)
		for sc.Scan() {
			fmt.Fprintln(logf, "stdout:", sc.Text())
			select {
			case e.lines <- sc.Text():
			case <-e.quit: // the test is over: keep draining into the log
			}
		}
		e.err = cmd.Wait()
		logf.Close()
		close(e.done)
	}()
	t.Cleanup(func() {
		close(e.quit)
		select {
		case <-e.done:
		default:
			_ = cmd.Process.Signal(syscall.SIGKILL)
			<-e.done
		}
	})
	return e
}

// next returns the first stdout line starting with one of words, as
// (word, rest); lines with other words are skipped.
func (e *exporter) next(ctx context.Context, words ...string) (string, string, error) {
	match := func(l string) (string, string, bool) {
		w, rest, _ := strings.Cut(l, " ")
		return w, rest, slices.Contains(words, w)
	}
	for {
		select {
		case l := <-e.lines:
			if w, rest, ok := match(l); ok {
				return w, rest, nil
			}
		case <-e.done:
			for { // every line is in the buffer by now
				select {
				case l := <-e.lines:
					if w, rest, ok := match(l); ok {
						return w, rest, nil
					}
				default:
					return "", "", fmt.Errorf("the exporter exited (%v) before printing %s (see %s)", e.err, strings.Join(words, " or "), e.log)
				}
			}
		case <-ctx.Done():
			return "", "", fmt.Errorf("waiting for the exporter's %s: %w", strings.Join(words, " or "), ctx.Err())
		}
	}
}

func (e *exporter) send(line string) error {
	_, err := io.WriteString(e.stdin, line+"\n")
	return err
}

// deviceSHA256 hashes n device bytes at p, copied through pinned in chunks
// on stream s. It runs inside dev.Do (WaitStream is then inline).
func deviceSHA256(ctx context.Context, dev *nccl.Device, api nccl.API, s nccl.Stream, pinned []byte, p nccl.DevPtr, n int64) (string, error) {
	h := sha256.New()
	for off := int64(0); off < n; {
		k := min(int64(len(pinned)), n-off)
		if err := api.MemcpyDtoHAsync(pinned[:k], p+nccl.DevPtr(off), s); err != nil {
			return "", err
		}
		if err := dev.WaitStream(ctx, s); err != nil {
			return "", err
		}
		h.Write(pinned[:k])
		off += k
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func gbps(n int64, d time.Duration) float64 { return float64(n) / d.Seconds() / 1e9 }

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// snapshotCopies is how many timed device-to-device copies of the snapshot
// each source gets (after one untimed warm-up).
const snapshotCopies = 5

func TestGPUTorchExportGoImport(t *testing.T) {
	lib := gputest.Lib(t)
	im, err := cudaipc.New(lib)
	if err != nil {
		t.Fatal(err)
	}
	rtv, _ := lib.CUDARuntimeVersion()
	snapMiB := gputest.EnvIntAtLeast(t, "RLFLOW_IPC_SNAPSHOT_MIB", 1024, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	ex := startExporter(t, "--device", strconv.Itoa(gputest.Device(t)), "--snapshot-mib", strconv.Itoa(snapMiB))
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
	var m exportManifest
	if err := json.Unmarshal([]byte(rest), &m); err != nil {
		t.Fatalf("the exporter's READY line: %v", err)
	}
	byName := map[string]*exportedTensor{}
	for i := range m.Tensors {
		byName[m.Tensors[i].Name] = &m.Tensors[i]
	}
	snap, scratch := byName[m.Snapshot], byName[m.Scratch]
	if snap == nil || scratch == nil {
		t.Fatalf("the exporter's READY line lacks the snapshot %q or the scratch %q tensor", m.Snapshot, m.Scratch)
	}
	t.Logf("exporter pid %d: torch %s (CUDA %s) on device %d (%s), allocator %s, PYTORCH_CUDA_ALLOC_CONF=%q; importer: CUDA runtime %d from %s",
		m.PID, m.Torch, m.TorchCUDA, m.Device, m.DeviceName, m.AllocatorBackend, m.AllocConf, rtv, im.CUDARTPath())
	t.Logf("torch %s: storage._share_cuda_() layout %s; reductions.reduce_tensor args %s", m.Torch, m.ShareCUDALayout, m.ReduceTensor)

	dev, err := nccl.OpenDevice(lib, m.Device)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()

	// 1. Open every distinct handle once: tensors of one cudaMalloc block
	// share it and differ by their storage offset.
	type block struct {
		handle  cudaipc.MemHandle
		base    nccl.DevPtr
		open    time.Duration
		tensors []string
	}
	var blocks []*block
	blockOf := map[cudaipc.MemHandle]*block{}
	blockOfTensor := map[string]*block{}
	ptrOf := map[string]nccl.DevPtr{}
	err = dev.Do(ctx, func(nccl.API) error {
		for _, e := range m.Tensors {
			h, err := cudaipc.ParseTorchHandle(e.Handle)
			if err != nil {
				return fmt.Errorf("tensor %s (handle %d bytes, %s): %w", e.Name, len(e.Handle), e.HandleFraming.Framing, err)
			}
			b := blockOf[h]
			if b == nil {
				start := time.Now()
				base, err := im.Open(h)
				if err != nil {
					return fmt.Errorf("tensor %s: %w", e.Name, err)
				}
				b = &block{handle: h, base: base, open: time.Since(start)}
				blocks = append(blocks, b)
				blockOf[h] = b
			}
			b.tensors = append(b.tensors, e.Name)
			blockOfTensor[e.Name] = b
			if e.ViewOffsetBytes < 0 || e.StorageOffsetBytes < 0 || e.ViewOffsetBytes+e.NBytes > e.StorageSizeBytes {
				return fmt.Errorf("tensor %s: %d bytes at view offset %d do not fit its storage of %d bytes", e.Name, e.NBytes, e.ViewOffsetBytes, e.StorageSizeBytes)
			}
			ptrOf[e.Name] = b.base + nccl.DevPtr(e.StorageOffsetBytes+e.ViewOffsetBytes)
		}
		return nil
	})
	if err != nil {
		gputest.Verdict(t, false, "open the exported handles: %v", err)
		t.FailNow()
	}
	for i, b := range blocks {
		t.Logf("block %d: opened in %.1f us, tensors %s", i, us(b.open), strings.Join(b.tensors, ", "))
	}

	// 2. Read every tensor in place and compare with the exporter's SHA-256;
	// write the scratch tensor for the exporter to check.
	var scratchSHA string
	err = dev.Do(ctx, func(api nccl.API) error {
		s, err := api.StreamCreate(nccl.StreamNonBlocking)
		if err != nil {
			return err
		}
		defer api.StreamDestroy(s)
		pinned, err := api.HostAlloc(64<<20, nccl.HostAllocDefault)
		if err != nil {
			return err
		}
		defer api.FreeHost(pinned)
		for _, e := range m.Tensors {
			got, err := deviceSHA256(ctx, dev, api, s, pinned, ptrOf[e.Name], e.NBytes)
			if err != nil {
				return fmt.Errorf("read tensor %s: %w", e.Name, err)
			}
			b := blockOfTensor[e.Name]
			gputest.Verdict(t, got == e.SHA256, "tensor %s (%s %v, %d bytes; block %d of %d shared by %d tensors, storage at block offset %d, view offset %d, event_sync_required %v): SHA-256 of the imported bytes %s the exporter's",
				e.Name, e.DType, e.Shape, e.NBytes, slices.Index(blocks, b), len(blocks), len(b.tensors), e.StorageOffsetBytes, e.ViewOffsetBytes, e.EventSyncRequired, map[bool]string{true: "matches", false: "differs from"}[got == e.SHA256])
		}
		if scratch.NBytes > int64(len(pinned)) {
			return fmt.Errorf("scratch tensor of %d bytes exceeds the %d-byte pinned buffer", scratch.NBytes, len(pinned))
		}
		w := pinned[:scratch.NBytes]
		gputest.XorshiftFill(w, 18, 0)
		sum := sha256.Sum256(w)
		scratchSHA = hex.EncodeToString(sum[:])
		if err := api.MemcpyHtoDAsync(ptrOf[scratch.Name], w, s); err != nil {
			return fmt.Errorf("write tensor %s: %w", scratch.Name, err)
		}
		return dev.WaitStream(ctx, s)
	})
	if err != nil {
		gputest.Verdict(t, false, "read the imported tensors: %v", err)
		t.FailNow()
	}
	if err := ex.send("check-scratch " + scratchSHA); err != nil {
		t.Fatalf("send check-scratch: %v", err)
	}
	_, rest, err = ex.next(ctx, "SCRATCH")
	if err != nil {
		t.Fatal(err)
	}
	var sc struct{ Match bool }
	_ = json.Unmarshal([]byte(rest), &sc)
	gputest.Verdict(t, sc.Match, "tensor %s written by Go through the imported pointer (%d bytes): the exporter's torch %s the same bytes", scratch.Name, scratch.NBytes, map[bool]string{true: "sees", false: "does NOT see"}[sc.Match])

	// 3. The snapshot copy: device to device from the imported pointer into
	// a Go-allocated buffer, against the same copy from a Go-allocated
	// source; copies alternate so that drift lands on both.
	var ipcTimes, ownTimes []time.Duration
	var snapOK bool
	err = dev.Do(ctx, func(api nccl.API) error {
		n := snap.NBytes
		dst, err := api.Malloc(int(n))
		if err != nil {
			return err
		}
		defer api.Free(dst)
		own, err := api.Malloc(int(n))
		if err != nil {
			return err
		}
		defer api.Free(own)
		if err := api.Memset(own, 0x5a, int(n)); err != nil {
			return err
		}
		s, err := api.StreamCreate(nccl.StreamNonBlocking)
		if err != nil {
			return err
		}
		defer api.StreamDestroy(s)
		var ev [2]nccl.Event
		for i := range ev {
			if ev[i], err = api.EventCreate(nccl.EventDefault); err != nil {
				return err
			}
			defer api.EventDestroy(ev[i])
		}
		timed := func(src nccl.DevPtr) (time.Duration, error) {
			if err := api.EventRecord(ev[0], s); err != nil {
				return 0, err
			}
			if err := api.MemcpyDtoDAsync(dst, src, int(n), s); err != nil {
				return 0, err
			}
			if err := api.EventRecord(ev[1], s); err != nil {
				return 0, err
			}
			if err := dev.WaitEvent(ctx, ev[1]); err != nil {
				return 0, err
			}
			return api.EventElapsedTime(ev[0], ev[1])
		}
		for i := 0; i <= snapshotCopies; i++ {
			a, err := timed(ptrOf[snap.Name])
			if err != nil {
				return fmt.Errorf("copy from the imported snapshot: %w", err)
			}
			b, err := timed(own)
			if err != nil {
				return fmt.Errorf("copy from the Go-allocated buffer: %w", err)
			}
			if i > 0 { // the first round warms up
				ipcTimes, ownTimes = append(ipcTimes, a), append(ownTimes, b)
			}
		}
		if _, err := timed(ptrOf[snap.Name]); err != nil {
			return err
		}
		pinned, err := api.HostAlloc(64<<20, nccl.HostAllocDefault)
		if err != nil {
			return err
		}
		defer api.FreeHost(pinned)
		got, err := deviceSHA256(ctx, dev, api, s, pinned, dst, n)
		snapOK = got == snap.SHA256
		return err
	})
	if err != nil {
		gputest.Verdict(t, false, "snapshot copy: %v", err)
		t.FailNow()
	}
	n := snap.NBytes
	gputest.Verdict(t, snapOK, "snapshot copy of %s (%d bytes) into a Go-allocated buffer: SHA-256 %s", snap.Name, n, map[bool]string{true: "matches", false: "differs"}[snapOK])
	fmt.Printf("GPU-FIGURE ipc snapshot copy %.2f GiB device-to-device from the imported pointer: median %.1f GB/s (%.2f ms), best %.1f GB/s; from a Go-allocated source: median %.1f GB/s, best %.1f GB/s; ratio imported/own %.3f (medians of %d copies; read+write traffic is twice the GB/s)\n",
		float64(n)/(1<<30), gbps(n, median(ipcTimes)), float64(median(ipcTimes))/float64(time.Millisecond), gbps(n, slices.Min(ipcTimes)),
		gbps(n, median(ownTimes)), gbps(n, slices.Min(ownTimes)), median(ownTimes).Seconds()/median(ipcTimes).Seconds(), snapshotCopies)

	// 4. A second open of an open handle (does the runtime count, or
	// refuse?), then close every block, timed.
	var reopen string
	var reopenSame bool
	var closeTimes []time.Duration
	err = dev.Do(ctx, func(nccl.API) error {
		b0 := blocks[0]
		p, err := im.Open(b0.handle)
		switch {
		case err != nil:
			reopen = fmt.Sprintf("refused: %v", err)
		case p == b0.base:
			reopen, reopenSame = "the same address", true
		default:
			reopen = "a second mapping at another address"
			if err := im.Close(p); err != nil {
				return fmt.Errorf("close the second mapping: %w", err)
			}
		}
		for i, b := range blocks {
			start := time.Now()
			if err := im.Close(b.base); err != nil {
				return fmt.Errorf("close block %d: %w", i, err)
			}
			closeTimes = append(closeTimes, time.Since(start))
		}
		if reopenSame {
			// Without a count the first close unmapped it: the second
			// close must then fail (no memory is touched either way).
			if err := im.Close(b0.base); err != nil {
				reopen += fmt.Sprintf(", not counted (a second close fails: %v)", err)
			} else {
				reopen += ", counted (a second close succeeds)"
			}
		}
		return nil
	})
	if err != nil {
		gputest.Verdict(t, false, "close the imported blocks: %v", err)
	} else {
		gputest.Verdict(t, true, "closed all %d imported blocks", len(blocks))
	}
	var opens []time.Duration
	for _, b := range blocks[1:] {
		opens = append(opens, b.open)
	}
	others := "no other handle"
	if len(opens) > 0 {
		others = fmt.Sprintf("the other %d median %.1f us, max %.1f us", len(opens), us(median(opens)), us(slices.Max(opens)))
	}
	if len(closeTimes) > 0 {
		fmt.Printf("GPU-FIGURE ipc open/close: %d distinct handles for %d tensors; open: first %.1f us, %s; close: median %.1f us, max %.1f us\n",
			len(blocks), len(m.Tensors), us(blocks[0].open), others, us(median(closeTimes)), us(slices.Max(closeTimes)))
	}
	fmt.Printf("GPU-FIGURE ipc second cudaIpcOpenMemHandle of a handle this process has open: %s\n", reopen)

	// 5. The exporter checks its tensors are intact and exits.
	if err := ex.send("exit"); err != nil {
		t.Fatalf("send exit: %v", err)
	}
	_, rest, err = ex.next(ctx, "RESULT")
	if err != nil {
		t.Fatal(err)
	}
	var res struct{ Verdict string }
	_ = json.Unmarshal([]byte(rest), &res)
	gputest.Verdict(t, res.Verdict == "PASS", "the exporter's own tensors after the imports: %s", rest)
	select {
	case <-ex.done:
	case <-ctx.Done():
		t.Fatal("the exporter did not exit after RESULT")
	}
	if ex.err != nil {
		t.Errorf("exporter: %v", ex.err)
	}
	if !t.Failed() {
		gputest.Verdict(t, true, "FEASIBLE: torch %s exported %d tensors (%d cudaMalloc blocks) with storage._share_cuda_(); Go opened every handle with cudaIpcOpenMemHandle through %s, read each byte-exact, wrote one the exporter saw, and copied the %.2f GiB snapshot at %.1f GB/s",
			m.Torch, len(m.Tensors), len(blocks), im.CUDARTPath(), float64(n)/(1<<30), gbps(n, median(ipcTimes)))
	}
}
