package activities

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"

	"github.com/rlflow/rlflow/pipelines"
	"go.temporal.io/sdk/activity"
)

// partialFormat is the version of the partial file's format; a file of
// another version is not resumed.
const partialFormat = 2

// The partial file holds every sample this step's attempts were answered,
// one line each, appended as it is answered and fsynced in groups, so that
// a retried attempt requests only the samples missing from it. The file
// name is the same for every attempt. After the header its lines are
// records (partialRecord), exactly one kind each:
//
//	{"check": {"epoch": 3, "server": 1, "url": ..., "version": "v7", ...}}
//	{"epoch": 3, "seq": 41, "row": {...the output row...}}
//	{"confirm": {"epoch": 3, "upto": 57}}
//	{"void": {"epoch": 3, "from": 57, "reason": ...}}
//
// A check opens an epoch: what one attempt saw of one server at its start
// (its weight version and process start time). A row carries the epoch of
// the server that answered it and its answer's sequence number in that
// epoch. A row counts only once a later check of its server confirmed the
// server still served the epoch's weights: confirm covers the rows with
// seq < upto. A check that finds the server on other weights voids its
// rows from the last confirmed one on: a retry regenerates exactly those.
type partialRecord struct {
	Check   *checkRecord    `json:"check,omitempty"`
	Confirm *confirmRecord  `json:"confirm,omitempty"`
	Void    *voidRecord     `json:"void,omitempty"`
	Epoch   int             `json:"epoch,omitempty"`
	Seq     *int64          `json:"seq,omitempty"`
	Row     json.RawMessage `json:"row,omitempty"`
}

type checkRecord struct {
	Epoch  int    `json:"epoch"`
	Server int    `json:"server"`
	URL    string `json:"url"`
	serverState
}

type confirmRecord struct {
	Epoch int   `json:"epoch"`
	Upto  int64 `json:"upto"`
}

type voidRecord struct {
	Epoch  int    `json:"epoch"`
	From   int64  `json:"from"`
	Reason string `json:"reason"`
}

// partialHeader is the first line of a partial file.
type partialHeader struct {
	Partial     int    `json:"rlflow_partial"`
	Fingerprint string `json:"fingerprint"`
}

// rowLoc is where a sample's row lies in the partial file; size 0: none.
type rowLoc struct {
	off   int64
	size  int32
	epoch int32
	seq   int64
}

// epochInfo is one epoch of the partial file.
type epochInfo struct {
	url       string
	state     serverState
	confirmed int64 // rows with seq < confirmed are confirmed
	voidFrom  int64 // rows with seq >= voidFrom are void
	pending   []int // rows written, not yet confirmed
}

func (e *epochInfo) open() bool { return e.voidFrom == math.MaxInt64 }

// partialFile is the open partial file and its index: for every sample
// (prompt idx*n + sample k) its confirmed or pending row. One goroutine at
// a time writes it: the attempt before and after generating, the writer
// while generating.
type partialFile struct {
	path      string
	f         *os.File
	off       int64 // end of the file as written
	n         int
	rows      []rowLoc
	epochs    map[int]*epochInfo
	nextEpoch int
	valid     int // samples with a confirmed row
	unsynced  int
}

// isValid reports whether sample key has a confirmed row.
func (pw *partialFile) isValid(key int) bool {
	r := pw.rows[key]
	return r.size > 0 && r.seq < pw.epochs[int(r.epoch)].confirmed
}

