package bigram

import (
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/rlflow/rlflow/safetensors"
)

// Load reads a bigram checkpoint: a .safetensors file or a directory of them
// (as vLLM's disk backend takes). It must hold exactly one tensor,
// "bigram.logits", F32 [128, 128], with finite values.
func Load(path string) (*Model, error) {
	ckpt, err := safetensors.OpenCheckpoint(path)
	if err != nil {
		return nil, fmt.Errorf("bigram: %w", err)
	}
	defer ckpt.Close()
	var names []string
	for _, t := range ckpt.Tensors() {
		if t.Name != TensorName {
			names = append(names, t.Name)
		}
	}
	if len(names) > 0 {
		return nil, fmt.Errorf("bigram: %s: unexpected tensor(s) %s: a bigram checkpoint holds only %s", path, strings.Join(names, ", "), TensorName)
	}
	t, ok := ckpt.Tensor(TensorName)
	if !ok {
		return nil, fmt.Errorf("bigram: %s: no tensor %s", path, TensorName)
	}
	data, err := ckpt.Bytes(t)
	if err != nil {
		return nil, fmt.Errorf("bigram: %w", err)
	}
	m, err := FromTensor(string(t.DType), t.Shape, data)
	if err != nil {
		return nil, fmt.Errorf("bigram: %s: %w", path, err)
	}
	return m, nil
}

// FromTensor builds a model from a tensor's raw little-endian bytes; dtype
// is "F32" (safetensors) or "float32" (torch), shape [128, 128].
func FromTensor(dtype string, shape []int64, data []byte) (*Model, error) {
	if dtype != string(safetensors.F32) && dtype != "float32" {
		return nil, fmt.Errorf("%s has dtype %s, want F32", TensorName, dtype)
	}
	if !slices.Equal(shape, []int64{Vocab, Vocab}) {
		return nil, fmt.Errorf("%s has shape %v, want [%d %d]", TensorName, shape, Vocab, Vocab)
	}
	if len(data) != 4*Vocab*Vocab {
		return nil, fmt.Errorf("%s has %d bytes, want %d", TensorName, len(data), 4*Vocab*Vocab)
	}
	l := make([]float32, Vocab*Vocab)
	for i := range l {
		l[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:]))
	}
	return FromLogits(l)
}

// Bytes returns the table as the little-endian F32 bytes of the tensor.
func (m *Model) Bytes() []byte {
	b := make([]byte, 4*len(m.logits))
	for i, v := range m.logits {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
	}
	return b
}

// Save writes the model as a one-tensor safetensors file at path
// (atomically: a reader never sees a partial file).
func (m *Model) Save(path string) error {
	err := safetensors.Write(path, []safetensors.WriteTensor{{
		Name: TensorName, DType: safetensors.F32, Shape: []int64{Vocab, Vocab}, Data: m.Bytes(),
	}}, map[string]string{"format": "pt", "model": "rlflow vLLM-double bigram"})
	if err != nil {
		return fmt.Errorf("bigram: save: %w", err)
	}
	return nil
}

// MaxCorpusBytes bounds what TrainFile reads.
const MaxCorpusBytes = 256 << 20

// ReadCorpus reads a corpus file of at most MaxCorpusBytes; errors name
// the file.
func ReadCorpus(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("corpus: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, MaxCorpusBytes+1))
	if err != nil {
		return "", fmt.Errorf("corpus %s: %w", path, err)
	}
	if len(b) > MaxCorpusBytes {
		return "", fmt.Errorf("corpus %s: larger than %d bytes", path, MaxCorpusBytes)
	}
	return string(b), nil
}

// TrainFile is the demo trainer's step: it fits a model to the text in
// corpusPath and saves it at out (a .safetensors file; a directory is
// created for it if needed, so out may be a checkpoint directory's file).
func TrainFile(corpusPath, out string, opts TrainOptions) (*Model, error) {
	text, err := ReadCorpus(corpusPath)
	if err != nil {
		return nil, fmt.Errorf("bigram: %w", err)
	}
	m, err := Train(text, opts)
	if err != nil {
		return nil, fmt.Errorf("bigram: corpus %s: %w", corpusPath, err)
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return nil, fmt.Errorf("bigram: save: %w", err)
	}
	return m, m.Save(out)
}
