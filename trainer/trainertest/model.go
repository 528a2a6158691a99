package trainertest

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// tensorSpec is one parameter of the fake model.
type tensorSpec struct {
	Name  string  `json:"name"`
	Shape []int64 `json:"shape"`
}

func (t tensorSpec) elems() int64 {
	n := int64(1)
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// DefaultShapes is the fake model when RLFLOW_FAKE_TRAINER_SHAPES is unset:
// 64 KiB of float32 parameters plus a small vector.
const DefaultShapes = "model.embed.weight=64x128,model.layers.0.w=64x64,model.layers.1.w=64x64,model.norm.weight=64"

// maxElems bounds the fake model (256 MiB of float32).
const maxElems = 64 << 20

// parseShapes reads RLFLOW_FAKE_TRAINER_SHAPES: comma-separated tensors,
// each "name=AxBxC" or a bare shape "AxB" (named model.embed.weight for the
// first, model.layers.<i>.w after it).
func parseShapes(s string) ([]tensorSpec, error) {
	var specs []tensorSpec
	seen := map[string]bool{}
	var total int64
	for i, item := range strings.Split(s, ",") {
		name, shape, named := strings.Cut(strings.TrimSpace(item), "=")
		if !named {
			shape = name
			name = "model.embed.weight"
			if i > 0 {
				name = fmt.Sprintf("model.layers.%d.w", i-1)
			}
		}
		if name == "" || seen[name] {
			return nil, fmt.Errorf("tensor %d: empty or repeated name", i+1)
		}
		seen[name] = true
		t := tensorSpec{Name: name}
		for _, d := range strings.Split(shape, "x") {
			n, err := strconv.ParseInt(d, 10, 64)
			if err != nil || n < 1 || n > maxElems {
				return nil, fmt.Errorf("tensor %s: shape %q: want dimensions like 64x128, each 1..%d", name, shape, maxElems)
			}
			t.Shape = append(t.Shape, n)
		}
		total += t.elems()
		if t.elems() > maxElems || total > maxElems {
			return nil, fmt.Errorf("more than %d elements in all", maxElems)
		}
		specs = append(specs, t)
	}
	return specs, nil
}

// model is the fake trainer's state: float32 parameters, a momentum
// tensor per parameter, the training random generator and the iteration.
// Everything in it is saved and loaded, so a load continues bit for bit.
type model struct {
	specs     []tensorSpec
	params    [][]float32
	momentum  [][]float32
	rng       *rand.PCG
	iteration int
}

const (
	learningRate = 0.01
	beta         = 0.9
	weightDecay  = 1e-3
)

// newModel is the seeded fresh initialisation.
func newModel(specs []tensorSpec, seed uint64) *model {
	m := &model{specs: specs, rng: rand.NewPCG(seed, seed^0x5851f42d4c957f2d)}
	init := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	for _, t := range specs {
		p := make([]float32, t.elems())
		for i := range p {
			p[i] = float32(init.Float64() - 0.5)
		}
		m.params = append(m.params, p)
		m.momentum = append(m.momentum, make([]float32, t.elems()))
	}
	return m
}

// train runs one iteration on the rollouts file: every non-empty line's
// bytes (with the iteration and a draw of the training generator) seed a
// pseudo-gradient for every parameter; momentum SGD with weight decay
// applies their mean. die, when set, is called half-way through the update
// (a fault injection point).
func (m *model) train(iteration int, rollouts string, die func()) (loss float64, samples int, err error) {
	f, err := os.Open(rollouts)
	if err != nil {
		return 0, 0, fmt.Errorf("reading the rollouts: %w", err)
	}
	defer f.Close()
	grads := make([][]float32, len(m.params))
	for i, p := range m.params {
		grads[i] = make([]float32, len(p))
	}
	noise := m.rng.Uint64()
	br := bufio.NewReader(f)
	for {
		line, rerr := br.ReadBytes('\n')
		line = bytes.TrimRight(line, "\r\n")
		if len(line) > 0 {
			samples++
			h := sha256.New()
			var head [16]byte
			binary.LittleEndian.PutUint64(head[:8], uint64(iteration))
			binary.LittleEndian.PutUint64(head[8:], noise)
			h.Write(head[:])
			h.Write(line)
			var seed [32]byte
			copy(seed[:], h.Sum(nil))
			src := rand.NewChaCha8(seed)
			for _, g := range grads {
				for j := range g {
					g[j] += float32(src.Uint64()>>40)/(1<<23) - 1 // uniform in [-1, 1)
				}
			}
		}
		if errors.Is(rerr, io.EOF) {
			break
		}
		if rerr != nil {
			return 0, 0, fmt.Errorf("reading the rollouts: %w", rerr)
		}
	}
	scale := float32(1)
	if samples > 0 {
		scale = 1 / float32(samples)
	}
	var sum float64
	var n int
	for i, p := range m.params {
		if die != nil && i == len(m.params)/2 {
			die()
		}
		mom, g := m.momentum[i], grads[i]
		for j := range p {
			gj := g[j] * scale
			mom[j] = beta*mom[j] + gj
			p[j] = p[j]*(1-weightDecay) - learningRate*mom[j]
			sum += float64(gj) * float64(gj)
			n++
		}
	}
	m.iteration = iteration
	if n > 0 {
		loss = sum / float64(n)
	}
	return loss, samples, nil
}

// checkpointState is state.json of a fake checkpoint; weights.bin holds
// the parameters, then the momentum, as little-endian float32.
type checkpointState struct {
	Format    string       `json:"format"`
	Iteration int          `json:"iteration"`
	Tensors   []tensorSpec `json:"tensors"`
	RNG       []byte       `json:"rng"`
}

const checkpointFormat = "rlflow-fake-trainer/1"

// save writes a checkpoint to path durably: a temporary directory beside
// it, every file fsynced, the directory fsynced, renamed to path, the
// parent fsynced. path must not exist. die, when set, is called after the
// files are written and before the rename.
func (m *model) save(path string, die func()) (int64, error) {
	if _, err := os.Lstat(path); err == nil {
		return 0, fmt.Errorf("%s exists already", path)
	}
	parent := filepath.Dir(path)
	tmp := filepath.Join(parent, fmt.Sprintf(".%s.tmp-%d", filepath.Base(path), os.Getpid()))
	if err := os.RemoveAll(tmp); err != nil {
		return 0, err
	}
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return 0, err
	}
	rng, err := m.rng.MarshalBinary()
	if err != nil {
		return 0, err
	}
	state, err := json.Marshal(checkpointState{Format: checkpointFormat, Iteration: m.iteration, Tensors: m.specs, RNG: rng})
	if err != nil {
		return 0, err
	}
	var w bytes.Buffer
	for _, set := range [][][]float32{m.params, m.momentum} {
		for _, p := range set {
			if err := binary.Write(&w, binary.LittleEndian, p); err != nil {
				return 0, err
			}
		}
	}
	for name, data := range map[string][]byte{"state.json": state, "weights.bin": w.Bytes()} {
		if err := writeSynced(filepath.Join(tmp, name), data); err != nil {
			return 0, err
		}
	}
	if err := syncDir(tmp); err != nil {
		return 0, err
	}
	if die != nil {
		die()
	}
	if err := os.Rename(tmp, path); err != nil {
		return 0, err
	}
	if err := syncDir(parent); err != nil {
		return 0, err
	}
	return int64(len(state) + w.Len()), nil
}