// openPartial opens this step's partial file and resumes it when this is a
// retry (heartbeat details, attempt > 1, or the interpreter's run of the
// step after a re-sync) and it was made from the same inputs; otherwise it
// starts a new one, so a stale file from another run is never reused.
func (g *genRun) openPartial(ctx context.Context) (*partialFile, error) {
	path := g.output + ".partial"
	retry := g.in.Context.Rerun > 0
	if activity.IsActivity(ctx) {
		retry = retry || activity.GetInfo(ctx).Attempt > 1 || activity.HasHeartbeatDetails(ctx)
		var hb GenerateProgress
		if activity.HasHeartbeatDetails(ctx) && activity.GetHeartbeatDetails(ctx, &hb) == nil && hb.Partial != "" && hb.Partial != path {
			activity.GetLogger(ctx).Warn("the earlier attempt's partial file is elsewhere; resuming from this one", "earlier", hb.Partial, "partial", path)
		}
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, stepError(ctx, pipelines.ErrTypeIO, err, "%s: opening %s", g.step, path)
	}
	// One attempt at a time: a retry that starts while an earlier attempt
	// still runs (its worker cut off past the heartbeat timeout) must not
	// interleave its writes with it. The lock goes with the file's close.
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, stepError(ctx, pipelines.ErrTypeIO, err, "%s: %s is locked by another attempt of this step that still runs (it stops at its next heartbeat)", g.step, path)
	}
	pw, err := resumePartial(f, path, g.fingerprint, g.set, g.in.N)
	switch {
	case err == nil && retry:
		return pw, nil
	case err != nil && retry && activity.IsActivity(ctx):
		activity.GetLogger(ctx).Warn("not resuming: starting the step's samples again", "partial", path, "reason", err.Error())
	}
	hdr, _ := json.Marshal(partialHeader{Partial: partialFormat, Fingerprint: g.fingerprint})
	hdr = append(hdr, '\n')
	if err := writeHeader(f, hdr); err != nil {
		f.Close()
		return nil, stepError(ctx, pipelines.ErrTypeIO, err, "%s: writing the header of %s", g.step, path)
	}
	return newPartialFile(f, path, int64(len(hdr)), len(g.set.prompts), g.in.N), nil
}

func newPartialFile(f *os.File, path string, off int64, prompts, n int) *partialFile {
	return &partialFile{path: path, f: f, off: off, n: n,
		rows: make([]rowLoc, prompts*n), epochs: map[int]*epochInfo{}, nextEpoch: 1}
}

// writeHeader empties f and writes hdr at its start, leaving f's offset
// just after it: every failure is returned, since a partial file without
// its header could never be resumed and would silently lose its samples.
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

// resumePartial reads the open partial file f and indexes its rows; a torn
// or foreign tail (a crash mid-write, a line that fits no record) is cut
// off. Rows neither confirmed nor void stay pending: the attempt decides
// them once it has seen the servers (resolve). On error the caller still
// owns f.
func resumePartial(f *os.File, path, fingerprint string, set *promptSet, n int) (*partialFile, error) {
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, err
	}
	br := bufio.NewReaderSize(f, 1<<20)
	first, err := br.ReadBytes('\n')
	var hdr partialHeader
	if err != nil || json.Unmarshal(first, &hdr) != nil || hdr.Partial == 0 {
		return nil, fmt.Errorf("%s has no partial-file header", path)
	}
	if hdr.Partial != partialFormat {
		return nil, fmt.Errorf("%s is in partial-file format %d, this worker writes %d", path, hdr.Partial, partialFormat)
	}
	if hdr.Fingerprint != fingerprint {
		return nil, fmt.Errorf("%s was made from other inputs (prompts or sampling parameters changed)", path)
	}
	index := make(map[string]int, len(set.prompts))
	for i := range set.prompts {
		index[set.prompts[i].id] = i
	}
	pw := newPartialFile(f, path, 0, len(set.prompts), n)
	var rows []struct {
		key int
		loc rowLoc
	}
	off := int64(len(first))
	for {
		line, err := br.ReadBytes('\n')
		if err != nil {
			break // EOF, or a torn last line without its newline
		}
		var rec partialRecord
		if json.Unmarshal(line, &rec) != nil {
			break
		}
		kinds := 0
		for _, has := range []bool{rec.Check != nil, rec.Confirm != nil, rec.Void != nil, rec.Row != nil} {
			if has {
				kinds++
			}
		}
		if kinds != 1 {
			break
		}
		if rec.Row != nil {
			e := pw.epochs[rec.Epoch]
			var row struct {
				PromptID string `json:"prompt_id"`
				Sample   int    `json:"sample"`
			}
			if e == nil || rec.Seq == nil || *rec.Seq < 0 || json.Unmarshal(rec.Row, &row) != nil {
				break
			}
			idx, ok := index[row.PromptID]
			if !ok || row.Sample < 0 || row.Sample >= n {
				break
			}
			rows = append(rows, struct {
				key int
				loc rowLoc
			}{idx*n + row.Sample, rowLoc{off: off, size: int32(len(line)), epoch: int32(rec.Epoch), seq: *rec.Seq}})
		} else if !pw.applyMeta(&rec) {
			break
		}
		off += int64(len(line))
	}
	if err := f.Truncate(off); err != nil {
		return nil, err
	}
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		return nil, err
	}
	pw.off = off
	// The index once every record is read: a confirm or void may follow
	// the rows it covers. Of two rows of one sample (none is written while
	// another counts) the first that is not void is kept.
	for _, r := range rows {
		e := pw.epochs[int(r.loc.epoch)]
		if r.loc.seq >= e.voidFrom || pw.rows[r.key].size > 0 {
			continue
		}
		pw.rows[r.key] = r.loc
		if r.loc.seq < e.confirmed {
			pw.valid++
		} else {
			e.pending = append(e.pending, r.key)
		}
	}
	return pw, nil
}

