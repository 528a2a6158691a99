// Package trainertest is a TEST DOUBLE of a resident trainer: a pure-Go,
// CPU-only program that speaks trainer/PROTOCOL.md over fds 3 and 4 with a
// deterministic fake model, so the GPU worker's supervision (restart,
// replay, journal, publish) is tested without torch or a GPU. It is not a
// trainer: its "training" is a hash-driven update that makes different
// rollouts give different weights and the same rollouts identical bytes.
//
// The lead wires Main as the hidden command `rlflow fake-trainer`; tests
// re-exec their own binary into it. Its environment knobs are the Env*
// constants.
package trainertest

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rlflow/rlflow/trainer"
)

// The fake trainer's knobs.
const (
	// EnvShapes: the model's tensors, "name=64x128,name2=64" (or bare
	// shapes); default DefaultShapes.
	EnvShapes = "RLFLOW_FAKE_TRAINER_SHAPES"
	// EnvSeed: the initialisation and training generator's seed (default 1).
	EnvSeed = "RLFLOW_FAKE_TRAINER_SEED"
	// EnvShmDir: where the snapshot file lives (default os.TempDir()).
	EnvShmDir = "RLFLOW_FAKE_TRAINER_SHM_DIR"
	// EnvDie: fault points, comma-separated "op:iteration" with op train
	// (half-way through the update), save (files written, not renamed) or
	// publish (the snapshot half written; the iteration is the trainer's).
	// The trainer SIGKILLs itself there once: it first creates a marker
	// file, and a later generation that finds it goes on.
	EnvDie = "RLFLOW_FAKE_TRAINER_DIE"
	// EnvMarkerDir: where the EnvDie markers go; default the rollouts
	// file's directory (train), the checkpoint's parent (save), the shm
	// directory (publish).
	EnvMarkerDir = "RLFLOW_FAKE_TRAINER_MARKER_DIR"
	// EnvTrainDelay: a duration slept inside every train (after its
	// "train of iteration N started" log line).
	EnvTrainDelay = "RLFLOW_FAKE_TRAINER_TRAIN_DELAY"
	// EnvHelloDelay: a duration slept before answering hello.
	EnvHelloDelay = "RLFLOW_FAKE_TRAINER_HELLO_DELAY"
	// EnvChild: "1" starts one child process in the trainer's group that
	// only sleeps (a stand-in for a data loader worker); its pid is
	// logged as "child pid N".
	EnvChild = "RLFLOW_FAKE_TRAINER_CHILD"
	// EnvGPUUUID: the gpu_uuid publish reports (default FakeGPUUUID):
	// vLLM's ipc backend finds each tensor's handle by it.
	EnvGPUUUID = "RLFLOW_FAKE_TRAINER_GPU_UUID"
	// envRole "child" makes Main that sleeping child.
	envRole = "RLFLOW_FAKE_TRAINER_ROLE"
)

// Framework is what hello reports.
const Framework = "rlflow-fake-trainer 1"

// Main runs the fake trainer until shutdown or end of file on fd 3 (exit
// 0); a configuration or pipe error exits 2.
func Main() int {
	if os.Getenv(envRole) == "child" {
		for {
			time.Sleep(time.Hour)
		}
	}
	logf := func(format string, args ...any) { fmt.Fprintf(os.Stderr, "fake-trainer: "+format+"\n", args...) }
	t, err := newFake()
	if err != nil {
		logf("%v", err)
		return 2
	}
	if fds := os.Getenv(trainer.EnvFDs); fds != "3,4" {
		logf("%s is %q, want 3,4: start me as the GPU worker does", trainer.EnvFDs, fds)
		return 2
	}
	// Not inherited by anything this process starts.
	syscall.CloseOnExec(3)
	syscall.CloseOnExec(4)
	in, out := os.NewFile(3, "requests"), os.NewFile(4, "replies")
	defer t.removeSnapshot()
	if os.Getenv(EnvChild) == "1" {
		pid, err := startChild()
		if err != nil {
			logf("starting the child: %v", err)
			return 2
		}
		logf("child pid %d", pid)
	}
	t.log = logf
	logf("pid %d generation %s started", os.Getpid(), os.Getenv(trainer.EnvGeneration))
	br := bufio.NewReaderSize(in, 64<<10)
	for {
		line, err := readLine(br)
		if errors.Is(err, io.EOF) {
			logf("end of file on fd 3: the worker is gone, exiting")
			return 0
		}
		if err != nil {
			logf("reading a request: %v", err)
			return 2
		}
		reply, op := t.handle(line)
		b, err := json.Marshal(reply)
		if err != nil {
			reply = map[string]any{"id": reply["id"], "ok": false, "error": "encoding the reply: " + err.Error()}
			b, _ = json.Marshal(reply)
		}
		if _, err := out.Write(append(b, '\n')); err != nil {
			logf("writing a reply: %v", err)
			return 2
		}
		if op == "shutdown" && reply["ok"] == true {
			logf("shutdown")
			return 0
		}
	}
}

