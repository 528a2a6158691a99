package safetensors

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// IndexFile is the name of the shard index of a sharded checkpoint.
const IndexFile = "model.safetensors.index.json"

// Checkpoint is a set of safetensors files forming one model: a single file,
// a sharded directory with an index, or a directory of *.safetensors files.
// Tensor names are unique across the whole checkpoint.
type Checkpoint struct {
	tensorIndex // checkpoint order: file by file, each in data-offset order
	files       []*File
	byPath      map[string]*File
	total       int64
}

// OpenCheckpoint opens path, which is one of:
//
//   - a .safetensors file;
//   - a directory holding model.safetensors.index.json: its weight_map
//     (tensor name -> shard file) must name existing shards, every listed
//     tensor must be in the shard it is mapped to, and every tensor of those
//     shards must be listed (files the index does not name are ignored);
//   - otherwise a directory: exactly its *.safetensors files, sorted by name.
//
// Tensors are ordered by shard (shards in order of first appearance in the
// index's weight_map, or by file name) and then by data offset.
func OpenCheckpoint(path string) (*Checkpoint, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("safetensors: open checkpoint: %w", err)
	}
	if !st.IsDir() {
		f, err := Open(path)
		if err != nil {
			return nil, err
		}
		return newCheckpoint([]*File{f})
	}
	idx := filepath.Join(path, IndexFile)
	raw, err := os.ReadFile(idx)
	switch {
	case err == nil:
		shards, weightMap, err := parseIndex(idx, raw)
		if err != nil {
			return nil, err
		}
		var files []*File
		for _, s := range shards {
			f, err := Open(filepath.Join(path, s))
			if err != nil {
				closeAll(files)
				return nil, fmt.Errorf("safetensors: checkpoint %s: shard named by the index: %w", path, err)
			}
			files = append(files, f)
		}
		c, err := newCheckpoint(files)
		if err != nil {
			return nil, err
		}
		if err := c.checkIndex(idx, path, weightMap); err != nil {
			c.Close()
			return nil, err
		}
		return c, nil
	case errors.Is(err, os.ErrNotExist):
	default:
		return nil, fmt.Errorf("safetensors: read index: %w", err)
	}
	ents, err := os.ReadDir(path)
	if err != nil {
		return nil, fmt.Errorf("safetensors: open checkpoint: %w", err)
	}
	var names []string
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".safetensors") && e.Type().IsRegular() {
			names = append(names, e.Name())
		}
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("safetensors: checkpoint %s: no *.safetensors files and no %s", path, IndexFile)
	}
	sort.Strings(names)
	var files []*File
	for _, n := range names {
		f, err := Open(filepath.Join(path, n))
		if err != nil {
			closeAll(files)
			return nil, err
		}
		files = append(files, f)
	}
	return newCheckpoint(files)
}

func closeAll(files []*File) {
	for _, f := range files {
		f.Close()
	}
}

// newCheckpoint takes ownership of files (closing them on error).
func newCheckpoint(files []*File) (*Checkpoint, error) {
	c := &Checkpoint{files: files, byPath: map[string]*File{}, tensorIndex: newTensorIndex(0)}
	for _, f := range files {
		c.byPath[f.path] = f
		for _, t := range f.tensors {
			if j, dup := c.byName[t.Name]; dup {
				closeAll(files)
				return nil, fmt.Errorf("safetensors: tensor %q is in both %s and %s", t.Name, c.tensors[j].File, t.File)
			}
			c.add(t)
			c.total += t.Size
		}
	}
	return c, nil
}

