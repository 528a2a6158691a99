//go:build linux

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/internal/testutil/gputest"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/stretchr/testify/require"
)

// TestGPUResidentPipelineIPC is the resident loop over vLLM's own ipc
// backend on the GPU, against the nccl path in the same test: a Temporal
// dev server, the real GPU worker, bench_trainer.py resident (fixed seed),
// and two generation-E servers: receiver.py (nccl) as rank 1 of the
// broadcast, and receiver.py --backend ipc on the trainer's GPU, which
// takes update_info as vLLM's ipc_engine does: it unpickles
// ipc_handles_pickled (written by the Go worker), finds its GPU's UUID,
// and rebuilds every tensor with torch's own rebuild_cuda_tensor from the
// trainer's CUDA IPC handle and ref-counter shares. Run N publishes over
// nccl, run I over ipc, same seed and rollouts: after every iteration the
// ipc server holds byte for byte what the nccl server holds, both end on
// the trainer's last checkpoint, and the ipc server released every storage
// it opened (torch's ref counting balanced).
//
// It skips as TestGPUResidentPipelineSIGKILL does; the command is in
// tests/gpu/resident-run.sh (ONLY=e2e).
func TestGPUResidentPipelineIPC(t *testing.T) {
	r, env := newResidentGPURig(t, func(r *residentGPURig) {
		for _, b := range []string{pipelines.BackendNCCL, pipelines.BackendIPC} {
			r.backend = b
			checkSpec(t, r.spec(t.TempDir(), 0))
		}
	})
	ctx := env.ctx
	r.phase("receivers")
	urls := map[string]string{}
	for _, b := range []string{pipelines.BackendNCCL, pipelines.BackendIPC} {
		urls[b] = env.startReceiver(b)
	}
	env.startWorkers()

	runs := map[string]residentGPURun{}
	for _, b := range []string{pipelines.BackendNCCL, pipelines.BackendIPC} {
		r.backend, r.url = b, urls[b]
		runs[b] = r.run(ctx, "resident-gpu-"+b, 0)
	}
	r.phase("comparing")

	reps := map[string]receiverReport{}
	for b, url := range urls {
		rep, raw, err := getReceived(ctx, url)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(r.logs, t.Name()+"."+b+".received.json"), raw, 0o644))
		gputest.Verdict(t, len(rep.History) == residentIterations && len(rep.Failures) == 0,
			"the %s server completed %d updates (want %d, one per publish), %d failed", b, len(rep.History), residentIterations, len(rep.Failures))
		if len(rep.History) != residentIterations {
			t.FailNow()
		}
		reps[b] = rep
	}
	viaNCCL, viaIPC := reps[pipelines.BackendNCCL].History, reps[pipelines.BackendIPC].History
	for i := range residentIterations {
		want := fmt.Sprintf("iter-%d", i+1)
		pub := runs[pipelines.BackendIPC].publish[i+1]
		gputest.Verdict(t, pub.Attempts == 1 && pub.Outputs["backend"] == pipelines.BackendIPC && fmt.Sprint(pub.Outputs["methods"]) == "[ipc]" &&
			pub.Outputs["iteration"] == float64(i+1),
			"iteration %d's ipc publish: attempts %d, backend %v, methods %v, the trainer's iteration %v; %v bytes in %vs (snapshot %vs; the nccl publish took %vs)",
			i+1, pub.Attempts, pub.Outputs["backend"], pub.Outputs["methods"], pub.Outputs["iteration"], pub.Outputs["bytes"], pub.Outputs["seconds"],
			pub.Outputs["snapshot_seconds"], runs[pipelines.BackendNCCL].publish[i+1].Outputs["seconds"])
		h := viaIPC[i]
		gputest.Verdict(t, h.Version == want && h.Paused && h.Stats["backend"] == pipelines.BackendIPC && h.Stats["storages_alive_after_drop"] == float64(0),
			"ipc server update %d: version %q (want %q), paused %v (want true), backend %v, rebuilt storages still alive after the update %v (want 0), %v storages opened",
			i+1, h.Version, want, h.Paused, h.Stats["backend"], h.Stats["storages_alive_after_drop"], h.Stats["storages"])
		bad := gputest.DigestMismatches(h.SHA256, viaNCCL[i].SHA256)
		gputest.Verdict(t, len(h.SHA256) > 0 && bad == 0, "iteration %d: the ipc server holds %d of %d tensors as the nccl server does (SHA-256)",
			i+1, len(viaNCCL[i].SHA256)-bad, len(viaNCCL[i].SHA256))
	}
	gputest.Verdict(t, gputest.DigestMismatches(viaIPC[0].SHA256, viaIPC[1].SHA256) > 0, "the weights after iterations 1 and 2 differ (the comparison above can see a change)")
	for b, run := range runs {
		want, err := safetensorsDigests(run.final)
		if err != nil {
			gputest.Verdict(t, false, "run %s: %v", run.id, err)
			continue
		}
		last := reps[b].History[residentIterations-1].SHA256
		bad := gputest.DigestMismatches(last, want)
		gputest.Verdict(t, bad == 0, "run %s: the %s server's last update holds the bytes of %s: %d of %d tensors", run.id, b, run.final, len(want)-bad, len(want))
	}
	for _, g := range viaIPC[0].Stats["pickle_globals"].([]any) {
		gputest.Verdict(t, strings.HasPrefix(fmt.Sprint(g), "torch"), "the pickle names only torch globals: %v", g)
	}
	r.phase("done")
}
