package activities

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync/atomic"
	"syscall"

	"github.com/rlflow/rlflow/pipelines"
	"go.temporal.io/sdk/activity"
)

// partialHeader is the first line of a partial file.
type partialHeader struct {
	Partial     int    `json:"rlflow_partial"`
	Fingerprint string `json:"fingerprint"`
}

// partialFile holds the finished prompts of this step's attempts: blocks of
// n rows, one per prompt, appended in completion order and fsynced, so a
// retried attempt skips them. The file name is the same for every attempt.
type partialFile struct {
	path   string
	f      *os.File
	off    int64
	blocks map[int][2]int64 // prompt index -> offset, length
}

func (pw *partialFile) has(idx int) bool { _, ok := pw.blocks[idx]; return ok }

// openPartial resumes the partial file when this is a retry (heartbeat
// details, or attempt > 1) and it was made from the same inputs; otherwise
// it starts a new one, so a stale file from another run is never reused.
func (g *genRun) openPartial(ctx context.Context) (*partialFile, int, error) {
	path := g.output + ".partial"
	retry := false
	if activity.IsActivity(ctx) {
		retry = activity.GetInfo(ctx).Attempt > 1 || activity.HasHeartbeatDetails(ctx)
		var hb GenerateProgress
		if activity.HasHeartbeatDetails(ctx) && activity.GetHeartbeatDetails(ctx, &hb) == nil && hb.Partial != "" && hb.Partial != path {
			activity.GetLogger(ctx).Warn("the earlier attempt's partial file is elsewhere; resuming from this one", "earlier", hb.Partial, "partial", path)
		}
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, 0, stepError(ctx, pipelines.ErrTypeIO, err, "%s: opening %s", g.step, path)
	}
	// One attempt at a time: a retry that starts while an earlier attempt
	// still runs (its worker cut off past the heartbeat timeout) must not
	// interleave its writes with it. The lock goes with the file's close.
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, 0, stepError(ctx, pipelines.ErrTypeIO, err, "%s: %s is locked by another attempt of this step that still runs (it stops at its next heartbeat)", g.step, path)
	}
	if retry {
		pw, n, err := resumePartial(f, path, g.fingerprint, g.set, g.in.N)
		if err == nil {
			return pw, n, nil
		}
		if activity.IsActivity(ctx) {
			activity.GetLogger(ctx).Warn("not resuming: starting the step's samples again", "partial", path, "reason", err.Error())
		}
	}
	hdr, _ := json.Marshal(partialHeader{Partial: 1, Fingerprint: g.fingerprint})
	hdr = append(hdr, '\n')
	if err := writeHeader(f, hdr); err != nil {
		f.Close()
		return nil, 0, stepError(ctx, pipelines.ErrTypeIO, err, "%s: writing the header of %s", g.step, path)
	}
	return &partialFile{path: path, f: f, off: int64(len(hdr)), blocks: map[int][2]int64{}}, 0, nil
}

// writeHeader empties f and writes hdr at its start, leaving f's offset
// just after it: every failure is returned, since a partial file without
// its header could never be resumed and would silently lose its prompts.
func writeHeader(f *os.File, hdr []byte) error {
	if err := f.Truncate(0); err != nil {
		return err
	}
	if _, err := f.WriteAt(hdr, 0); err != nil {
		return err
	}
	_, err := f.Seek(int64(len(hdr)), io.SeekStart)
	return err
}

// resumePartial reads the open partial file f: its complete prompt blocks
// count as done; a torn or foreign tail (a crash mid-write) is cut off.
// On error the caller still owns f.
func resumePartial(f *os.File, path, fingerprint string, set *promptSet, n int) (*partialFile, int, error) {
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, 0, err
	}
	br := bufio.NewReaderSize(f, 1<<20)
	first, err := br.ReadBytes('\n')
	var hdr partialHeader
	if err != nil || json.Unmarshal(first, &hdr) != nil || hdr.Partial != 1 {
		return nil, 0, fmt.Errorf("%s has no partial-file header", path)
	}
	if hdr.Fingerprint != fingerprint {
		return nil, 0, fmt.Errorf("%s was made from other inputs (prompts or sampling parameters changed)", path)
	}
	index := make(map[string]int, len(set.prompts))
	for i := range set.prompts {
		index[set.prompts[i].id] = i
	}
	pw := &partialFile{path: path, f: f, blocks: map[int][2]int64{}}
	off := int64(len(first))
	good := off // end of the last complete block
	blockStart, blockIdx, want := off, -1, 0
	for {
		line, err := br.ReadBytes('\n')
		if err != nil {
			break // EOF, or a torn last line without its newline
		}
		var row struct {
			PromptID string `json:"prompt_id"`
			Sample   int    `json:"sample"`
		}
		if json.Unmarshal(line, &row) != nil {
			break
		}
		idx, ok := index[row.PromptID]
		if !ok || row.Sample != want || (want > 0 && idx != blockIdx) || pw.has(idx) {
			break
		}
		if want == 0 {
			blockStart, blockIdx = off, idx
		}
		off += int64(len(line))
		want++
		if want == n {
			pw.blocks[idx] = [2]int64{blockStart, off - blockStart}
			good, want = off, 0
		}
	}
	if err := f.Truncate(good); err != nil {
		return nil, 0, err
	}
	if _, err := f.Seek(good, io.SeekStart); err != nil {
		return nil, 0, err
	}
	pw.off = good
	return pw, len(pw.blocks), nil
}

