package activities

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm/double"
)

// confined is a root with files and links, and a directory beside it
// holding a secret.
type confined struct {
	root, outside string
	roots         *Roots
}

const testSecret = "sk-confine-Zq81"

func newConfined(t *testing.T) confined {
	t.Helper()
	tmp, err := filepath.EvalSymlinks(t.TempDir())
	require.NoError(t, err)
	c := confined{root: filepath.Join(tmp, "root"), outside: filepath.Join(tmp, "outside")}
	for _, d := range []string{c.root + "/data", c.outside} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	writeLines(t, c.root, "data/p.jsonl", promptLines(2)...)
	writeLines(t, c.outside, "secret.env", "OPENAI_API_KEY="+testSecret)
	for link, target := range map[string]string{
		"link-out":     c.outside + "/secret.env",
		"dirlink-out":  c.outside,
		"rel-link-out": "../outside/secret.env",
		"link-in":      "data",
		"dangling-out": c.outside + "/new.jsonl",
		"dangling-in":  "data/new.jsonl",
		"loop":         "loop",
		"climb":        "missing/../link-out",
	} {
		require.NoError(t, os.Symlink(target, filepath.Join(c.root, link)))
	}
	c.roots, err = NewRoots(c.root)
	require.NoError(t, err)
	return c
}

func TestRootsResolve(t *testing.T) {
	c := newConfined(t)
	for _, tc := range []struct {
		name, base, path string
		want             string // "" means refused
	}{
		{"relative", c.root, "data/p.jsonl", c.root + "/data/p.jsonl"},
		{"empty is the base", c.root, "", c.root},
		{"absolute inside", "/", c.root + "/data/p.jsonl", c.root + "/data/p.jsonl"},
		{"missing inside (an output)", c.root, "new/dir/out.jsonl", c.root + "/new/dir/out.jsonl"},
		{"symlink inside", c.root, "link-in/p.jsonl", c.root + "/data/p.jsonl"},
		{"dangling symlink landing inside", c.root, "dangling-in", c.root + "/data/new.jsonl"},
		{"dot-dot inside", c.root, "data/../data/p.jsonl", c.root + "/data/p.jsonl"},
		{"absolute outside", c.root, c.outside + "/secret.env", ""},
		{"absolute outside, missing", c.root, c.outside + "/missing.env", ""},
		{"dot-dot escape", c.root, "../outside/secret.env", ""},
		{"dot-dot escape through a dir", c.root, "data/../../outside/x", ""},
		{"dot-dot escape of an output", c.root, "../../x", ""},
		{"symlink out", c.root, "link-out", ""},
		{"relative symlink out", c.root, "rel-link-out", ""},
		{"directory symlink out", c.root, "dirlink-out/new.jsonl", ""},
		{"dangling symlink out (an output)", c.root, "dangling-out", ""},
		{"symlink loop", c.root, "loop", ""},
		{"symlink climbing through a missing dir", c.root, "climb", ""},
		{"/proc/self/environ", c.root, "/proc/self/environ", ""},
		{"/etc/passwd", c.root, "/etc/passwd", ""},
		{"/dev/null", c.root, "/dev/null", ""},
		{"base / with a relative path", "/", strings.TrimPrefix(c.root, "/") + "/data/p.jsonl", ""},
		{"base outside", c.outside, "secret.env", ""},
		{"base relative", "root", "data/p.jsonl", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := c.roots.Resolve("with.prompts", tc.base, tc.path)
			if tc.want != "" {
				require.NoError(t, err)
				assert.Equal(t, tc.want, got)
				return
			}
			require.Error(t, err, "resolved to %s", got)
			msg := err.Error()
			assert.True(t, strings.HasPrefix(msg, "with.prompts: "), "names the field: %s", msg)
			if !strings.Contains(msg, "is not an absolute path") {
				assert.Contains(t, msg, c.root, "names the roots")
			}
			assert.NotContains(t, msg, testSecret)
			if tc.base != c.root && !filepath.IsAbs(tc.path) {
				assert.Contains(t, msg, "base_dir", "names the base")
			}
		})
	}
}

// A refusal tells nothing of what lies outside: the message for a file
// that exists is the one for a file that does not.
func TestRootsResolveSameMessageWhetherOrNotItExists(t *testing.T) {
	c := newConfined(t)
	for _, p := range []string{c.outside + "/secret.env", "../outside/secret.env", "link-out"} {
		_, errThere := c.roots.Resolve("spec_path", c.root, p)
		require.Error(t, errThere)
		require.NoError(t, os.Rename(c.outside+"/secret.env", c.outside+"/moved"))
		_, errGone := c.roots.Resolve("spec_path", c.root, p)
		require.NoError(t, os.Rename(c.outside+"/moved", c.outside+"/secret.env"))
		require.Error(t, errGone)
		assert.Equal(t, errThere.Error(), errGone.Error(), "%s", p)
	}
	_, err := c.roots.Resolve("spec_path", c.root, "/nonexistent-dir/x")
	_, err2 := c.roots.Resolve("spec_path", c.root, "/etc/xxxxxxxxxx-x")
	require.Error(t, err)
	require.Error(t, err2)
	assert.Equal(t, strings.Replace(err.Error(), "/nonexistent-dir/x", "P", 1), strings.Replace(err2.Error(), "/etc/xxxxxxxxxx-x", "P", 1))
}

