package activities

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"go.temporal.io/sdk/activity"
)

// ExecInput is the `with` of an exec step.
type ExecInput struct {
	Context   pipelines.StepContext `json:"context"`
	Command   []string              `json:"command"`
	Env       map[string]string     `json:"env,omitempty"`
	Dir       string                `json:"dir,omitempty"`
	KillGrace pipelines.Duration    `json:"kill_grace,omitempty"`
}

// ExecOutput is an exec step's outputs: exit_code, log, and every key the
// command wrote to $RLFLOW_OUTPUTS, flattened into one JSON object.
type ExecOutput struct {
	ExitCode int
	Log      string
	Values   map[string]any
	Attempt  int
}

// MarshalJSON flattens the declared values next to the fixed keys.
func (o ExecOutput) MarshalJSON() ([]byte, error) {
	m := make(map[string]any, len(o.Values)+3)
	for k, v := range o.Values {
		m[k] = v
	}
	m["exit_code"], m["log"], m[pipelines.MetaAttempt] = o.ExitCode, o.Log, o.Attempt
	return json.Marshal(m)
}

// ExecHeartbeat is the progress an exec step reports while it runs.
type ExecHeartbeat struct {
	PID      int    `json:"pid"`
	Log      string `json:"log"`
	LogBytes int64  `json:"log_bytes"`
	Elapsed  string `json:"elapsed"`
}

const (
	logTailBytes    = 2048
	maxOutputsBytes = 1 << 20
)

// Exec runs a command: its stdout and stderr go to one log file per attempt,
// it heartbeats while the command runs, and on cancellation or timeout its
// whole process group gets SIGTERM, then SIGKILL after kill_grace.
func (a *Activities) Exec(ctx context.Context, in ExecInput) (*ExecOutput, error) {
	if err := resolveArgs(ctx, pipelines.StepExec, &in); err != nil {
		return nil, err
	}
	if in.Command[0] == "" {
		return nil, badInput(ctx, "exec: command[0], the program, is empty")
	}
	attempt := attemptOf(ctx)
	sc := in.Context
	dir := resolvePath(sc.BaseDir, in.Dir)
	if dir != "" {
		if st, err := os.Stat(dir); err != nil || !st.IsDir() {
			return nil, badInput(ctx, "exec: dir %q is not a directory", dir)
		}
	}
	prog, err := lookPath(in.Command[0], dir)
	if err != nil {
		return nil, stepError(ctx, pipelines.ErrTypeCommandNotFound, err, "exec")
	}

	logDir := stepDir(a.LogDir, sc)
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		return nil, stepError(ctx, pipelines.ErrTypeIO, err, "exec: creating the log dir")
	}
	logPath := filepath.Join(logDir, fmt.Sprintf("attempt-%d.log", attempt))
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, stepError(ctx, pipelines.ErrTypeIO, err, "exec: creating the log")
	}
	defer logFile.Close()
	outputsPath := filepath.Join(logDir, fmt.Sprintf("attempt-%d.outputs", attempt))
	if err := os.WriteFile(outputsPath, nil, 0o644); err != nil {
		return nil, stepError(ctx, pipelines.ErrTypeIO, err, "exec: creating the outputs file")
	}

	cmd := exec.Command(prog, in.Command[1:]...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.Env = append(os.Environ(),
		"RLFLOW_OUTPUTS="+outputsPath,
		"RLFLOW_PIPELINE="+sc.Pipeline,
		"RLFLOW_RUN_ID="+sc.RunID,
		"RLFLOW_ITERATION="+strconv.Itoa(sc.Iteration),
		"RLFLOW_STEP="+sc.StepID,
		"RLFLOW_ATTEMPT="+strconv.Itoa(attempt),
	)
	keys := make([]string, 0, len(in.Env))
	for k := range in.Env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		cmd.Env = append(cmd.Env, k+"="+in.Env[k])
	}
	// Own process group, so cancellation reaches the command's children;
	// Pdeathsig, so a SIGKILLed worker does not leave the command running
	// next to the retry that another worker starts.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, stepError(ctx, pipelines.ErrTypeIO, err, "exec: starting %s", prog)
	}
	waitErr := a.superviseProcess(ctx, cmd, logPath, in.KillGrace.D())
	tail := fileTail(logPath, logTailBytes)

	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	if waitErr != nil {
		var exitErr *exec.ExitError
		if errors.As(waitErr, &exitErr) {
			if ws, ok := exitErr.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				return nil, stepError(ctx, pipelines.ErrTypeSignal, nil, "exec: %s killed by signal %v (log %s); log tail:\n%s", in.Command[0], ws.Signal(), logPath, tail)
			}
			return nil, stepError(ctx, pipelines.ErrTypeExit, nil, "exec: %s exited with code %d (log %s); log tail:\n%s", in.Command[0], exitErr.ExitCode(), logPath, tail)
		}
		return nil, stepError(ctx, pipelines.ErrTypeIO, waitErr, "exec: waiting for %s", in.Command[0])
	}
	values, err := readOutputs(outputsPath)
	if err != nil {
		return nil, badInput(ctx, "exec: %v", err)
	}
	var missing []string
	for _, k := range sc.Outputs {
		if _, ok := values[k]; !ok {
			missing = append(missing, k)
		}
	}
	if len(missing) > 0 {
		return nil, stepError(ctx, pipelines.ErrTypeOutputMissing, nil, "exec: %s did not write declared output(s) %s to $RLFLOW_OUTPUTS; log tail:\n%s",
			in.Command[0], strings.Join(missing, ", "), tail)
	}
	return &ExecOutput{ExitCode: 0, Log: logPath, Values: values, Attempt: attempt}, nil
}

