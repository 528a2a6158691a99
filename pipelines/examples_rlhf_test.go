package pipelines

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestRLHFExamplesShape pins what the RLHF examples promise in their
// comments: the seed pipeline follows vLLM's rlhf_http.py step for step,
// resume always runs, servers come from params, and the data files exist.
func TestRLHFExamplesShape(t *testing.T) {
	for _, tc := range []struct {
		file    string
		order   []string
		backend string
		servers int
	}{
		{"examples/seed-nccl.yaml", []string{"world_size", "before", "init", "pause", "sync", "resume", "after"}, BackendNCCL, 1},
		{"examples/multi-server.yaml", []string{"rollout", "train", "pause", "sync", "resume", "eval"}, BackendNCCL, 2},
		{"examples/disk.yaml", []string{"rollout", "train", "pause", "sync", "resume", "eval"}, BackendDisk, 1},
	} {
		t.Run(tc.file, func(t *testing.T) {
			p, err := LoadFile(tc.file)
			if err != nil {
				t.Fatal(err)
			}
			order, err := p.Order()
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(order, tc.order) {
				t.Errorf("order %v, want %v", order, tc.order)
			}
			if p.WeightTransfer == nil || p.WeightTransfer.Backend != tc.backend {
				t.Errorf("weight_transfer %+v, want backend %s", p.WeightTransfer, tc.backend)
			}
			if tc.backend == BackendNCCL && !p.WeightTransfer.Packed {
				t.Error("nccl examples broadcast packed, as rlhf_http.py does")
			}
			if s, _ := p.StepByID("resume"); s == nil || !s.Always || s.Uses != StepResume {
				t.Errorf("resume must be an always resume step: %+v", s)
			}
			if s, _ := p.StepByID("sync"); s == nil || s.Uses != StepBroadcast {
				t.Errorf("sync must be a broadcast: %+v", s)
			}
			params, err := p.ResolveParams(nil)
			if err != nil {
				t.Fatal(err)
			}
			servers, err := p.ServersFor(params)
			if err != nil || len(servers) != tc.servers {
				t.Errorf("servers %v (%v), want %d", servers, err, tc.servers)
			}
			for _, s := range p.Steps {
				if f, ok := s.With["prompts"].(string); ok {
					if _, err := os.Stat(filepath.Join(p.BaseDir, f)); err != nil {
						t.Errorf("step %s: %v", s.ID, err)
					}
				}
			}
		})
	}
}
