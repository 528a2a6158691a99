package activities

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/procs"
	"github.com/rlflow/rlflow/redact"
	"go.temporal.io/sdk/activity"
)

// ExecInput is the `with` of an exec step.
type ExecInput struct {
	Context   pipelines.StepContext `json:"context"`
	Command   []string              `json:"command"`
	Env       map[string]string     `json:"env,omitempty"`
	Secrets   []string              `json:"secrets,omitempty"`
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
	// AdoptedAttempt is the earlier attempt whose command this attempt
	// adopted (0: its own command): Log and Values are that command's.
	AdoptedAttempt int
}

// metaAdoptedAttempt is the metadata key of ExecOutput.AdoptedAttempt; like
// every "_" key it is in the activity's result, never a step output.
const metaAdoptedAttempt = "_adopted_attempt"

// MarshalJSON flattens the declared values next to the fixed keys.
func (o ExecOutput) MarshalJSON() ([]byte, error) {
	m := make(map[string]any, len(o.Values)+4)
	for k, v := range o.Values {
		m[k] = v
	}
	m["exit_code"], m["log"], m[pipelines.MetaAttempt] = o.ExitCode, o.Log, o.Attempt
	if o.AdoptedAttempt > 0 {
		m[metaAdoptedAttempt] = o.AdoptedAttempt
	}
	return json.Marshal(m)
}

// ExecHeartbeat is the progress an exec step reports while it runs.
type ExecHeartbeat struct {
	PID      int    `json:"pid"`
	Log      string `json:"log"`
	LogBytes int64  `json:"log_bytes"`
	Elapsed  string `json:"elapsed"`
	// AdoptedAttempt is the earlier attempt whose command this one waits
	// for, when it adopted one.
	AdoptedAttempt int `json:"adopted_attempt,omitempty"`
}

const (
	logTailBytes    = 2048
	maxOutputsBytes = 1 << 20
)

// Exec runs a command: its stdout and stderr go to one log file per attempt,
// it heartbeats while the command runs, and on cancellation or timeout its
// whole process group and every process carrying its tag get SIGTERM, then
// SIGKILL after kill_grace.
//
// One trainer per step (attempts.go has the whole rule): before it starts
// the command, Exec kills whatever an earlier attempt of the step left
// running on this host, or, when that attempt was lost to the server while
// its command ran on in this worker process, adopts the command: it waits
// for it and reports its exit code, log and outputs as this attempt's, with
// _adopted_attempt naming the attempt that started it.
func (a *Activities) Exec(ctx context.Context, in ExecInput) (*ExecOutput, error) {
	return a.exec(ctx, in, attemptInfoOf(ctx))
}