// parseIndex returns the distinct shard names in order of first appearance
// and the weight map. Duplicate tensor names in the weight map are errors.
func parseIndex(idx string, raw []byte) ([]string, map[string]string, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("safetensors: index %s: %s", idx, fmt.Sprintf(format, args...))
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, nil, bad("not a JSON object")
	}
	var shards []string
	weightMap := map[string]string{}
	found := false
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, nil, bad("invalid JSON: %v", err)
		}
		if tok.(string) != "weight_map" {
			var skip json.RawMessage
			if err := dec.Decode(&skip); err != nil {
				return nil, nil, bad("invalid JSON: %v", err)
			}
			continue
		}
		if found {
			return nil, nil, bad("duplicate weight_map")
		}
		found = true
		if tok, err := dec.Token(); err != nil {
			return nil, nil, bad("invalid JSON: %v", err)
		} else if tok != json.Delim('{') {
			return nil, nil, bad("weight_map is not an object")
		}
		seenShard := map[string]bool{}
		for dec.More() {
			tok, err := dec.Token()
			if err != nil {
				return nil, nil, bad("invalid JSON: %v", err)
			}
			name := tok.(string)
			tok, err = dec.Token()
			if err != nil {
				return nil, nil, bad("invalid JSON: %v", err)
			}
			shard, ok := tok.(string)
			if !ok {
				return nil, nil, bad("weight_map entry for tensor %q is not a string", name)
			}
			if _, dup := weightMap[name]; dup {
				return nil, nil, bad("tensor %q appears twice in weight_map", name)
			}
			if !filepath.IsLocal(shard) || !strings.HasSuffix(shard, ".safetensors") {
				return nil, nil, bad("tensor %q maps to %q, not a .safetensors file inside the checkpoint directory", name, shard)
			}
			shard = filepath.Clean(shard)
			weightMap[name] = shard
			if !seenShard[shard] {
				seenShard[shard] = true
				shards = append(shards, shard)
			}
		}
		if _, err := dec.Token(); err != nil {
			return nil, nil, bad("invalid JSON: %v", err)
		}
	}
	if _, err := dec.Token(); err != nil {
		return nil, nil, bad("invalid JSON: %v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, nil, bad("unexpected data after the JSON object")
	}
	if !found {
		return nil, nil, bad("no weight_map")
	}
	if len(weightMap) == 0 {
		return nil, nil, bad("weight_map lists no tensors")
	}
	return shards, weightMap, nil
}

func (c *Checkpoint) checkIndex(idx, dir string, weightMap map[string]string) error {
	for name, shard := range weightMap {
		i, ok := c.byName[name]
		want := filepath.Join(dir, shard)
		if !ok {
			return fmt.Errorf("safetensors: index %s: tensor %q is not in shard %s", idx, name, want)
		}
		if got := c.tensors[i].File; got != want {
			return fmt.Errorf("safetensors: index %s: tensor %q is mapped to %s but found in %s", idx, name, want, got)
		}
	}
	for _, t := range c.tensors {
		if _, ok := weightMap[t.Name]; !ok {
			return fmt.Errorf("safetensors: index %s: shard %s holds tensor %q, which the weight_map does not list", idx, t.File, t.Name)
		}
	}
	return nil
}

// Files lists the paths of the files in checkpoint order.
func (c *Checkpoint) Files() []string {
	out := make([]string, len(c.files))
	for i, f := range c.files {
		out[i] = f.path
	}
	return out
}

// Bytes returns the tensor's bytes (zero-copy, valid until Close). t must be
// one of the TensorInfos of this checkpoint.
func (c *Checkpoint) Bytes(t TensorInfo) ([]byte, error) {
	f, ok := c.byPath[t.File]
	if !ok {
		return nil, fmt.Errorf("safetensors: tensor %q: file %s is not part of this checkpoint", t.Name, t.File)
	}
	i, ok := f.byName[t.Name]
	if !ok || f.tensors[i].Offset != t.Offset || f.tensors[i].Size != t.Size {
		return nil, fmt.Errorf("safetensors: %s: tensor %q at offset %d (%d bytes) is not in this checkpoint", t.File, t.Name, t.Offset, t.Size)
	}
	return f.Bytes(t.Name)
}

// Mapping returns the whole read-only mapping of the file holding t (its
// start is page aligned: it comes from mmap) and the offset of t's first
// byte in it, so that a caller can page-lock the file in place
// (cudaHostRegister) instead of copying it. Valid until Close, like Bytes.
func (c *Checkpoint) Mapping(t TensorInfo) ([]byte, int64, error) {
	if _, err := c.Bytes(t); err != nil { // validates t against this checkpoint
		return nil, 0, err
	}
	f := c.byPath[t.File]
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.data == nil {
		return nil, 0, fmt.Errorf("safetensors: %s: file is closed", f.path)
	}
	return f.data, t.Offset, nil
}

// TotalBytes is the sum of all tensor sizes.
func (c *Checkpoint) TotalBytes() int64 { return c.total }

// Close unmaps every file, returning the first error.
func (c *Checkpoint) Close() error {
	var first error
	for _, f := range c.files {
		if err := f.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}
