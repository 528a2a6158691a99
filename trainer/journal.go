package trainer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// The files of a run's checkpoint directory (PROTOCOL.md "What the GPU
// worker keeps").
const (
	JournalFile = "journal.jsonl"
	LatestFile  = "LATEST"
	// CheckpointPrefix + the iteration names a checkpoint directory.
	CheckpointPrefix = "ckpt-"
)

// CheckpointName is the directory name of iteration's checkpoint.
func CheckpointName(iteration int) string { return CheckpointPrefix + strconv.Itoa(iteration) }

// journalLine is one train that replied ok. Args is kept as the exact
// bytes sent, so a replay sends the same. StepDoneUnix is beyond
// PROTOCOL.md's list: a retry answered from the journal reports it too.
type journalLine struct {
	Iteration    int                `json:"iteration"`
	Rollouts     string             `json:"rollouts"`
	Args         json.RawMessage    `json:"args"`
	Metrics      map[string]float64 `json:"metrics"`
	Seconds      float64            `json:"seconds"`
	StepDoneUnix float64            `json:"step_done_unix"`
}

// readJournal reads dir's journal (none: no lines). A last line without
// its newline is a write that never completed (it was never fsynced, so
// never reported) and is ignored; any other unreadable line is Lost.
func readJournal(dir string) ([]journalLine, error) {
	b, err := os.ReadFile(filepath.Join(dir, JournalFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, errorf(IO, err, "reading the journal")
	}
	b = b[:bytes.LastIndexByte(b, '\n')+1]
	var lines []journalLine
	for n, text := range bytes.Split(bytes.TrimSuffix(b, []byte{'\n'}), []byte{'\n'}) {
		if len(text) == 0 {
			continue
		}
		var l journalLine
		if err := json.Unmarshal(text, &l); err != nil || l.Iteration < 1 || l.Rollouts == "" {
			return nil, errorf(Lost, nil, "%s line %d: not a journal line", filepath.Join(dir, JournalFile), n+1)
		}
		lines = append(lines, l)
	}
	return lines, nil
}

// appendJournal appends l durably: a torn last line is cut off first, the
// file is fsynced, and the directory too when the file is new.
func appendJournal(dir string, l journalLine) error {
	text, err := json.Marshal(l)
	if err != nil {
		return errorf(IO, err, "encoding the journal line of iteration %d", l.Iteration)
	}
	path := filepath.Join(dir, JournalFile)
	_, statErr := os.Stat(path)
	created := errors.Is(statErr, fs.ErrNotExist)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return errorf(IO, err, "opening the journal")
	}
	defer f.Close()
	old, err := os.ReadFile(path)
	if err != nil {
		return errorf(IO, err, "reading the journal")
	}
	end := int64(bytes.LastIndexByte(old, '\n') + 1)
	if err := f.Truncate(end); err != nil {
		return errorf(IO, err, "cutting a torn line off the journal")
	}
	if _, err := f.WriteAt(append(text, '\n'), end); err != nil {
		return errorf(IO, err, "appending to the journal")
	}
	if err := f.Sync(); err != nil {
		return errorf(IO, err, "syncing the journal")
	}
	if created {
		if err := syncDir(dir); err != nil {
			return errorf(IO, err, "syncing the checkpoint directory")
		}
	}
	return nil
}

