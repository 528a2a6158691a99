package trainertest

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/trainer"
)

// asTrainer makes the test binary the fake trainer (TestMain).
const asTrainer = "RLFLOW_TRAINERTEST_AS_TRAINER"

func TestMain(m *testing.M) {
	if os.Getenv(asTrainer) == "1" {
		os.Exit(Main())
	}
	os.Exit(m.Run())
}

// client talks to a fake trainer started directly (no Manager).
type client struct {
	t   *testing.T
	cmd *exec.Cmd
	req *os.File
	rep *bufio.Reader
	id  int
}

func startFake(t *testing.T, env ...string) *client {
	t.Helper()
	exe, err := os.Executable()
	require.NoError(t, err)
	childReq, req, err := os.Pipe()
	require.NoError(t, err)
	rep, childRep, err := os.Pipe()
	require.NoError(t, err)
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), append([]string{asTrainer + "=1", trainer.EnvFDs + "=3,4", EnvShmDir + "=" + t.TempDir(),
		trainer.EnvRunID + "=r1"}, env...)...)
	cmd.ExtraFiles = []*os.File{childReq, childRep}
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	childReq.Close()
	childRep.Close()
	t.Cleanup(func() {
		req.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		rep.Close()
	})
	return &client{t: t, cmd: cmd, req: req, rep: bufio.NewReader(rep)}
}

// call sends op with fields and returns the decoded reply.
func (c *client) call(op string, fields map[string]any) map[string]any {
	c.t.Helper()
	c.id++
	m := map[string]any{"id": c.id, "op": op}
	for k, v := range fields {
		m[k] = v
	}
	b, err := json.Marshal(m)
	require.NoError(c.t, err)
	return c.send(b)
}

func (c *client) send(line []byte) map[string]any {
	c.t.Helper()
	_, err := c.req.Write(append(line, '\n'))
	require.NoError(c.t, err)
	text, err := c.rep.ReadBytes('\n')
	require.NoError(c.t, err)
	var reply map[string]any
	require.NoError(c.t, json.Unmarshal(text, &reply))
	return reply
}

func okReply(t *testing.T, r map[string]any) map[string]any {
	t.Helper()
	require.Equal(t, true, r["ok"], "%v", r["error"])
	return r
}

func refusal(t *testing.T, r map[string]any) string {
	t.Helper()
	require.Equal(t, false, r["ok"])
	return r["error"].(string)
}

// snapshotOf reads a publish reply into a trainer.Snapshot.
func snapshotOf(t *testing.T, r map[string]any) *trainer.Snapshot {
	t.Helper()
	b, err := json.Marshal(r["tensors"])
	require.NoError(t, err)
	var ts []trainer.Tensor
	require.NoError(t, json.Unmarshal(b, &ts))
	s := &trainer.Snapshot{Version: r["version"].(string), IPC: r["ipc"].(string), Path: r["path"].(string),
		StorageBytes: int64(r["storage_bytes"].(float64)), Tensors: ts}
	require.NoError(t, s.Validate())
	return s
}