// maxUnsynced bounds the finished prompts the writer holds before an fsync.
const maxUnsynced = 256

// block is one finished prompt's rows.
type block struct {
	idx  int
	data []byte
}

// writeAll appends blocks, fsyncing whenever no further block is waiting.
// It reports its first error to failed at once and then only drains.
func (pw *partialFile) writeAll(blocks <-chan block, durable *atomic.Int64, failed func(error)) error {
	w := bufio.NewWriterSize(pw.f, 1<<20)
	var werr error
	unsynced := 0
	sync := func() {
		if werr == nil && unsynced > 0 {
			if werr = w.Flush(); werr == nil {
				werr = pw.f.Sync()
			}
			if werr == nil {
				durable.Add(int64(unsynced))
			}
			unsynced = 0
		}
	}
	for b := range blocks {
		if werr != nil {
			continue // drain, so that no worker blocks
		}
		if _, werr = w.Write(b.data); werr == nil {
			pw.blocks[b.idx] = [2]int64{pw.off, int64(len(b.data))}
			pw.off += int64(len(b.data))
			unsynced++
		}
		// Under a steady stream the channel is rarely empty: bound what
		// a crash could lose anyway.
		if len(blocks) == 0 || unsynced >= maxUnsynced {
			sync()
		}
		if werr != nil {
			failed(werr)
		}
	}
	if sync(); werr != nil {
		failed(werr)
	}
	return werr
}

// assemble writes the output in prompt order from the partial file's
// blocks: to a temporary file, fsynced, then renamed over the output.
func (pw *partialFile) assemble(output string, set *promptSet, n int) (*genResult, error) {
	tmp := output + ".tmp"
	out, err := os.Create(tmp)
	if err != nil {
		return nil, err
	}
	defer os.Remove(tmp) // after a successful rename there is nothing to remove
	defer out.Close()
	w := bufio.NewWriterSize(out, 1<<20)
	res := &genResult{path: output, prompts: len(set.prompts), samples: len(set.prompts) * n}
	versions := map[string]bool{}
	var buf []byte
	for idx := range set.prompts {
		blk, ok := pw.blocks[idx]
		if !ok {
			return nil, fmt.Errorf("prompt %s has no samples in %s", set.where(&set.prompts[idx]), pw.path)
		}
		if int64(cap(buf)) < blk[1] {
			buf = make([]byte, blk[1])
		}
		buf = buf[:blk[1]]
		if _, err := pw.f.ReadAt(buf, blk[0]); err != nil {
			return nil, fmt.Errorf("reading %s: %w", pw.path, err)
		}
		for line := range bytes.Lines(buf) {
			var row struct {
				CompletionTokens int64    `json:"completion_tokens"`
				WeightVersion    string   `json:"weight_version"`
				Score            *float64 `json:"score"`
				Unparsed         bool     `json:"unparsed"`
			}
			if err := json.Unmarshal(line, &row); err != nil {
				return nil, fmt.Errorf("%s: corrupt row: %w", pw.path, err)
			}
			res.completionTokens += row.CompletionTokens
			if row.WeightVersion != "" {
				versions[row.WeightVersion] = true
			}
			if row.Score != nil {
				s := *row.Score
				if res.scored == 0 || s < res.minS {
					res.minS = s
				}
				if res.scored == 0 || s > res.maxS {
					res.maxS = s
				}
				res.scoreSum += s
				res.scored++
			}
			if row.Unparsed {
				res.unparsed++
			}
		}
		if _, err := w.Write(buf); err != nil {
			return nil, err
		}
	}
	if err := w.Flush(); err != nil {
		return nil, err
	}
	if err := out.Sync(); err != nil {
		return nil, err
	}
	if err := out.Close(); err != nil {
		return nil, err
	}
	if err := os.Rename(tmp, output); err != nil {
		return nil, err
	}
	if d, err := os.Open(filepath.Dir(output)); err == nil {
		_ = d.Sync() // make the rename durable
		d.Close()
	}
	list := make([]string, 0, len(versions))
	for v := range versions {
		list = append(list, v)
	}
	sort.Strings(list)
	res.weightVersion = strings.Join(list, ",")
	return res, nil
}