// superviseProcess waits for cmd, heartbeating, and kills its process group
// when ctx ends. It returns cmd.Wait's error.
func (a *Activities) superviseProcess(ctx context.Context, cmd *exec.Cmd, logPath string, grace time.Duration) error {
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	start := time.Now()
	tick := time.NewTicker(a.heartbeatEvery(ctx))
	defer tick.Stop()
	pgid := cmd.Process.Pid
	for {
		select {
		case err := <-done:
			return err
		case <-tick.C:
			if activity.IsActivity(ctx) {
				var size int64
				if st, err := os.Stat(logPath); err == nil {
					size = st.Size()
				}
				activity.RecordHeartbeat(ctx, ExecHeartbeat{PID: pgid, Log: logPath, LogBytes: size, Elapsed: time.Since(start).Round(time.Second).String()})
			}
		case <-ctx.Done():
			_ = syscall.Kill(-pgid, syscall.SIGTERM)
			select {
			case err := <-done:
				return err
			case <-time.After(grace):
				_ = syscall.Kill(-pgid, syscall.SIGKILL)
				return <-done
			}
		}
	}
}

func lookPath(name, dir string) (string, error) {
	if strings.Contains(name, "/") {
		p := resolvePath(dir, name)
		st, err := os.Stat(p)
		if err != nil {
			return "", fmt.Errorf("command %q not found", name)
		}
		if st.IsDir() || st.Mode()&0o111 == 0 {
			return "", fmt.Errorf("command %q is not an executable file", name)
		}
		return p, nil
	}
	p, err := exec.LookPath(name)
	if err != nil {
		return "", fmt.Errorf("command %q not found in PATH", name)
	}
	return p, nil
}

func fileTail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return ""
	}
	off := max(st.Size()-n, 0)
	b, _ := io.ReadAll(io.NewSectionReader(f, off, st.Size()-off))
	return string(b)
}

var outputKey = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// readOutputs parses GitHub-Actions-style outputs: `key=value` lines and
// `key<<DELIM` ... `DELIM` blocks. A value that is a JSON number or bool
// becomes one, so `until` can compare scores; anything else stays a string.
func readOutputs(path string) (map[string]any, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reading outputs: %w", err)
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > maxOutputsBytes {
		return nil, fmt.Errorf("$RLFLOW_OUTPUTS is %d bytes, over the %d-byte limit (write large data to files, output their paths)", st.Size(), maxOutputsBytes)
	}
	out := map[string]any{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), maxOutputsBytes)
	line := 0
	for sc.Scan() {
		line++
		text := sc.Text()
		if strings.TrimSpace(text) == "" {
			continue
		}
		if k, delim, ok := strings.Cut(text, "<<"); ok && outputKey.MatchString(k) && !strings.Contains(k, "=") {
			var b strings.Builder
			closed := false
			for sc.Scan() {
				line++
				if sc.Text() == delim {
					closed = true
					break
				}
				if b.Len() > 0 {
					b.WriteByte('\n')
				}
				b.WriteString(sc.Text())
			}
			if !closed {
				return nil, fmt.Errorf("$RLFLOW_OUTPUTS line %d: %s<<%s is never closed by a %s line", line, k, delim, delim)
			}
			out[k] = b.String()
			continue
		}
		k, v, ok := strings.Cut(text, "=")
		if !ok || !outputKey.MatchString(k) {
			return nil, fmt.Errorf("$RLFLOW_OUTPUTS line %d: want key=value with key like [A-Za-z_][A-Za-z0-9_]*, got %q", line, truncate(text, 80))
		}
		out[k] = typedValue(v)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading $RLFLOW_OUTPUTS: %w", err)
	}
	return out, nil
}

func typedValue(v string) any {
	switch v {
	case "true":
		return true
	case "false":
		return false
	}
	var n json.Number
	if json.Unmarshal([]byte(v), &n) == nil && strings.TrimSpace(v) == v {
		if f, err := n.Float64(); err == nil {
			return f
		}
	}
	return v
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