func readLine(br *bufio.Reader) ([]byte, error) {
	var line []byte
	for {
		chunk, err := br.ReadSlice('\n')
		line = append(line, chunk...)
		if len(line) > trainer.MaxFrameBytes+1 {
			return nil, fmt.Errorf("a request longer than %d bytes", trainer.MaxFrameBytes)
		}
		if err == nil {
			return line[:len(line)-1], nil
		}
		if !errors.Is(err, bufio.ErrBufferFull) {
			if errors.Is(err, io.EOF) && len(line) > 0 {
				return nil, io.ErrUnexpectedEOF
			}
			return nil, err
		}
	}
}

func startChild() (int, error) {
	exe, err := os.Executable()
	if err != nil {
		return 0, err
	}
	cmd := exec.Command(exe, os.Args[1:]...)
	cmd.Env = append(os.Environ(), envRole+"=child")
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	go func() { _ = cmd.Wait() }()
	return cmd.Process.Pid, nil
}

// fake is the trainer's state between requests.
type fake struct {
	model      *model
	device     int
	gpuUUID    string
	shmDir     string
	dies       map[string]bool // "train:3"
	markerDir  string
	trainDelay time.Duration
	helloDelay time.Duration
	log        func(string, ...any)

	lastID     int64
	snapshot   string // the snapshot file ("" none yet)
	unreleased string // the published version not released yet
}

func newFake() (*fake, error) {
	env := func(k, def string) string {
		if v := os.Getenv(k); v != "" {
			return v
		}
		return def
	}
	specs, err := parseShapes(env(EnvShapes, DefaultShapes))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", EnvShapes, err)
	}
	seed, err := strconv.ParseUint(env(EnvSeed, "1"), 10, 64)
	if err != nil {
		return nil, fmt.Errorf("%s: want an unsigned integer", EnvSeed)
	}
	device, err := strconv.Atoi(env(trainer.EnvDevice, "0"))
	if err != nil || device < 0 {
		return nil, fmt.Errorf("%s: want a CUDA ordinal", trainer.EnvDevice)
	}
	f := &fake{model: newModel(specs, seed), device: device, gpuUUID: env(EnvGPUUUID, FakeGPUUUID), shmDir: env(EnvShmDir, os.TempDir()),
		dies: map[string]bool{}, markerDir: os.Getenv(EnvMarkerDir)}
	for _, d := range []struct {
		env string
		to  *time.Duration
	}{{EnvTrainDelay, &f.trainDelay}, {EnvHelloDelay, &f.helloDelay}} {
		if v := os.Getenv(d.env); v != "" {
			if *d.to, err = time.ParseDuration(v); err != nil {
				return nil, fmt.Errorf("%s: %w", d.env, err)
			}
		}
	}
	if v := os.Getenv(EnvDie); v != "" {
		for _, p := range strings.Split(v, ",") {
			op, n, ok := strings.Cut(strings.TrimSpace(p), ":")
			if _, err := strconv.Atoi(n); !ok || err != nil || (op != "train" && op != "save" && op != "publish") {
				return nil, fmt.Errorf("%s: %q: want train:N, save:N or publish:N", EnvDie, p)
			}
			f.dies[op+":"+n] = true
		}
	}
	return f, nil
}