// applyMeta applies a record other than a row; false: it does not fit
// the file (an unknown epoch, a second check of one epoch).
func (pw *partialFile) applyMeta(rec *partialRecord) bool {
	switch {
	case rec.Check != nil:
		c := rec.Check
		if c.Epoch <= 0 || pw.epochs[c.Epoch] != nil {
			return false
		}
		pw.epochs[c.Epoch] = &epochInfo{url: c.URL, state: c.serverState, voidFrom: math.MaxInt64}
		pw.nextEpoch = max(pw.nextEpoch, c.Epoch+1)
	case rec.Confirm != nil:
		e := pw.epochs[rec.Confirm.Epoch]
		if e == nil {
			return false
		}
		e.confirmed = max(e.confirmed, min(rec.Confirm.Upto, e.voidFrom))
	case rec.Void != nil:
		e := pw.epochs[rec.Void.Epoch]
		if e == nil {
			return false
		}
		e.voidFrom = min(e.voidFrom, rec.Void.From)
		e.confirmed = min(e.confirmed, e.voidFrom)
	}
	return true
}

// Record kinds the writer applies to the index as it writes them.
const (
	recMeta = iota // check: opens an epoch
	recRow
	recConfirm
	recVoid
)

// record is one line for the partial file.
type record struct {
	kind  int
	data  []byte // the line, newline included
	meta  *partialRecord
	key   int // recRow: the sample
	epoch int
	seq   int64 // recRow: its seq; recConfirm: upto; recVoid: from
}

func metaRecord(rec partialRecord) record {
	b, _ := json.Marshal(rec) // plain structs of strings and numbers
	return record{kind: recMeta, data: append(b, '\n'), meta: &rec}
}

func confirmRec(epoch int, upto int64) record {
	r := metaRecord(partialRecord{Confirm: &confirmRecord{Epoch: epoch, Upto: upto}})
	r.kind, r.epoch, r.seq = recConfirm, epoch, upto
	return r
}

func voidRec(epoch int, from int64, reason string) record {
	r := metaRecord(partialRecord{Void: &voidRecord{Epoch: epoch, From: from, Reason: reason}})
	r.kind, r.epoch, r.seq = recVoid, epoch, from
	return r
}

// rowRec wraps an encoded output row (without its newline).
func rowRec(key, epoch int, seq int64, row []byte) record {
	b := make([]byte, 0, len(row)+48)
	b = append(b, `{"epoch":`...)
	b = strconv.AppendInt(b, int64(epoch), 10)
	b = append(b, `,"seq":`...)
	b = strconv.AppendInt(b, seq, 10)
	b = append(b, `,"row":`...)
	b = append(b, row...)
	b = append(b, "}\n"...)
	return record{kind: recRow, data: b, key: key, epoch: epoch, seq: seq}
}

// openEpoch records a check that opens a new epoch and returns its id.
func (pw *partialFile) openEpoch(server int, url string, st serverState) (int, error) {
	id := pw.nextEpoch
	pw.nextEpoch++
	return id, pw.write(metaRecord(partialRecord{Check: &checkRecord{Epoch: id, Server: server, URL: url, serverState: st}}))
}

// write appends r and applies it to the index. Each record is its own
// write(2), so a killed worker process loses none it wrote (fsyncs only
// matter to a machine that goes down). A row of a void epoch is not
// written: its server was found on other weights.
func (pw *partialFile) write(r record) error {
	var e *epochInfo
	if r.kind != recMeta {
		if e = pw.epochs[r.epoch]; e == nil {
			return fmt.Errorf("record of unknown epoch %d", r.epoch)
		}
		if r.kind == recRow && r.seq >= e.voidFrom {
			return nil
		}
	}
	if _, err := pw.f.Write(r.data); err != nil {
		return err
	}
	off := pw.off
	pw.off += int64(len(r.data))
	pw.unsynced++
	switch r.kind {
	case recMeta:
		pw.applyMeta(r.meta)
	case recRow:
		if pw.rows[r.key].size > 0 {
			return nil // a second answer to one sample: the first one stays
		}
		pw.rows[r.key] = rowLoc{off: off, size: int32(len(r.data)), epoch: int32(r.epoch), seq: r.seq}
		if r.seq < e.confirmed {
			pw.valid++
		} else {
			e.pending = append(e.pending, r.key)
		}
	case recConfirm:
		e.confirmed = max(e.confirmed, min(r.seq, e.voidFrom))
		pw.settle(e)
	case recVoid:
		// Written from the epoch's confirmed mark: no confirmed row turns void.
		e.voidFrom = min(e.voidFrom, r.seq)
		e.confirmed = min(e.confirmed, e.voidFrom)
		pw.settle(e)
	}
	return nil
}