func (a *Activities) exec(ctx context.Context, in ExecInput, at attemptInfo) (*ExecOutput, error) {
	// Mask the worker's secrets in every error below, with or without
	// the worker's Interceptor.
	ctx = withMasker(ctx, a.secrets)
	if err := resolveArgs(ctx, pipelines.StepExec, &in); err != nil {
		return nil, err
	}
	if in.Command[0] == "" {
		return nil, badInput(ctx, "exec: command[0], the program, is empty")
	}
	if err := a.learnSecrets(ctx, in); err != nil {
		return nil, err
	}
	sc := in.Context
	dir, err := a.Roots.Resolve("with.dir", sc.BaseDir, in.Dir)
	if err != nil {
		return nil, badInput(ctx, "exec: %v", err)
	}
	if dir != "" {
		if st, err := os.Stat(dir); err != nil || !st.IsDir() {
			return nil, badInput(ctx, "exec: dir %q is not a directory", dir)
		}
	}
	// A relative program path names a file of the pipeline's tree, which
	// the roots confine like any other; an absolute one or a name looked up
	// in PATH is a program of the host (as python is), not a file to read.
	name := in.Command[0]
	if strings.Contains(name, "/") && !filepath.IsAbs(name) {
		if name, err = a.Roots.resolveFrom("with.command[0]", name, "with.dir", dir); err != nil {
			return nil, badInput(ctx, "exec: %v", err)
		}
	}
	prog, err := lookPath(name, dir)
	if err != nil {
		return nil, stepError(ctx, pipelines.ErrTypeCommandNotFound, err, "exec")
	}
	logDir := stepDir(a.LogDir, sc)
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		return nil, stepError(ctx, pipelines.ErrTypeIO, err, "exec: creating the log dir")
	}
	logPath := filepath.Join(logDir, fmt.Sprintf("attempt-%d.log", at.Attempt))
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, stepError(ctx, pipelines.ErrTypeIO, err, "exec: creating the log")
	}
	defer logFile.Close()

	// Settle the step's earlier attempts and start (or adopt) the command
	// under the step's claim, heartbeating: killing an earlier command may
	// take its kill_grace.
	grace := in.KillGrace.D()
	key := stepKey(sc)
	stopBeat := a.keepHeartbeating(ctx)
	slot, release := a.execs.lock(key)
	p, taken, err := a.settle(ctx, key, slot, at, grace)
	if err == nil && p == nil {
		p, taken, err = a.startCommand(in, prog, dir, logFile, logPath, at, key, slot)
	}
	release()
	stopBeat()
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, stepError(ctx, pipelines.ErrTypeIO, err, "exec: attempt %d", at.Attempt)
	}
	adopted := 0
	if p.rec.Attempt != at.Attempt {
		adopted = p.rec.Attempt
		fmt.Fprintf(logFile, "rlflow: attempt %d adopted the command of attempt %d (%s), which the Temporal server had lost while the command ran on; "+
			"it waits for that command instead of starting a second one. The command's output is in %s\n", at.Attempt, adopted, p.rec.Leader, p.rec.Log)
	}

	waitErr, err := a.supervise(ctx, p, taken, at, grace, adopted)
	if err != nil {
		return nil, err
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	logPath, outputsPath := p.rec.Log, p.rec.Outputs
	// The outputs file is masked on disk whatever the command's outcome
	// (the log stays as the command wrote it: its tail is masked when
	// quoted).
	if err := maskFile(a.secrets, outputsPath, maxOutputsBytes); err != nil {
		return nil, stepError(ctx, pipelines.ErrTypeIO, err, "exec: %s ended (%v), but masking secrets in its outputs file failed", in.Command[0], exitText(waitErr))
	}
	tail := fileTail(a.secrets, logPath, logTailBytes)
	from := ""
	if adopted > 0 {
		from = fmt.Sprintf(", attempt %d's command", adopted)
	}
	if waitErr != nil {
		var exitErr *exec.ExitError
		if errors.As(waitErr, &exitErr) {
			if ws, ok := exitErr.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				return nil, stepError(ctx, pipelines.ErrTypeSignal, nil, "exec: %s killed by signal %v (log %s%s); log tail:\n%s", in.Command[0], ws.Signal(), logPath, from, tail)
			}
			return nil, stepError(ctx, pipelines.ErrTypeExit, nil, "exec: %s exited with code %d (log %s%s); log tail:\n%s", in.Command[0], exitErr.ExitCode(), logPath, from, tail)
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
		return nil, stepError(ctx, pipelines.ErrTypeOutputMissing, nil, "exec: %s did not write declared output(s) %s to $RLFLOW_OUTPUTS (log %s%s); log tail:\n%s",
			in.Command[0], strings.Join(missing, ", "), logPath, from, tail)
	}
	return &ExecOutput{ExitCode: 0, Log: logPath, Values: values, Attempt: at.Attempt, AdoptedAttempt: adopted}, nil
}

