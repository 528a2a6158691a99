package safetensors

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
)

// WriteTensor is one tensor to write: Data holds its little-endian bytes and
// must be exactly prod(Shape) * DType.ItemSize() long.
type WriteTensor struct {
	Name  string
	DType DType
	Shape []int64
	Data  []byte
}

// Write writes a safetensors file at path atomically (temporary file in the
// same directory, fsync, rename, fsync of the directory). Tensors are laid
// out back to back in the given order; the header lists "__metadata__" first
// (omitted when metadata is empty, keys sorted) and is padded with spaces to
// a multiple of 8 bytes, like the reference implementation.
func Write(path string, tensors []WriteTensor, metadata map[string]string) error {
	hdr, err := encodeHeader(path, tensors, metadata)
	if err != nil {
		return err
	}
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	tmp, err := os.CreateTemp(dir, "."+base+".tmp*")
	if err != nil {
		return fmt.Errorf("safetensors: write %s: %w", path, err)
	}
	tmpName := tmp.Name()
	ok := false
	defer func() {
		if !ok {
			tmp.Close()
			os.Remove(tmpName)
		}
	}()
	w := bufio.NewWriterSize(tmp, 1<<20)
	var lenBuf [8]byte
	binary.LittleEndian.PutUint64(lenBuf[:], uint64(len(hdr)))
	w.Write(lenBuf[:])
	w.Write(hdr)
	for _, t := range tensors {
		w.Write(t.Data)
	}
	if err := w.Flush(); err != nil {
		return fmt.Errorf("safetensors: write %s: %w", path, err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		return fmt.Errorf("safetensors: write %s: %w", path, err)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("safetensors: write %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("safetensors: write %s: %w", path, err)
	}
	if err := os.Rename(tmpName, path); err != nil {
		return fmt.Errorf("safetensors: write %s: %w", path, err)
	}
	ok = true
	if d, err := os.Open(dir); err == nil {
		// Durability of the rename; failure here does not undo the write.
		d.Sync()
		d.Close()
	}
	return nil
}

func encodeHeader(path string, tensors []WriteTensor, metadata map[string]string) ([]byte, error) {
	bad := func(name, format string, args ...any) error {
		return &FormatError{File: path, Tensor: name, Msg: fmt.Sprintf(format, args...)}
	}
	var b bytes.Buffer
	b.WriteByte('{')
	first := true
	if len(metadata) > 0 {
		keys := make([]string, 0, len(metadata))
		for k := range metadata {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		b.WriteString(`"` + metadataKey + `":{`)
		for i, k := range keys {
			if i > 0 {
				b.WriteByte(',')
			}
			writeJSONString(&b, k)
			b.WriteByte(':')
			writeJSONString(&b, metadata[k])
		}
		b.WriteByte('}')
		first = false
	}
	seen := map[string]bool{}
	var off uint64
	for _, t := range tensors {
		switch {
		case t.Name == "":
			return nil, bad(t.Name, "empty tensor name")
		case t.Name == metadataKey:
			return nil, bad(t.Name, "tensor name is reserved")
		case seen[t.Name]:
			return nil, bad(t.Name, "duplicate tensor name")
		case !t.DType.Valid():
			return nil, bad(t.Name, "unknown dtype %q", t.DType)
		}
		seen[t.Name] = true
		for _, d := range t.Shape {
			if d < 0 {
				return nil, bad(t.Name, "negative dimension in shape %v", t.Shape)
			}
		}
		want, ok := byteSize(t.Shape, t.DType)
		if !ok {
			return nil, bad(t.Name, "shape %v of %s overflows the byte size", t.Shape, t.DType)
		}
		if uint64(len(t.Data)) != want {
			return nil, bad(t.Name, "shape %v of %s needs %d bytes, data has %d", t.Shape, t.DType, want, len(t.Data))
		}
		if !first {
			b.WriteByte(',')
		}
		first = false
		writeJSONString(&b, t.Name)
		b.WriteString(`:{"dtype":`)
		writeJSONString(&b, string(t.DType))
		b.WriteString(`,"shape":[`)
		for i, d := range t.Shape {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString(strconv.FormatInt(d, 10))
		}
		b.WriteString(`],"data_offsets":[`)
		b.WriteString(strconv.FormatUint(off, 10))
		b.WriteByte(',')
		off += want
		b.WriteString(strconv.FormatUint(off, 10))
		b.WriteString("]}")
	}
	b.WriteByte('}')
	for b.Len()%8 != 0 {
		b.WriteByte(' ')
	}
	if b.Len() > MaxHeaderSize {
		return nil, bad("", "header of %d bytes exceeds the %d byte limit", b.Len(), MaxHeaderSize)
	}
	return b.Bytes(), nil
}

// writeJSONString writes s as a JSON string without HTML escaping, matching
// serde_json's output for the same string.
func writeJSONString(b *bytes.Buffer, s string) {
	enc := json.NewEncoder(b)
	enc.SetEscapeHTML(false)
	enc.Encode(s)           // cannot fail for a string
	b.Truncate(b.Len() - 1) // Encode appends a newline
}
