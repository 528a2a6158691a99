package safetensors

import (
	"fmt"
	"maps"
	"os"
	"sync"
	"syscall"
)

// TensorInfo describes one tensor of a safetensors file.
type TensorInfo struct {
	Name  string
	DType DType
	Shape []int64
	// File is the path of the file holding the tensor, as given to Open.
	File string
	// Offset is the absolute byte offset of the tensor's data in File; Size
	// is its length in bytes (prod(Shape) * DType.ItemSize()).
	Offset, Size int64
}

// File is an open, validated safetensors file mapped read-only into memory.
// Its methods are safe for concurrent use.
type File struct {
	tensorIndex // data-offset order
	path        string
	mu          sync.RWMutex
	data        []byte // the whole mapping; nil once closed
	hdr         *header
	metadata    map[string]string
}

// Open maps path and validates its header. The mapping stays valid until Close.
func Open(path string) (*File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("safetensors: open: %w", err)
	}
	defer f.Close() // the mapping outlives the descriptor
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("safetensors: stat %s: %w", path, err)
	}
	if !st.Mode().IsRegular() {
		return nil, &FormatError{File: path, Msg: "not a regular file"}
	}
	size := st.Size()
	if size < 8 {
		return nil, &FormatError{File: path, Msg: fmt.Sprintf("file is %d bytes, shorter than the 8-byte header length", size)}
	}
	if int64(int(size)) != size {
		return nil, &FormatError{File: path, Msg: fmt.Sprintf("file of %d bytes cannot be mapped", size)}
	}
	data, err := syscall.Mmap(int(f.Fd()), 0, int(size), syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("safetensors: mmap %s: %w", path, err)
	}
	hdr, err := parseHeader(path, data)
	if err != nil {
		_ = syscall.Munmap(data)
		return nil, err
	}
	sf := &File{tensorIndex: newTensorIndex(len(hdr.tensors)), path: path, data: data, hdr: hdr, metadata: hdr.metadata}
	for _, t := range hdr.tensors {
		sf.add(t)
	}
	return sf, nil
}

// Path is the path the file was opened with.
func (f *File) Path() string { return f.path }

// HeaderSize is the length of the JSON header (the u64 at the start of the file).
func (f *File) HeaderSize() int64 { return f.hdr.size }

// Metadata returns a copy of the header's "__metadata__" map (empty if absent).
func (f *File) Metadata() map[string]string {
	return maps.Clone(f.metadata)
}

// Bytes returns the raw little-endian bytes of the named tensor: a read-only
// slice of the mapping, valid until Close. Writing to it faults.
func (f *File) Bytes(name string) ([]byte, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.data == nil {
		return nil, fmt.Errorf("safetensors: %s: file is closed", f.path)
	}
	i, ok := f.byName[name]
	if !ok {
		return nil, fmt.Errorf("safetensors: %s: no tensor %q", f.path, name)
	}
	t := f.tensors[i]
	end := t.Offset + t.Size
	return f.data[t.Offset:end:end], nil
}

// Close unmaps the file. Slices returned by Bytes must not be used afterwards.
// Closing twice is a no-op.
func (f *File) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.data == nil {
		return nil
	}
	err := syscall.Munmap(f.data)
	f.data = nil
	if err != nil {
		return fmt.Errorf("safetensors: munmap %s: %w", f.path, err)
	}
	return nil
}
