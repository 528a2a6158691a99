package rlflow_test

import (
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gopkg.in/yaml.v3"
)

// TestDockerCompose checks docker-compose.yml without a Docker engine: the
// structure here, and `docker-compose config` where the tool is installed.
func TestDockerCompose(t *testing.T) {
	b, err := os.ReadFile("docker-compose.yml")
	require.NoError(t, err)
	var doc struct {
		Services map[string]struct {
			Image    string   `yaml:"image"`
			Build    any      `yaml:"build"`
			Ports    []string `yaml:"ports"`
			Command  []string `yaml:"command"`
			Profiles []string `yaml:"profiles"`
		} `yaml:"services"`
	}
	require.NoError(t, yaml.Unmarshal(b, &doc))
	for _, name := range []string{"postgresql", "temporal", "temporal-ui", "rlflow-worker", "rlflow-gpu-worker", "vllm"} {
		assert.Contains(t, doc.Services, name)
	}
	assert.Contains(t, doc.Services["rlflow-gpu-worker"].Command, "--gpu")
	assert.Equal(t, []string{"gpu"}, doc.Services["vllm"].Profiles, "vLLM needs a GPU: only with --profile gpu")
	assert.Equal(t, []string{"worker", "--log-dir", "/data/logs"}, doc.Services["rlflow-worker"].Command)
	for name, s := range doc.Services {
		for _, p := range s.Ports {
			assert.Regexp(t, `^127\.0\.0\.1:`, p, "%s publishes on loopback only", name)
		}
	}
	if _, err := exec.LookPath("docker-compose"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("CI installs docker-compose (.ci/run); it is missing")
		}
		t.Skip("docker-compose not installed: structural checks only")
	}
	out, err := exec.Command("docker-compose", "-f", "docker-compose.yml", "config", "-q").CombinedOutput()
	require.NoError(t, err, "%s", out)
}
