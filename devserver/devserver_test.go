package devserver

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// writeScript writes an executable shell script: a test double of a
// command (go, temporal).
func writeScript(t *testing.T, dir, name, body string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, []byte("#!/bin/sh\n"+body), 0o755))
	return p
}

// A temporal on PATH is used when recent enough, so a first run does not
// build one; an old one, or another program of that name, is refused with
// the reason and how to build.
func TestFindTemporalOnPath(t *testing.T) {
	for _, tc := range []struct {
		name    string
		version string
		wantErr string
	}{
		{"release", "temporal version 1.5.1 (Server 1.29.1, UI 2.42.1)", ""},
		{"newer major", "temporal version 2.0.0 (Server 1.30.0, UI 3.0.0)", ""},
		{"source build", "temporal version 0.0.0-DEV (Server 1.29.1, UI 2.42.1)", ""},
		{"too old", "temporal version 0.13.2 (Server 1.24.2, UI 2.28.0)", "is version 0.13.2; rlflow needs 1.0.0 or later; build it with `make bin/temporal`"},
		{"not the CLI", "Temporal: a tempo tool v3", `is not the Temporal CLI: --version printed "Temporal: a tempo tool v3"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			bin := writeScript(t, dir, "temporal", "echo '"+tc.version+"'\n")
			t.Setenv("PATH", dir)
			t.Setenv("RLFLOW_TEMPORAL", "")
			t.Chdir(t.TempDir()) // no bin/temporal, no module root
			got, err := FindTemporal("")
			if tc.wantErr != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), "temporal on PATH ("+bin+") ")
				assert.Contains(t, err.Error(), tc.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, bin, got)
		})
	}
}

// The build prints go install -v's lines as they come and the time
// elapsed while it runs, so a first run does not look hung.
func TestBuildTemporalShowsProgress(t *testing.T) {
	dir := t.TempDir()
	goDouble := writeScript(t, dir, "go", `[ "$1 $2" = "install -v" ] || { echo "want go install -v, got: $*" >&2; exit 2; }
echo "github.com/temporalio/cli/internal" >&2
sleep 1
echo "github.com/temporalio/cli/cmd/temporal" >&2
printf '#!/bin/sh\necho temporal version 1.5.1\n' > "$GOBIN/temporal"
chmod +x "$GOBIN/temporal"
`)
	var out bytes.Buffer
	bin, err := buildTemporal(context.Background(), goDouble, filepath.Join(dir, "bin"), &out, 50*time.Millisecond)
	require.NoError(t, err, out.String())
	assert.Equal(t, filepath.Join(dir, "bin", "temporal"), bin)
	text := out.String()
	first := strings.Index(text, "  github.com/temporalio/cli/internal\n")
	last := strings.Index(text, "  github.com/temporalio/cli/cmd/temporal\n")
	require.True(t, first >= 0 && last > first, text)
	assert.Contains(t, text[first:last], "  still building the Temporal CLI: ", "progress between the lines:\n%s", text)
	assert.Contains(t, text[first:last], "elapsed, 1 lines of `go install -v` so far", text)

	failing := writeScript(t, dir, "go-failing", "echo 'go: github.com/temporalio/cli@v1.5.1: no network' >&2; exit 1\n")
	out.Reset()
	_, err = buildTemporal(context.Background(), failing, filepath.Join(dir, "bin2"), &out, time.Hour)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "building the Temporal CLI (go install "+TemporalCLIModule+") failed after ")
	assert.Contains(t, out.String(), "  go: github.com/temporalio/cli@v1.5.1: no network\n")
}
