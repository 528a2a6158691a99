package trainer

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/rlflow/rlflow/procs"
)

// The environment the supervisor adds to the trainer's (PROTOCOL.md).
const (
	EnvFDs        = "RLFLOW_TRAINER_FDS"
	EnvDevice     = "RLFLOW_TRAINER_DEVICE"
	EnvRunID      = "RLFLOW_RUN_ID"
	EnvGeneration = "RLFLOW_TRAINER_GENERATION"
)

// frameRead is what the reader goroutine hands over: one frame or the
// error that ended the stream.
type frameRead struct {
	line []byte
	err  error
}

// proc is one trainer process and the pipes to it. Calls on it are
// serialised by the run's lock; end and the Wait goroutine may run
// concurrently with a call.
type proc struct {
	cmd        *exec.Cmd
	generation int
	group      procs.Run // the process group and tag, for Kill
	logPath    string
	grace      time.Duration

	req  *os.File       // our end of fd 3
	rep  *os.File       // our end of fd 4
	read chan frameRead // frames from the reader goroutine
	quit chan struct{}  // closed by end: the reader stops
	done chan struct{}  // closed once Wait returned

	// Under the run's lock (one call at a time).
	nextID    int64
	iteration int    // the trainer's last trained iteration
	helloPID  int    // the pid hello named
	published string // the version this process published and was not told to release ("" none)

	mu       sync.Mutex
	busy     string // what the call in flight does ("train of iteration 3"), "" idle
	diedIn   string // busy when the process exited
	why      string // why this side ended it ("" it ended on its own)
	waitErr  error
	endOnce  sync.Once
	endError error
}

// startProc starts spec's command as generation gen of runID's trainer:
// fd 3 and 4 are the request and reply pipes, its own process group and a
// fresh procs tag (so Kill finds descendants that leave the group),
// SIGKILL when this worker's thread dies, stdout and stderr appended to
// the log.
func startProc(runID string, spec Spec, gen int) (*proc, error) {
	if err := os.MkdirAll(spec.CheckpointDir, 0o700); err != nil {
		return nil, errorf(IO, err, "creating the checkpoint directory")
	}
	logFile, err := os.OpenFile(spec.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, errorf(IO, err, "opening the trainer's log")
	}
	defer logFile.Close() // the child holds its own copy
	tag, err := procs.NewTag()
	if err != nil {
		return nil, errorf(IO, err, "starting the trainer")
	}
	childReq, req, err := os.Pipe()
	if err != nil {
		return nil, errorf(IO, err, "making the request pipe")
	}
	rep, childRep, err := os.Pipe()
	if err != nil {
		childReq.Close()
		req.Close()
		return nil, errorf(IO, err, "making the reply pipe")
	}
	cmd := exec.Command(spec.Command[0], spec.Command[1:]...)
	cmd.Dir = spec.Dir
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.ExtraFiles = []*os.File{childReq, childRep} // fd 3, fd 4
	cmd.Env = append(append([]string(nil), spec.Env...),
		EnvFDs+"=3,4",
		EnvDevice+"="+strconv.Itoa(spec.Device),
		EnvRunID+"="+runID,
		EnvGeneration+"="+strconv.Itoa(gen),
		// Last, so nothing of Env overrides it.
		procs.TagEnv+"="+tag)
	// Own process group so a kill reaches the trainer's children;
	// Pdeathsig so the trainer dies with this worker (and only then:
	// procs.Start forks from a thread that never ends).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	err = procs.Start(cmd)
	childReq.Close()
	childRep.Close()
	if err != nil {
		req.Close()
		rep.Close()
		kind := IO
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, fs.ErrPermission) {
			kind = BadInput
		}
		return nil, errorf(kind, err, "starting the trainer")
	}
	leader, err := procs.Of(cmd.Process.Pid)
	if err != nil {
		// It exited already; the group is empty, the tag finds the rest.
		leader = procs.Identity{PID: cmd.Process.Pid}
	}
	p := &proc{
		cmd: cmd, generation: gen, group: procs.Run{Leader: leader, Tag: tag},
		logPath: spec.LogPath, grace: spec.KillGrace,
		req: req, rep: rep,
		read: make(chan frameRead), quit: make(chan struct{}), done: make(chan struct{}),
	}
	go p.wait()
	go p.readFrames()
	return p, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) wait() {
	err := p.cmd.Wait()
	p.mu.Lock()
	p.waitErr, p.diedIn = err, p.busy
	p.mu.Unlock()
	close(p.done)
}

func (p *proc) readFrames() {
	br := bufio.NewReaderSize(p.rep, 64<<10)
	for {
		line, err := readFrame(br, MaxFrameBytes)
		select {
		case p.read <- frameRead{line, err}:
		case <-p.quit:
			return
		}
		if err != nil {
			return
		}
	}
}

// exited reports whether the process has exited (and was reaped).
func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// exitText says how the exited process ended: "exited with status 1",
// "killed by signal 9".
func (p *proc) exitText() string {
	p.mu.Lock()
	err := p.waitErr
	p.mu.Unlock()
	st := p.cmd.ProcessState
	if st == nil {
		return fmt.Sprintf("ended (%v)", err)
	}
	if ws, ok := st.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return fmt.Sprintf("killed by signal %d", int(ws.Signal()))
	}
	return fmt.Sprintf("exited with status %d", st.ExitCode())
}