func TestNewRoots(t *testing.T) {
	tmp, err := filepath.EvalSymlinks(t.TempDir())
	require.NoError(t, err)
	file := filepath.Join(tmp, "f")
	require.NoError(t, os.WriteFile(file, nil, 0o644))
	require.NoError(t, os.Mkdir(filepath.Join(tmp, "real"), 0o755))
	require.NoError(t, os.Symlink("real", filepath.Join(tmp, "link")))
	require.NoError(t, os.Symlink("/", filepath.Join(tmp, "slash")))

	r, err := NewRoots(filepath.Join(tmp, "link"), filepath.Join(tmp, "real"))
	require.NoError(t, err)
	assert.Equal(t, []string{filepath.Join(tmp, "real")}, r.Dirs(), "resolved and deduplicated")

	for _, tc := range []struct{ dir, want string }{
		{"/", "whole file system"},
		{filepath.Join(tmp, "slash"), "whole file system"},
		{"/proc", "/proc holds the host's"},
		{"/proc/self", "/proc holds the host's"},
		{"/sys/kernel", "/sys holds the host's"},
		{"/dev", "/dev holds the host's"},
		{filepath.Join(tmp, "missing"), "no such file or directory"},
		{file, "not a directory"},
		{"", "empty directory name"},
	} {
		_, err := NewRoots(tmp, tc.dir)
		if assert.Error(t, err, "%q", tc.dir) {
			assert.Contains(t, err.Error(), tc.want)
		}
	}
	_, err = NewRoots()
	assert.Error(t, err)
}

// TestLoadPipelineConfined loads spec_paths a UI user might type.
func TestLoadPipelineConfined(t *testing.T) {
	c := newConfined(t)
	pipe := "version: 1\nname: p\nsteps:\n  - {id: a, uses: noop}\n"
	require.NoError(t, os.WriteFile(c.root+"/ok.yaml", []byte(pipe), 0o644))
	require.NoError(t, os.WriteFile(c.root+"/other-base.yaml", []byte("base_dir: "+c.outside+"\n"+pipe), 0o644))
	require.NoError(t, os.WriteFile(c.root+"/not-a-pipeline.env", []byte("OPENAI_API_KEY="+testSecret+"\n"), 0o644))
	require.NoError(t, syscall.Mkfifo(c.root+"/fifo.yaml", 0o644))
	a := New(Deps{LogDir: t.TempDir(), Roots: c.roots})
	ctx := context.Background()

	p, err := a.LoadPipeline(ctx, c.root+"/ok.yaml")
	require.NoError(t, err)
	assert.Equal(t, c.root, p.BaseDir)

	for _, tc := range []struct{ path, want string }{
		{c.outside + "/secret.env", "spec_path: "},
		{c.outside + "/absent.env", "spec_path: "},
		{c.root + "/link-out", "spec_path: "},
		{"/proc/self/environ", "spec_path: "},
		{"/etc/shadow", "spec_path: "},
		{c.root + "/fifo.yaml", "a named pipe (FIFO), not a regular file"},
		{c.root + "/data", "a directory, not a regular file"},
		{c.root + "/not-a-pipeline.env", "values masked"},
		{c.root + "/other-base.yaml", "base_dir: "},
	} {
		t.Run(filepath.Base(tc.path), func(t *testing.T) {
			done := make(chan error, 1)
			go func() {
				_, err := a.LoadPipeline(ctx, tc.path)
				done <- err
			}()
			var err error
			select {
			case err = <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("LoadPipeline hangs")
			}
			assert.Equal(t, pipelines.ErrTypeBadInput, errType(t, err))
			assert.Contains(t, err.Error(), tc.want)
			assert.NotContains(t, err.Error(), testSecret)
			if strings.HasPrefix(tc.want, "spec_path") {
				assert.NotContains(t, err.Error(), "no such file", "never tells whether a path outside exists")
			}
		})
	}
}