func TestFakeSpeaksTheProtocol(t *testing.T) {
	ro := rollouts(t, `{"a":1}`, `{"a":2}`)
	c := startFake(t, EnvShapes+"=w=4x4,v=3", trainer.EnvDevice+"=2")
	h := okReply(t, c.call("hello", map[string]any{"protocol": 1}))
	assert.Equal(t, float64(1), h["protocol"])
	assert.Equal(t, float64(2), h["device"])
	assert.Equal(t, float64(0), h["iteration"])
	assert.Equal(t, float64(c.cmd.Process.Pid), h["pid"])

	assert.Contains(t, refusal(t, c.call("train", map[string]any{"iteration": 2, "rollouts": ro, "args": map[string]any{}})),
		"the model is at iteration 0, so the next is 1")
	assert.Contains(t, refusal(t, c.call("train", map[string]any{"iteration": 1, "rollouts": ro, "args": map[string]any{}, "lr": 1})),
		`unknown field "lr"`)
	assert.Contains(t, refusal(t, c.call("train", map[string]any{"iteration": 1, "rollouts": ro})), `field "args" missing`)
	tr := okReply(t, c.call("train", map[string]any{"iteration": 1, "rollouts": ro, "args": map[string]any{"k": 1}}))
	assert.Equal(t, float64(1), tr["iteration"])
	metrics := tr["metrics"].(map[string]any)
	assert.Equal(t, float64(2), metrics["samples"])
	assert.Greater(t, metrics["loss"], 0.0)
	assert.Positive(t, tr["step_done_unix"])

	p := okReply(t, c.call("publish", map[string]any{"version": "v1", "dtype": "keep"}))
	s := snapshotOf(t, p)
	assert.Equal(t, trainer.IPCFakeShm, s.IPC)
	assert.Equal(t, []trainer.Tensor{{Name: "w", DType: "float32", Shape: []int64{4, 4}, Offset: 0, Bytes: 64},
		{Name: "v", DType: "float32", Shape: []int64{3}, Offset: 64, Bytes: 12}}, s.Tensors)
	keep, err := WeightsDigest(s.Path, s)
	require.NoError(t, err)
	assert.Contains(t, refusal(t, c.call("publish", map[string]any{"version": "v2", "dtype": "keep"})), "the previous version is not released yet")
	assert.Contains(t, refusal(t, c.call("release", map[string]any{"version": "v0"})), "not the published one")
	okReply(t, c.call("release", map[string]any{"version": "v1"}))

	p = okReply(t, c.call("publish", map[string]any{"version": "v2", "dtype": "bfloat16", "ipc_refs": false}))
	assert.NotContains(t, p, "ipc_refs", "not asked for")
	s2 := snapshotOf(t, p)
	assert.Equal(t, s.Path, s2.Path, "the snapshot file is kept across publishes")
	assert.Equal(t, int64(38), s2.StorageBytes)
	assert.Equal(t, "bfloat16", s2.Tensors[1].DType)
	okReply(t, c.call("release", map[string]any{"version": "v2"}))

	for _, bad := range []any{nil, "true", 1} {
		assert.Contains(t, refusal(t, c.call("publish", map[string]any{"version": "v3", "dtype": "keep", "ipc_refs": bad})),
			`field "ipc_refs": want a bool`, "%v", bad)
	}
	p = okReply(t, c.call("publish", map[string]any{"version": "v3", "dtype": "keep", "ipc_refs": true}))
	fakeHandle := base64.StdEncoding.EncodeToString([]byte(FakeRefCounterHandle))
	assert.Equal(t, []any{
		map[string]any{"ref_counter_handle": fakeHandle, "ref_counter_offset": float64(0), "event_handle": nil, "event_sync_required": false},
		map[string]any{"ref_counter_handle": fakeHandle, "ref_counter_offset": float64(1), "event_handle": nil, "event_sync_required": false},
	}, p["ipc_refs"], "one per tensor, in order")
	okReply(t, c.call("release", map[string]any{"version": "v3"}))

	ckpt := filepath.Join(t.TempDir(), "ckpt-1")
	assert.Contains(t, refusal(t, c.call("save", map[string]any{"path": ckpt, "iteration": 2})), "the model is at iteration 1")
	sv := okReply(t, c.call("save", map[string]any{"path": ckpt, "iteration": 1}))
	assert.Equal(t, ckpt, sv["path"])
	assert.Positive(t, sv["bytes"])
	okReply(t, c.call("shutdown", nil))
	require.NoError(t, c.cmd.Wait(), "shutdown exits 0")
	_, err = os.Stat(s.Path)
	assert.ErrorIs(t, err, os.ErrNotExist, "the snapshot file is removed on exit")

	// Another process loads the checkpoint and publishes the same bytes.
	c2 := startFake(t, EnvShapes+"=w=4x4,v=3")
	okReply(t, c2.call("hello", map[string]any{"protocol": 1}))
	l := okReply(t, c2.call("load", map[string]any{"path": ckpt}))
	assert.Equal(t, float64(1), l["iteration"])
	s3 := snapshotOf(t, okReply(t, c2.call("publish", map[string]any{"version": "v1", "dtype": "keep"})))
	again, err := WeightsDigest(s3.Path, s3)
	require.NoError(t, err)
	assert.Equal(t, keep, again)
}

func TestFakeRefusesMalformedRequests(t *testing.T) {
	c := startFake(t)
	assert.Contains(t, refusal(t, c.send([]byte(`not json`))), "not a JSON object")
	assert.Contains(t, refusal(t, c.send([]byte(`{"id":5,"op":"dance"}`))), `op "dance": unknown`)
	assert.Contains(t, refusal(t, c.send([]byte(`{"id":5,"op":"hello","protocol":1}`))), "want an integer above the last request's 5")
	assert.Contains(t, refusal(t, c.send([]byte(`{"id":6,"op":"hello","protocol":2}`))), "protocol 2: this trainer speaks 1")
	assert.Contains(t, refusal(t, c.send([]byte(`{"id":7,"op":"publish","version":"v","dtype":"float8"}`))), "dtype: want keep, bfloat16 or float16")
}

func TestFakeExitsOnEndOfFile(t *testing.T) {
	c := startFake(t)
	okReply(t, c.call("hello", map[string]any{"protocol": 1}))
	c.req.Close() // what the worker's death does to fd 3
	require.NoError(t, c.cmd.Wait())
	assert.Equal(t, 0, c.cmd.ProcessState.ExitCode())
}

func TestFakeNeedsItsPipes(t *testing.T) {
	exe, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), asTrainer+"=1")
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	assert.Equal(t, 2, exit.ExitCode())
	assert.Contains(t, string(out), "RLFLOW_TRAINER_FDS is \"\", want 3,4")

	cmd = exec.Command(exe)
	cmd.Env = append(os.Environ(), asTrainer+"=1", trainer.EnvFDs+"=3,4", EnvDie+"=train")
	out, _ = cmd.CombinedOutput()
	assert.Contains(t, string(out), `RLFLOW_FAKE_TRAINER_DIE: "train": want train:N, save:N or publish:N`)
}
