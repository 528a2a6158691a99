package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestWorkerRoots(t *testing.T) {
	tmp, err := filepath.EvalSymlinks(t.TempDir())
	require.NoError(t, err)
	a, b, logs := filepath.Join(tmp, "a"), filepath.Join(tmp, "b"), filepath.Join(tmp, "state", "logs")
	require.NoError(t, os.Mkdir(a, 0o755))
	require.NoError(t, os.Mkdir(b, 0o755))

	r, err := workerRoots(a+string(os.PathListSeparator)+" "+b+string(os.PathListSeparator), logs)
	require.NoError(t, err)
	assert.Equal(t, []string{a, b, logs}, r.Dirs(), "the listed roots, then the worker's own, created")
	assert.DirExists(t, logs)

	for _, tc := range []struct{ list, want string }{
		{"/", `--roots: root "/": the whole file system cannot be a root`},
		{a + string(os.PathListSeparator) + "/proc", `--roots: root "/proc": /proc holds the host's processes`},
		{filepath.Join(tmp, "missing"), "--roots: root " + `"` + filepath.Join(tmp, "missing") + `": stat`},
	} {
		_, err := workerRoots(tc.list, logs)
		if assert.Error(t, err, tc.list) {
			assert.Contains(t, err.Error(), tc.want)
		}
	}

	t.Chdir(a)
	r, err = workerRoots("")
	require.NoError(t, err)
	assert.Equal(t, []string{a}, r.Dirs(), "the working directory by default")

	t.Chdir("/")
	_, err = workerRoots("", logs)
	if assert.Error(t, err) {
		assert.Contains(t, err.Error(), `the default root, the working directory: root "/": the whole file system cannot be a root`)
		assert.Contains(t, err.Error(), "pass --roots or set RLFLOW_ROOTS")
	}
}