// endText says how the ended process ended: how it exited, or why this
// side ended it.
func (p *proc) endText() string {
	p.mu.Lock()
	why := p.why
	p.mu.Unlock()
	if why != "" {
		return "was ended: " + why
	}
	return p.exitText()
}

// goneCause says why this (ended) process is gone, for Restart.Cause:
// how it ended and, when it ended on its own, during which call.
func (p *proc) goneCause() string {
	p.mu.Lock()
	why, during := p.why, p.diedIn
	p.mu.Unlock()
	switch {
	case why != "":
		return fmt.Sprintf("trainer pid %d %s", p.pid(), p.endText())
	case during == "":
		return fmt.Sprintf("trainer pid %d %s while idle", p.pid(), p.exitText())
	default:
		return fmt.Sprintf("trainer pid %d %s during %s", p.pid(), p.exitText(), during)
	}
}

func (p *proc) setBusy(what string) {
	p.mu.Lock()
	p.busy = what
	p.mu.Unlock()
}

// end ends the process for the reason why (kept for Restart.Cause unless
// it had already exited on its own): SIGTERM to its group and tagged
// descendants, SIGKILL after the grace, then the pipes are closed and the
// exit reaped. Safe to call more than once and concurrently with a call.
func (p *proc) end(why string) error {
	p.endOnce.Do(func() {
		p.mu.Lock()
		if p.why == "" && !p.exited() {
			p.why = why
		}
		p.mu.Unlock()
		// Also after a clean exit: its descendants may live on.
		_, err := p.group.Kill(context.Background(), p.grace)
		p.req.Close()
		<-p.done
		close(p.quit)
		p.rep.Close()
		if err != nil {
			p.endError = errorf(IO, err, "ending trainer pid %d", p.pid())
		}
	})
	return p.endError
}

// call sends one request and returns its checked reply. what names the
// call in messages ("train of iteration 3"). The process exiting first is
// Died; ctx ending kills it and is Died wrapping ctx's error; a malformed
// frame is Protocol and kills it (the conversation cannot resynchronise);
// an ok:false reply is Refused and leaves it running.
func (p *proc) call(ctx context.Context, what, op string, fields map[string]any) (*reply, error) {
	if err := ctx.Err(); err != nil {
		return nil, errorf(Died, err, "%s: not sent", what)
	}
	p.nextID++
	ref := frameRef{op: op, id: p.nextID, what: what}
	line, err := encodeRequest(ref.id, op, fields)
	if err != nil {
		return nil, errorf(BadInput, err, "%s: encoding the request", what)
	}
	p.setBusy(what)
	defer p.setBusy("")
	wrote := make(chan error, 1)
	go func() {
		_, err := p.req.Write(line)
		wrote <- err
	}()
	select {
	case err := <-wrote:
		if err != nil {
			return nil, p.died(what)
		}
	case <-ctx.Done():
		return nil, p.cancelled(ctx, what)
	case <-p.done:
		return nil, p.died(what)
	}
	var fr frameRead
	select {
	case fr = <-p.read:
	case <-ctx.Done():
		return nil, p.cancelled(ctx, what)
	case <-p.done:
		select {
		case fr = <-p.read: // it replied, then exited
		default:
			return nil, p.died(what)
		}
	}
	if errors.Is(fr.err, errFrameTooLong) {
		perr := ref.protocolError("%v", fr.err)
		_ = p.end("a protocol error: " + perr.Msg)
		return nil, perr
	}
	if fr.err != nil {
		// Its reply pipe closed: it is exiting. Wait for the exit (to
		// say how it ended), but not past the grace.
		select {
		case <-p.done:
		case <-time.After(p.grace):
			_ = p.end("it closed its reply pipe but did not exit")
		}
		return nil, p.died(what)
	}
	r, err := decodeReply(ref, fr.line)
	var e *Error
	if errors.As(err, &e) && e.Kind == Protocol {
		_ = p.end("a protocol error: " + e.Msg)
	}
	if err != nil {
		return nil, err
	}
	return r, nil
}

// died is the Died error for a call the process did not answer; it also
// ends what is left of the process's group.
func (p *proc) died(what string) error {
	if !p.exited() {
		select {
		case <-p.done:
		case <-time.After(p.grace):
		}
	}
	_ = p.end("it stopped answering")
	return errorf(Died, nil, "%s: trainer pid %d %s (log %s)", what, p.pid(), p.endText(), p.logPath)
}

// cancelled ends the process because ctx ended during the call.
func (p *proc) cancelled(ctx context.Context, what string) error {
	_ = p.end(fmt.Sprintf("%s was cancelled (%v)", what, context.Cause(ctx)))
	return errorf(Died, ctx.Err(), "%s: trainer pid %d ended because the call ended", what, p.pid())
}

// protocolFault ends the process after a reply that breaks the protocol in
// a way only the caller can see (a field that does not match the request)
// and returns err.
func (p *proc) protocolFault(err error) error {
	_ = p.end("a protocol error: " + err.Error())
	return err
}