// settle moves e's pending rows that a confirm covers to the valid ones
// and drops those a void covers.
func (pw *partialFile) settle(e *epochInfo) {
	keep := e.pending[:0]
	for _, key := range e.pending {
		switch seq := pw.rows[key].seq; {
		case seq >= e.voidFrom:
			pw.rows[key] = rowLoc{}
		case seq < e.confirmed:
			pw.valid++
		default:
			keep = append(keep, key)
		}
	}
	e.pending = keep
}

// sync makes everything written durable.
func (pw *partialFile) sync() error {
	if pw.unsynced == 0 {
		return nil
	}
	if err := pw.f.Sync(); err != nil {
		return err
	}
	pw.unsynced = 0
	return nil
}

// maxUnsynced bounds the records the writer holds before an fsync.
const maxUnsynced = 256

// writeAll writes records until recs closes, each as it comes, and fsyncs
// whenever no further record is waiting (or after maxUnsynced). The bound
// on what is lost: a killed worker process loses only the answers it had
// read but not yet written, at most one per request slot (concurrency)
// plus the records queued here (concurrency); a machine that goes down
// also loses what was written since the last fsync, at most maxUnsynced
// records. After each fsync durable holds the samples with a confirmed
// row. The first error goes to failed at once; then it only drains, so
// that no sender blocks.
func (pw *partialFile) writeAll(recs <-chan record, durable *atomic.Int64, failed func(error)) error {
	var werr error
	for r := range recs {
		if werr != nil {
			continue
		}
		werr = pw.write(r)
		if werr == nil && (len(recs) == 0 || pw.unsynced >= maxUnsynced) {
			if werr = pw.sync(); werr == nil {
				durable.Store(int64(pw.valid))
			}
		}
		if werr != nil {
			failed(werr)
		}
	}
	if werr == nil {
		if werr = pw.sync(); werr == nil {
			durable.Store(int64(pw.valid))
		} else {
			failed(werr)
		}
	}
	return werr
}

// assemble writes the output in prompt order, samples in order, from the
// partial file's confirmed rows: to a temporary file, fsynced, then
// renamed over the output.
func (pw *partialFile) assemble(output string, set *promptSet) (*genResult, error) {
	tmp := output + ".tmp"
	out, err := os.Create(tmp)
	if err != nil {
		return nil, err
	}
	defer os.Remove(tmp) // after a successful rename there is nothing to remove
	defer out.Close()
	w := bufio.NewWriterSize(out, 1<<20)
	res := &genResult{path: output, prompts: len(set.prompts), samples: len(pw.rows)}
	versions := map[string]bool{}
	var buf []byte
	for key, loc := range pw.rows {
		if !pw.isValid(key) {
			return nil, fmt.Errorf("prompt %s sample %d has no confirmed row in %s", set.where(&set.prompts[key/pw.n]), key%pw.n, pw.path)
		}
		if cap(buf) < int(loc.size) {
			buf = make([]byte, loc.size)
		}
		buf = buf[:loc.size]
		if _, err := pw.f.ReadAt(buf, loc.off); err != nil {
			return nil, fmt.Errorf("reading %s: %w", pw.path, err)
		}
		var rec struct {
			Row json.RawMessage `json:"row"`
		}
		var row struct {
			CompletionTokens int64    `json:"completion_tokens"`
			WeightVersion    string   `json:"weight_version"`
			Score            *float64 `json:"score"`
			Unparsed         bool     `json:"unparsed"`
		}
		if err := json.Unmarshal(buf, &rec); err != nil {
			return nil, fmt.Errorf("%s: corrupt record at byte %d: %w", pw.path, loc.off, err)
		}
		if err := json.Unmarshal(rec.Row, &row); err != nil {
			return nil, fmt.Errorf("%s: corrupt row at byte %d: %w", pw.path, loc.off, err)
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
		w.Write(rec.Row)
		if err := w.WriteByte('\n'); err != nil {
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