// TestConfinedSteps runs steps whose paths leave the root: each fails as
// bad input naming the field, before anything is read or written.
func TestConfinedSteps(t *testing.T) {
	c := newConfined(t)
	require.NoError(t, syscall.Mkfifo(c.root+"/fifo.jsonl", 0o644))
	d := newDouble(t, double.Config{DevMode: true})
	a := New(Deps{LogDir: t.TempDir(), DataDir: t.TempDir(), Roots: c.roots, HeartbeatEvery: 20 * time.Millisecond,
		Getenv: func(string) string { return "" }})
	sc := pipelines.StepContext{Pipeline: "p", RunID: "run-1", Iteration: 1, StepID: "s", BaseDir: c.root, Servers: servers(d)}
	atBase := func(base string) pipelines.StepContext { s := sc; s.BaseDir = base; return s }
	withDisk := func(s pipelines.StepContext) pipelines.StepContext {
		s.WeightTransfer = &pipelines.WeightTransfer{Backend: pipelines.BackendDisk}
		return s
	}
	ctx := context.Background()
	run := func(f func() error) error {
		done := make(chan error, 1)
		go func() { done <- f() }()
		select {
		case err := <-done:
			return err
		case <-time.After(30 * time.Second):
			t.Fatal("the step hangs")
			return nil
		}
	}
	for _, tc := range []struct {
		name, want string
		step       func() error
	}{
		{"generate prompts outside", "with.prompts: ", func() error {
			_, err := a.Generate(ctx, GenerateInput{Context: sc, Prompts: c.outside + "/secret.env", MaxTokens: 4})
			return err
		}},
		{"generate prompts through a link", "with.prompts: ", func() error {
			_, err := a.Generate(ctx, GenerateInput{Context: sc, Prompts: "link-out", MaxTokens: 4})
			return err
		}},
		{"generate prompts a FIFO", "a named pipe (FIFO), not a regular file", func() error {
			_, err := a.Generate(ctx, GenerateInput{Context: sc, Prompts: "fifo.jsonl", MaxTokens: 4})
			return err
		}},
		{"generate output climbing out", "with.output: ", func() error {
			_, err := a.Generate(ctx, GenerateInput{Context: sc, Prompts: "data/p.jsonl", Output: "../../x.jsonl", MaxTokens: 4})
			return err
		}},
		{"generate output through a dangling link", "with.output: ", func() error {
			_, err := a.Generate(ctx, GenerateInput{Context: sc, Prompts: "data/p.jsonl", Output: "dangling-out", MaxTokens: 4})
			return err
		}},
		{"generate base_dir /", "base_dir \"/\"", func() error {
			_, err := a.Generate(ctx, GenerateInput{Context: atBase("/"), Prompts: "etc/passwd", MaxTokens: 4})
			return err
		}},
		{"evaluate prompts outside", "with.prompts: ", func() error {
			_, err := a.Evaluate(ctx, EvaluateInput{GenerateInput: GenerateInput{Context: sc, Prompts: "/etc/passwd", MaxTokens: 4},
				Scorer: []byte(`{"type": "exact_match"}`)})
			return err
		}},
		{"exec dir outside", "with.dir: ", func() error {
			_, err := a.Exec(ctx, ExecInput{Context: sc, Command: []string{"sh", "-c", "touch x"}, Dir: c.outside})
			return err
		}},
		{"exec at base_dir /", "base_dir \"/\"", func() error {
			_, err := a.Exec(ctx, ExecInput{Context: atBase("/"), Command: []string{"sh", "-c", "touch x"}})
			return err
		}},
		{"exec program climbing out", "with.command[0]: ", func() error {
			_, err := a.Exec(ctx, ExecInput{Context: sc, Command: []string{"../outside/run.sh"}})
			return err
		}},
		{"broadcast checkpoint outside", "with.checkpoint: ", func() error {
			_, err := a.Broadcast(ctx, BroadcastInput{Context: withDisk(sc), Checkpoint: c.outside})
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := run(tc.step)
			assert.Equal(t, pipelines.ErrTypeBadInput, errType(t, err))
			assert.Contains(t, err.Error(), tc.want)
			assert.NotContains(t, err.Error(), testSecret)
		})
	}
	entries, err := os.ReadDir(c.outside)
	require.NoError(t, err)
	require.Len(t, entries, 1, "nothing was written outside the root")
	_, err = os.Stat(filepath.Join(filepath.Dir(c.root), "x.jsonl"))
	assert.True(t, os.IsNotExist(err))
	_, err = os.Stat("/x")
	assert.True(t, os.IsNotExist(err))
}

func TestSafeName(t *testing.T) {
	for in, want := range map[string]string{
		"run-1":       "run-1",
		"":            "_",
		".":           "_",
		"..":          "_.",
		".attempts":   "_attempts",
		"../../etc":   "_._.._etc",
		"a/b c":       "a_b_c",
		"wf.2025-x_y": "wf.2025-x_y",
	} {
		assert.Equal(t, want, safeName(in), "%q", in)
	}
	dir := stepDir("/logs", pipelines.StepContext{RunID: "..", Iteration: 1, StepID: ".."})
	assert.True(t, strings.HasPrefix(dir, "/logs/"), "%s stays under the root", dir)
}