// startCommand starts the attempt's own command: a fresh outputs file, the
// step's environment plus a fresh tag, its own process group.
func (a *Activities) startCommand(in ExecInput, prog, dir string, logFile *os.File, logPath string, at attemptInfo, key string, slot *execSlot) (*liveExec, <-chan struct{}, error) {
	sc := in.Context
	h, err := a.execs.self()
	if err != nil {
		return nil, nil, err
	}
	tag, err := procs.NewTag()
	if err != nil {
		return nil, nil, err
	}
	outputsPath := filepath.Join(filepath.Dir(logPath), fmt.Sprintf("attempt-%d.outputs", at.Attempt))
	if err := os.WriteFile(outputsPath, nil, 0o644); err != nil {
		return nil, nil, fmt.Errorf("creating the outputs file: %w", err)
	}
	cmd := exec.Command(prog, in.Command[1:]...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if cmd.Env, err = a.commandEnv(in, outputsPath, at.Attempt); err != nil {
		return nil, nil, err
	}
	// Last, so the step's env cannot change it: every descendant carries
	// it, which is how Kill finds the ones that leave the group.
	cmd.Env = append(cmd.Env, procs.TagEnv+"="+tag)
	// Own process group, so cancellation reaches the command's children;
	// Pdeathsig, so a SIGKILLed worker's command dies with it (its
	// descendants are found by the tag: by the next worker's sweep, or
	// the step's next attempt), and only then: startLive starts it with
	// procs.Start, from a thread that never ends.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	rec := attemptRecord{RunID: sc.RunID, Iteration: sc.Iteration, StepID: sc.StepID,
		WorkflowID: at.WorkflowID, WorkflowRunID: at.WorkflowRunID, ActivityID: at.ActivityID, Attempt: at.Attempt,
		Tag: tag, Log: logPath, Outputs: outputsPath, KillGrace: in.KillGrace, Started: time.Now(), Deadline: at.Deadline,
		Owner: h.Self, Host: h.Name, BootID: h.BootID}
	p, err := a.startLive(cmd, rec, key, slot, in.KillGrace.D())
	if p == nil {
		return nil, nil, fmt.Errorf("starting %s: %w", prog, err)
	}
	if err != nil {
		// The command runs but its record is not current: end it rather
		// than run what a restarted worker might not find.
		_, _ = p.kill(context.Background(), in.KillGrace.D())
		return nil, nil, err
	}
	return p, p.taken, nil
}

// supervise waits for p's command on behalf of attempt at, heartbeating.
// It returns cmd.Wait's error once the command ended, or err when the
// attempt must return without a result: its context ended (the command is
// killed, or detached when the server lost the attempt) or a later attempt
// adopted the command.
func (a *Activities) supervise(ctx context.Context, p *liveExec, taken <-chan struct{}, at attemptInfo, grace time.Duration, adopted int) (waitErr, err error) {
	tick := time.NewTicker(a.heartbeatEvery(ctx))
	defer tick.Stop()
	for {
		select {
		case <-p.done:
			p.finish()
			return p.waitErr, nil
		case <-taken:
			return nil, stepError(ctx, pipelines.ErrTypeIO, nil,
				"exec: a later attempt of this step adopted attempt %d's command (the server had given attempt %d up)", at.Attempt, at.Attempt)
		case <-tick.C:
			if activity.IsActivity(ctx) {
				var size int64
				if st, err := os.Stat(p.rec.Log); err == nil {
					size = st.Size()
				}
				activity.RecordHeartbeat(ctx, ExecHeartbeat{PID: p.rec.Leader.PID, Log: p.rec.Log, LogBytes: size,
					Elapsed: time.Since(p.rec.Started).Round(time.Second).String(), AdoptedAttempt: adopted})
			}
		case <-ctx.Done():
			if lostToServer(context.Cause(ctx)) && !at.Last && !at.Deadline.IsZero() && time.Now().Before(at.Deadline) &&
				p.detach(at.Attempt, at.Deadline) {
				return nil, ctx.Err()
			}
			if _, kerr := p.kill(context.Background(), grace); kerr != nil {
				return nil, stepError(ctx, pipelines.ErrTypeIO, kerr, "exec: ending %s after the attempt ended (%v)", p.rec.Leader, context.Cause(ctx))
			}
			return nil, ctx.Err()
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

// fileTail is the last n bytes of the file, every secret masked (a tail
// never starts with a piece of one).
func fileTail(m *redact.Masker, path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return ""
	}
	tail, _ := m.Tail(f, st.Size(), n)
	return tail
}

// maskFile masks the secrets in a file of at most limit bytes, in place
// (replaced atomically, so a reader sees it whole, before or after). A
// larger file is left alone: nothing of it is read into a step's result.
func maskFile(m *redact.Masker, path string, limit int64) error {
	if m.Len() == 0 {
		return nil
	}
	st, err := os.Stat(path)
	if err != nil || st.Size() > limit {
		return nil // a missing file is readOutputs' to report
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	masked := m.Mask(string(b))
	if masked == string(b) {
		return nil
	}
	tmp := path + ".masking"
	if err := os.WriteFile(tmp, []byte(masked), st.Mode().Perm()); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// exitText says how a command ended, for a message.
func exitText(waitErr error) string {
	if waitErr == nil {
		return "exit code 0"
	}
	return waitErr.Error()
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
