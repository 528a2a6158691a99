package rlflow_test

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/workflows"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gopkg.in/yaml.v3"
)

type composeFile struct {
	Services map[string]struct {
		Image       string            `yaml:"image"`
		Build       any               `yaml:"build"`
		Ports       []string          `yaml:"ports"`
		Command     []string          `yaml:"command"`
		Profiles    []string          `yaml:"profiles"`
		Environment map[string]string `yaml:"environment"`
		Volumes     []string          `yaml:"volumes"`
	} `yaml:"services"`
}

// TestDockerCompose checks docker-compose.yml without a Docker engine: the
// structure here, and `docker-compose config` where the tool is installed.
func TestDockerCompose(t *testing.T) {
	b, err := os.ReadFile("docker-compose.yml")
	require.NoError(t, err)
	var doc composeFile
	require.NoError(t, yaml.Unmarshal(b, &doc))
	for _, name := range []string{"postgresql", "temporal-schema", "temporal", "temporal-setup", "temporal-ui", "rlflow-worker", "rlflow-gpu-worker", "vllm"} {
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

// TestDockerComposeRunsTestedTemporal checks that docker-compose.yml runs
// the Temporal server the cluster tests and `make bench` run: the release
// the Makefile builds (TEMPORAL_SERVER_VERSION), its schema and admin tools
// of the same release, the dynamic config file the cluster tests use
// (testutil.ShippedDynamicConfig) mounted where DYNAMIC_CONFIG_FILE_PATH
// points, and rlflow's search attributes with their types.
func TestDockerComposeRunsTestedTemporal(t *testing.T) {
	b, err := os.ReadFile("docker-compose.yml")
	require.NoError(t, err)
	var doc composeFile
	require.NoError(t, yaml.Unmarshal(b, &doc))
	mk, err := os.ReadFile("Makefile")
	require.NoError(t, err)
	m := regexp.MustCompile(`(?m)^TEMPORAL_SERVER_VERSION\s*:=\s*v(\S+)$`).FindSubmatch(mk)
	require.NotNil(t, m, "Makefile sets TEMPORAL_SERVER_VERSION := vX.Y.Z")
	version := string(m[1])

	assert.Equal(t, "temporalio/server:"+version, doc.Services["temporal"].Image)
	for _, name := range []string{"temporal-schema", "temporal-setup"} {
		assert.Equal(t, "temporalio/admin-tools:"+version, doc.Services[name].Image, name)
	}

	temporal := doc.Services["temporal"]
	target := temporal.Environment["DYNAMIC_CONFIG_FILE_PATH"]
	require.NotEmpty(t, target, "the temporal service sets DYNAMIC_CONFIG_FILE_PATH")
	var mounted []string
	for _, v := range temporal.Volumes {
		if parts := strings.Split(v, ":"); len(parts) >= 2 && parts[1] == target {
			mounted = append(mounted, parts[0])
		}
	}
	assert.Equal(t, []string{"./" + testutil.ShippedDynamicConfig}, mounted,
		"the file mounted at DYNAMIC_CONFIG_FILE_PATH (%s) is the one the cluster tests use", target)
	assert.Equal(t, "4", temporal.Environment["NUM_HISTORY_SHARDS"], "the shards the cluster tests run")

	setup := strings.Join(doc.Services["temporal-setup"].Command, " ")
	for name, typ := range workflows.SearchAttributeTypes {
		assert.Contains(t, setup, "--name "+name+" --type "+typ, "temporal-setup registers %s", name)
	}
}
