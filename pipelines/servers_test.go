package pipelines

import (
	"os"
	"path/filepath"
	"testing"
)

func TestServersFromParams(t *testing.T) {
	const file = `version: 1
name: servers-params
params:
  vllm: {type: string, default: "http://localhost:8000"}
  port: {type: int, default: 8001}
servers:
  - url: "${{ params.vllm }}"
  - {url: "http://127.0.0.1:${{ params.port }}", api: C}
  - url: http://fixed:9000
steps:
  - {id: a, uses: noop}
`
	path := filepath.Join(t.TempDir(), "p.yaml")
	if err := os.WriteFile(path, []byte(file), 0o644); err != nil {
		t.Fatal(err)
	}
	p, err := LoadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		params  map[string]string
		want    []string
		wantErr string
	}{
		{"defaults", nil, []string{"http://localhost:8000", "http://127.0.0.1:8001", "http://fixed:9000"}, ""},
		{"launch values", map[string]string{"vllm": "https://gpu-node-3:8443", "port": "9"}, []string{"https://gpu-node-3:8443", "http://127.0.0.1:9", "http://fixed:9000"}, ""},
		{"not a URL", map[string]string{"vllm": "gpu-node-3:8000"}, nil, `servers[0].url: URL "gpu-node-3:8000" must start with http:// or https://`},
		{"no host", map[string]string{"vllm": "http://"}, nil, `servers[0].url: URL "http://" has no host`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			params, err := p.ResolveParams(tc.params)
			if err != nil {
				t.Fatal(err)
			}
			got, err := p.ServersFor(params)
			if tc.wantErr != "" {
				if err == nil || err.Error() != tc.wantErr {
					t.Fatalf("got error %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("got %d servers, want %d", len(got), len(tc.want))
			}
			for i, s := range got {
				if s.URL != tc.want[i] {
					t.Errorf("server %d: got %q, want %q", i, s.URL, tc.want[i])
				}
			}
			if got[1].API != "C" {
				t.Errorf("other fields are kept: %+v", got[1])
			}
			if p.Servers[0].URL != "${{ params.vllm }}" {
				t.Errorf("the spec was modified: %q", p.Servers[0].URL)
			}
		})
	}
}