// pruneCheckpoints deletes the ckpt-<n> directories of dir beyond the
// newest keep of those at or below latest (LATEST's): never LATEST's,
// never a newer one (an attempt's, still being written), nothing when keep
// is 0.
func pruneCheckpoints(dir string, latest, keep int) error {
	if keep <= 0 {
		return nil
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	var iters []int
	for _, e := range ents {
		n, err := strconv.Atoi(strings.TrimPrefix(e.Name(), CheckpointPrefix))
		if e.IsDir() && strings.HasPrefix(e.Name(), CheckpointPrefix) && err == nil && n <= latest && CheckpointName(n) == e.Name() {
			iters = append(iters, n)
		}
	}
	slices.Sort(iters)
	var errs []error
	for _, n := range iters[:max(0, len(iters)-keep)] {
		if n == latest {
			continue
		}
		if err := os.RemoveAll(filepath.Join(dir, CheckpointName(n))); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// pruneJournal drops the lines at or below iteration (a checkpoint holds
// them now), replacing the file atomically.
func pruneJournal(dir string, iteration int) error {
	lines, err := readJournal(dir)
	if err != nil {
		return err
	}
	var b bytes.Buffer
	for _, l := range lines {
		// LATEST's own line stays: a retried train of the iteration just
		// checkpointed is answered from it, not refused as a gap.
		if l.Iteration < iteration {
			continue
		}
		text, err := json.Marshal(l)
		if err != nil {
			return errorf(IO, err, "encoding the journal line of iteration %d", l.Iteration)
		}
		b.Write(append(text, '\n'))
	}
	return writeFileAtomic(dir, JournalFile, b.Bytes())
}

// readLatest returns the iteration and path of the checkpoint LATEST names
// (0 and "": none).
func readLatest(dir string) (iteration int, path string, err error) {
	b, err := os.ReadFile(filepath.Join(dir, LatestFile))
	if errors.Is(err, fs.ErrNotExist) {
		return 0, "", nil
	}
	if err != nil {
		return 0, "", errorf(IO, err, "reading LATEST")
	}
	name := strings.TrimSpace(string(b))
	n, err := strconv.Atoi(strings.TrimPrefix(name, CheckpointPrefix))
	if !strings.HasPrefix(name, CheckpointPrefix) || err != nil || n < 1 || CheckpointName(n) != name {
		return 0, "", errorf(Lost, nil, "%s: not a checkpoint name", filepath.Join(dir, LatestFile))
	}
	return n, filepath.Join(dir, name), nil
}

// writeLatest names iteration's checkpoint in LATEST, atomically.
func writeLatest(dir string, iteration int) error {
	return writeFileAtomic(dir, LatestFile, []byte(CheckpointName(iteration)+"\n"))
}

// writeFileAtomic replaces dir/name by data: a temporary file, fsynced,
// renamed over it, the directory fsynced.
func writeFileAtomic(dir, name string, data []byte) error {
	tmp := filepath.Join(dir, "."+name+".tmp")
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return errorf(IO, err, "writing %s", name)
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, filepath.Join(dir, name))
	}
	if err == nil {
		err = syncDir(dir)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return errorf(IO, err, "writing %s", name)
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// dirBytes is the size of the files under dir.
func dirBytes(dir string) (int64, error) {
	var n int64
	err := filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		info, err := d.Info()
		if err == nil {
			n += info.Size()
		}
		return err
	})
	return n, err
}

// checkReplayable checks, before anything is started, that the journal
// lines after the checkpoint can be replayed: consecutive from the
// checkpoint's iteration on, every rollouts file still there. Its Lost
// error names every missing iteration and path.
func checkReplayable(dir string, from int, lines []journalLine) ([]journalLine, error) {
	var replay []journalLine
	for _, l := range lines {
		if l.Iteration > from {
			replay = append(replay, l)
		}
	}
	var missing []string
	for i, l := range replay {
		if l.Iteration != from+1+i {
			return nil, errorf(Lost, nil, "%s: iteration %d follows iteration %d (checkpoint at %d)",
				filepath.Join(dir, JournalFile), l.Iteration, from+i, from)
		}
		if _, err := os.Stat(l.Rollouts); err != nil {
			var pe *fs.PathError
			if errors.As(err, &pe) {
				err = pe.Err
			}
			missing = append(missing, fmt.Sprintf("iteration %d (%s: %v)", l.Iteration, l.Rollouts, err))
		}
	}
	if len(missing) > 0 {
		return nil, errorf(Lost, nil, "cannot replay the journal after checkpoint iteration %d: the rollouts of %s are gone",
			from, strings.Join(missing, ", "))
	}
	return replay, nil
}