// load restores what save wrote; the checkpoint's tensors must be the
// configured ones.
func (m *model) load(path string) error {
	b, err := os.ReadFile(filepath.Join(path, "state.json"))
	if err != nil {
		return err
	}
	var st checkpointState
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&st); err != nil || st.Format != checkpointFormat {
		return fmt.Errorf("%s: not a fake trainer checkpoint", filepath.Join(path, "state.json"))
	}
	if !sameSpecs(st.Tensors, m.specs) {
		return fmt.Errorf("%s holds other tensors than this trainer's (RLFLOW_FAKE_TRAINER_SHAPES)", path)
	}
	w, err := os.ReadFile(filepath.Join(path, "weights.bin"))
	if err != nil {
		return err
	}
	var elems int64
	for _, t := range m.specs {
		elems += t.elems()
	}
	if int64(len(w)) != 2*4*elems {
		return fmt.Errorf("%s: %d bytes, want %d", filepath.Join(path, "weights.bin"), len(w), 2*4*elems)
	}
	rng := &rand.PCG{}
	if err := rng.UnmarshalBinary(st.RNG); err != nil {
		return fmt.Errorf("%s: the random generator's state: %w", filepath.Join(path, "state.json"), err)
	}
	r := bytes.NewReader(w)
	for _, set := range [][][]float32{m.params, m.momentum} {
		for _, p := range set {
			if err := binary.Read(r, binary.LittleEndian, p); err != nil {
				return err
			}
		}
	}
	m.rng, m.iteration = rng, st.Iteration
	return nil
}

func sameSpecs(a, b []tensorSpec) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].Name != b[i].Name || fmt.Sprint(a[i].Shape) != fmt.Sprint(b[i].Shape) {
			return false
		}
	}
	return true
}

func writeSynced(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// Float narrowing, round to nearest even (as torch's .to()).

// bfloat16Bits is f as bfloat16.
func bfloat16Bits(f float32) uint16 {
	b := math.Float32bits(f)
	if f != f {
		return uint16(b>>16) | 0x40 // a quiet NaN, whatever its payload
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// float16Bits is f as IEEE half precision (overflow: infinity).
func float16Bits(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int(b>>23) & 0xff
	man := b & 0x7fffff
	if exp == 0xff {
		if man != 0 {
			return sign | 0x7e00
		}
		return sign | 0x7c00
	}
	e := exp - 127 + 15
	if e >= 0x1f {
		return sign | 0x7c00
	}
	if e <= 0 {
		// A subnormal half: m x 2^-24 with m = M >> shift.
		full := man | 0x800000
		shift := uint(14 - e)
		if exp == 0 || shift > 24 {
			return sign
		}
		m := full >> shift
		rem, halfway := full&(1<<shift-1), uint32(1)<<(shift-1)
		if rem > halfway || (rem == halfway && m&1 == 1) {
			m++ // may carry into the smallest normal: the right encoding
		}
		return sign | uint16(m)
	}
	h := uint16(e)<<10 | uint16(man>>13)
	rem := man & 0x1fff
	if rem > 0x1000 || (rem == 0x1000 && h&1 == 1) {
		h++ // may carry into the exponent, up to infinity: right too
	}
	return sign | h
}