// dieHook returns the function a fault point calls: SIGKILL of this
// process the first time op:iteration is reached (nil: not a fault point
// or done before).
func (f *fake) dieHook(op string, iteration int, defaultDir string) func() {
	key := fmt.Sprintf("%s:%d", op, iteration)
	if !f.dies[key] {
		return nil
	}
	dir := f.markerDir
	if dir == "" {
		dir = defaultDir
	}
	marker := filepath.Join(dir, fmt.Sprintf(".rlflow-fake-trainer-%s-died-%s-%d", os.Getenv(trainer.EnvRunID), op, iteration))
	return func() {
		mf, err := os.OpenFile(marker, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if err != nil {
			return // died here before (or cannot mark it): go on
		}
		_ = mf.Sync()
		mf.Close()
		_ = syncDir(dir)
		f.log("dying in %s of iteration %d (%s)", op, iteration, EnvDie)
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		for {
			time.Sleep(time.Hour) // the signal is on its way
		}
	}
}

// request is one decoded request: its id, op and the op's fields.
type request struct {
	id     int64
	op     string
	fields map[string]json.RawMessage
}

// opFields are the fields each op takes; any other is an error.
var opFields = map[string][]string{
	"hello": {"protocol"}, "load": {"path"}, "train": {"iteration", "rollouts", "args"},
	"publish": {"version", "dtype", "ipc_refs"}, "release": {"version"}, "save": {"path", "iteration"}, "shutdown": {},
}

// optionalFields ("op.field") may be missing.
var optionalFields = map[string]bool{"publish.ipc_refs": true}

// FakeRefCounterHandle is the ref_counter_handle of every ipc_refs entry a
// fake_shm snapshot carries (PROTOCOL.md "publish"): a TEST DOUBLE's, no
// file of that name exists.
const FakeRefCounterHandle = "fake_refcounter"

// handle answers one request line; it returns the reply and the op.
func (f *fake) handle(line []byte) (map[string]any, string) {
	req, err := f.decode(line)
	if err != nil {
		return map[string]any{"id": req.id, "ok": false, "error": err.Error()}, req.op
	}
	out, err := f.do(req)
	if err != nil {
		return map[string]any{"id": req.id, "ok": false, "error": err.Error()}, req.op
	}
	out["id"], out["ok"] = req.id, true
	return out, req.op
}

func (f *fake) decode(line []byte) (request, error) {
	var req request
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.UseNumber()
	var m map[string]json.RawMessage
	if err := dec.Decode(&m); err != nil || m == nil {
		return req, errors.New("the request is not a JSON object")
	}
	if err := json.Unmarshal(m["id"], &req.id); err != nil || req.id <= f.lastID {
		return request{}, fmt.Errorf("id: want an integer above the last request's %d", f.lastID)
	}
	f.lastID = req.id
	if err := json.Unmarshal(m["op"], &req.op); err != nil {
		return req, errors.New("op: want a string")
	}
	allowed, ok := opFields[req.op]
	if !ok {
		return req, fmt.Errorf("op %q: unknown", req.op)
	}
	delete(m, "id")
	delete(m, "op")
	for k := range m {
		found := false
		for _, a := range allowed {
			found = found || a == k
		}
		if !found {
			return req, fmt.Errorf("%s: unknown field %q", req.op, k)
		}
	}
	for _, a := range allowed {
		if _, ok := m[a]; !ok && !optionalFields[req.op+"."+a] {
			return req, fmt.Errorf("%s: field %q missing", req.op, a)
		}
	}
	req.fields = m
	return req, nil
}

func (r request) int(name string) (int, error) {
	var n int
	if err := json.Unmarshal(r.fields[name], &n); err != nil {
		return 0, fmt.Errorf("field %q: want an integer", name)
	}
	return n, nil
}

// optBool is a bool field that may be missing (false).
func (r request) optBool(name string) (bool, error) {
	raw, ok := r.fields[name]
	if !ok {
		return false, nil
	}
	switch string(bytes.TrimSpace(raw)) { // strict: null is not false
	case "true":
		return true, nil
	case "false":
		return false, nil
	}
	return false, fmt.Errorf("field %q: want a bool", name)
}

func (r request) str(name string) (string, error) {
	var s string
	if err := json.Unmarshal(r.fields[name], &s); err != nil {
		return "", fmt.Errorf("field %q: want a string", name)
	}
	return s, nil
}

func (f *fake) do(r request) (map[string]any, error) {
	switch r.op {
	case "hello":
		n, err := r.int("protocol")
		if err != nil {
			return nil, err
		}
		if n != trainer.ProtocolVersion {
			return nil, fmt.Errorf("protocol %d: this trainer speaks %d", n, trainer.ProtocolVersion)
		}
		time.Sleep(f.helloDelay)
		return map[string]any{"protocol": trainer.ProtocolVersion, "pid": os.Getpid(), "device": f.device,
			"framework": Framework + " (" + runtime.Version() + ")", "iteration": f.model.iteration}, nil
	case "load":
		path, err := r.str("path")
		if err != nil {
			return nil, err
		}
		began := time.Now()
		if err := f.model.load(path); err != nil {
			return nil, err
		}
		return map[string]any{"iteration": f.model.iteration, "seconds": time.Since(began).Seconds()}, nil
	case "train":
		return f.train(r)
	case "save":
		path, err := r.str("path")
		if err != nil {
			return nil, err
		}
		n, err := r.int("iteration")
		if err != nil {
			return nil, err
		}
		if !filepath.IsAbs(path) {
			return nil, errors.New("path: not absolute")
		}
		if n != f.model.iteration {
			return nil, fmt.Errorf("iteration %d: the model is at iteration %d", n, f.model.iteration)
		}
		began := time.Now()
		size, err := f.model.save(path, f.dieHook("save", n, filepath.Dir(path)))
		if err != nil {
			return nil, err
		}
		return map[string]any{"path": path, "bytes": size, "seconds": time.Since(began).Seconds()}, nil
	case "publish":
		return f.publish(r)
	case "release":
		v, err := r.str("version")
		if err != nil {
			return nil, err
		}
		if f.unreleased == "" || v != f.unreleased {
			return nil, errors.New("that version is not the published one")
		}
		f.unreleased = ""
		return map[string]any{}, nil
	case "shutdown":
		return map[string]any{}, nil
	}
	return nil, fmt.Errorf("op %q: unknown", r.op)
}

func (f *fake) train(r request) (map[string]any, error) {
	n, err := r.int("iteration")
	if err != nil {
		return nil, err
	}
	rollouts, err := r.str("rollouts")
	if err != nil {
		return nil, err
	}
	var args map[string]any
	if err := json.Unmarshal(r.fields["args"], &args); err != nil || args == nil {
		return nil, errors.New("field \"args\": want an object")
	}
	if n != f.model.iteration+1 {
		return nil, fmt.Errorf("iteration %d: the model is at iteration %d, so the next is %d", n, f.model.iteration, f.model.iteration+1)
	}
	if !filepath.IsAbs(rollouts) {
		return nil, errors.New("rollouts: not an absolute path")
	}
	f.log("train of iteration %d started", n)
	began := time.Now()
	time.Sleep(f.trainDelay)
	loss, samples, err := f.model.train(n, rollouts, f.dieHook("train", n, filepath.Dir(rollouts)))
	if err != nil {
		return nil, err
	}
	done := time.Now()
	return map[string]any{"iteration": n, "metrics": map[string]float64{"loss": loss, "samples": float64(samples)},
		"seconds": done.Sub(began).Seconds(), "step_done_unix": float64(done.UnixNano()) / 1e9}, nil
}

// publish writes the weights (float32 narrowed to dtype unless keep) into
// the snapshot file, back to back in state-dict order, each tensor at a
// multiple of its item size. The file is created once per process and
// reused (grown when a layout needs more).
func (f *fake) publish(r request) (map[string]any, error) {
	version, err := r.str("version")
	if err != nil {
		return nil, err
	}
	dtype, err := r.str("dtype")
	if err != nil {
		return nil, err
	}
	refs, err := r.optBool("ipc_refs")
	if err != nil {
		return nil, err
	}
	if f.unreleased != "" {
		return nil, errors.New("the previous version is not released yet")
	}
	out := "float32"
	switch dtype {
	case trainer.DTypeKeep:
	case trainer.DTypeBFloat16, trainer.DTypeFloat16:
		out = dtype
	default:
		return nil, errors.New("dtype: want keep, bfloat16 or float16")
	}
	began := time.Now()
	size, _ := trainer.DTypeSize(out)
	var buf []byte
	var tensors []map[string]any
	for i, t := range f.model.specs {
		for int64(len(buf))%size != 0 {
			buf = append(buf, 0)
		}
		offset := int64(len(buf))
		for _, v := range f.model.params[i] {
			switch out {
			case "float32":
				buf = appendU32(buf, math.Float32bits(v))
			case "bfloat16":
				buf = appendU16(buf, bfloat16Bits(v))
			case "float16":
				buf = appendU16(buf, float16Bits(v))
			}
		}
		tensors = append(tensors, map[string]any{"name": t.Name, "dtype": out, "shape": t.Shape,
			"offset": offset, "bytes": int64(len(buf)) - offset})
	}
	if f.snapshot == "" {
		f.snapshot = filepath.Join(f.shmDir, fmt.Sprintf("rlflow-fake-trainer-%d.snapshot", os.Getpid()))
	}
	if err := f.writeSnapshot(buf, f.dieHook("publish", f.model.iteration, f.shmDir)); err != nil {
		return nil, err
	}
	f.unreleased = version
	reply := map[string]any{"version": version, "ipc": trainer.IPCFakeShm, "path": f.snapshot,
		"storage_bytes": len(buf), "storage_offset": 0, "device": f.device, "gpu_uuid": f.gpuUUID, "tensors": tensors,
		"snapshot_seconds": time.Since(began).Seconds()}
	if refs {
		reply["ipc_refs"] = fakeRefs(len(tensors))
	}
	return reply, nil
}

// FakeGPUUUID is the GPU the fake trainer says it runs on, unless
// EnvGPUUUID says otherwise.
const FakeGPUUUID = "fa4efa4e-0000-4000-8000-00000000fa4e"

// fakeRefs are a fake_shm snapshot's ipc_refs for n tensors: the one fake
// ref-counter file, slots 0 to n-1, no event.
func fakeRefs(n int) []map[string]any {
	handle := base64.StdEncoding.EncodeToString([]byte(FakeRefCounterHandle))
	refs := make([]map[string]any, n)
	for i := range refs {
		refs[i] = map[string]any{"ref_counter_handle": handle, "ref_counter_offset": i, "event_handle": nil, "event_sync_required": false}
	}
	return refs
}

func (f *fake) writeSnapshot(buf []byte, die func()) error {
	file, err := os.OpenFile(f.snapshot, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return err
	}
	defer file.Close()
	if st, err := file.Stat(); err != nil {
		return err
	} else if st.Size() < int64(len(buf)) {
		if err := file.Truncate(int64(len(buf))); err != nil {
			return err
		}
	}
	half := len(buf) / 2
	if _, err := file.WriteAt(buf[:half], 0); err != nil {
		return err
	}
	if die != nil {
		die()
	}
	_, err = file.WriteAt(buf[half:], int64(half))
	return err
}

func (f *fake) removeSnapshot() {
	if f.snapshot != "" {
		_ = os.Remove(f.snapshot)
	}
}

func appendU32(b []byte, v uint32) []byte {
	return append(b, byte(v), byte(v>>8), byte(v>>16), byte(v>>24))
}

func appendU16(b []byte, v uint16) []byte { return append(b, byte(v), byte(v>>8)) }

// WeightsDigest is the SHA-256 (hex) of every tensor of a published
// snapshot, read from its fake_shm file: two runs published the same
// weights when their digests are equal.
func WeightsDigest(snapshotFile string, s *trainer.Snapshot) (map[string]string, error) {
	f, err := os.Open(snapshotFile)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	out := make(map[string]string, len(s.Tensors))
	for _, t := range s.Tensors {
		if end := s.StorageOffset + t.Offset + t.Bytes; end > st.Size() {
			return nil, fmt.Errorf("%s: tensor %s ends at byte %d, past the file's %d", snapshotFile, t.Name, end, st.Size())
		}
		h := sha256.New()
		if _, err := io.Copy(h, io.NewSectionReader(f, s.StorageOffset+t.Offset, t.Bytes)); err != nil {
			return nil, fmt.Errorf("%s: tensor %s: %w", snapshotFile, t.Name, err)
		}
		out[t.Name] = hex.EncodeToString(h.Sum(nil))
	}
	return out, nil
}
