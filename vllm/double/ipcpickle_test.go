package double_test

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/internal/goldenfile"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/vllm/double"
)

var updateGolden = flag.Bool("update", false, "rewrite the golden files in testdata")

func golden(t *testing.T, name, got string) {
	t.Helper()
	goldenfile.Check(t, name, got, *updateGolden, "go test ./vllm/double -run "+t.Name()+" -update")
}

// pk writes pickle opcodes for tests: by default the protocol 3 subset
// rlflow's Go writer uses (no memo); raw lets a test add anything.
type pk struct {
	b    []byte
	wide bool // str and bytes as BINUNICODE8 and BINBYTES8
}

func (p *pk) raw(b ...byte) *pk { p.b = append(p.b, b...); return p }

func (p *pk) global(mod, name string) *pk {
	return p.raw('c').raw([]byte(mod + "\n" + name + "\n")...)
}

func (p *pk) int(v int64) *pk {
	switch {
	case v >= 0 && v < 1<<8:
		return p.raw('K', byte(v))
	case v >= 0 && v < 1<<16:
		return p.raw('M').raw(binary.LittleEndian.AppendUint16(nil, uint16(v))...)
	case v >= -1<<31 && v < 1<<31:
		return p.raw('J').raw(binary.LittleEndian.AppendUint32(nil, uint32(int32(v)))...)
	}
	b := binary.LittleEndian.AppendUint64(nil, uint64(v)) // LONG1, minimal two's complement
	for len(b) > 1 && ((b[len(b)-1] == 0 && b[len(b)-2]&0x80 == 0) || (b[len(b)-1] == 0xff && b[len(b)-2]&0x80 != 0)) {
		b = b[:len(b)-1]
	}
	return p.raw(0x8a, byte(len(b))).raw(b...)
}

func (p *pk) str(s string) *pk {
	if p.wide {
		return p.raw(0x8d).raw(binary.LittleEndian.AppendUint64(nil, uint64(len(s)))...).raw([]byte(s)...)
	}
	return p.raw('X').raw(binary.LittleEndian.AppendUint32(nil, uint32(len(s)))...).raw([]byte(s)...)
}

func (p *pk) bytes(b []byte) *pk {
	if p.wide {
		return p.raw(0x8e).raw(binary.LittleEndian.AppendUint64(nil, uint64(len(b)))...).raw(b...)
	}
	if len(b) < 256 {
		return p.raw('C', byte(len(b))).raw(b...)
	}
	return p.raw('B').raw(binary.LittleEndian.AppendUint32(nil, uint32(len(b)))...).raw(b...)
}

func (p *pk) boolean(v bool) *pk {
	if v {
		return p.raw(0x88)
	}
	return p.raw(0x89)
}

// tuple writes items with TUPLE1-3, or MARK ... TUPLE.
func (p *pk) tuple(items ...func(*pk)) *pk {
	if len(items) == 0 {
		return p.raw(')')
	}
	if len(items) > 3 {
		p.raw('(')
	}
	for _, it := range items {
		it(p)
	}
	if len(items) > 3 {
		return p.raw('t')
	}
	return p.raw(0x85 + byte(len(items)-1))
}

func (p *pk) ints(v []int64) *pk {
	items := make([]func(*pk), len(v))
	for i, d := range v {
		items[i] = func(p *pk) { p.int(d) }
	}
	return p.tuple(items...)
}

// ipcTensor is what one pickled (func, args) holds (ipc spec table).
type ipcTensor struct {
	dtype          string
	size, stride   []int64
	offset         int64 // elements
	handle         []byte
	storageBytes   int64
	storageOffset  int64
	refOffset      int64
	event          []byte
	sync           bool
	device         int64
	refHandle      []byte
	tensorModule   string // "torch" unless set
	storageModule  string // "torch.storage"
	storageClsName string // "TypedStorage"
}

// args are the 15 writers of t's args, in order; a test replaces one.
func (t ipcTensor) args() [15]func(*pk) {
	mod := "torch"
	if t.tensorModule != "" {
		mod = t.tensorModule
	}
	smod, scls := "torch.storage", "TypedStorage"
	if t.storageModule != "" {
		smod, scls = t.storageModule, t.storageClsName
	}
	ref := t.refHandle
	if ref == nil {
		ref = []byte("fake_refcounter")
	}
	return [15]func(*pk){
		func(p *pk) { p.global(mod, "Tensor") },
		func(p *pk) { p.global("torch", "Size").tuple(func(p *pk) { p.ints(t.size) }).raw('R') },
		func(p *pk) { p.ints(t.stride) },
		func(p *pk) { p.int(t.offset) },
		func(p *pk) { p.global(smod, scls) },
		func(p *pk) { p.global("torch", t.dtype) },
		func(p *pk) { p.int(t.device) },
		func(p *pk) { p.bytes(t.handle) },
		func(p *pk) { p.int(t.storageBytes) },
		func(p *pk) { p.int(t.storageOffset) },
		func(p *pk) { p.boolean(false) },
		func(p *pk) { p.bytes(ref) },
		func(p *pk) { p.int(t.refOffset) },
		func(p *pk) {
			if t.event == nil {
				p.raw('N')
			} else {
				p.bytes(t.event)
			}
		},
		func(p *pk) { p.boolean(t.sync) },
	}
}

// entry is one {uuid: (rebuild_cuda_tensor, args)} item.
type entry struct {
	uuid string
	args [15]func(*pk)
}

// pickleHandles writes the Go writer's form: PROTO 3, a list, one dict
// per tensor, MARK ... APPENDS, SETITEM per uuid, STOP.
func pickleHandles(tensors ...[]entry) []byte {
	p := &pk{}
	p.raw(0x80, 3, ']', '(')
	for _, dict := range tensors {
		p.raw('}')
		for _, e := range dict {
			p.str(e.uuid)
			p.tuple(
				func(p *pk) { p.global("torch.multiprocessing.reductions", "rebuild_cuda_tensor") },
				func(p *pk) { p.tuple(e.args[:]...) },
			)
			p.raw('s')
		}
	}
	return p.raw('e', '.').b
}

const testUUID = "0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"

// oneTensor pickles t for testUUID.
func oneTensor(t ipcTensor) []byte {
	return pickleHandles([]entry{{testUUID, t.args()}})
}

var f32x4 = ipcTensor{dtype: "float32", size: []int64{2, 2}, stride: []int64{2, 1}, handle: []byte("/dev/shm/snap"), storageBytes: 16}

// The Python fixtures (testdata/make_ipc_pickles.py, protocols 3, 4 and
// 5 of the same objects) decode to the values the script says they hold.
func TestReadIPCHandlesPythonFixtures(t *testing.T) {
	for _, name := range []string{"ipc_four", "ipc_one"} {
		var want []double.IPCHandle
		b, err := os.ReadFile(filepath.Join("testdata", name+".json"))
		require.NoError(t, err)
		require.NoError(t, json.Unmarshal(b, &want))
		for _, proto := range []string{"3", "4", "5"} {
			raw, err := os.ReadFile(filepath.Join("testdata", name+"_p"+proto+".pkl"))
			require.NoError(t, err)
			got, err := double.ReadIPCHandles(raw)
			require.NoError(t, err, "%s protocol %s", name, proto)
			assert.Equal(t, want, got, "%s protocol %s", name, proto)
		}
	}
}

// The Go writer's form, with every operand width it may use, decodes to
// the values written.
func TestReadIPCHandlesGoWriterForm(t *testing.T) {
	event := make([]byte, 64)
	for i := range event {
		event[i] = byte(i)
	}
	long := []byte(strings.Repeat("h", 300)) // BINBYTES
	a := ipcTensor{dtype: "bfloat16", size: []int64{3, 70000, 1, 2}, stride: []int64{140000, 2, 2, 1}, offset: 1 << 40,
		handle: long, storageBytes: 1<<62 + 5, storageOffset: 300, refOffset: 65535, event: event, sync: true, device: -1,
		refHandle: []byte("/torch_1_2_0")}
	b := ipcTensor{dtype: "float8_e4m3fn", size: []int64{}, stride: []int64{}, handle: []byte{}, tensorModule: "torch._tensor",
		storageModule: "torch", storageClsName: "UntypedStorage"}
	raw := pickleHandles([]entry{{testUUID, a.args()}, {"ffffffff-0000-1111-2222-333344445555", b.args()}}, []entry{{testUUID, b.args()}})
	got, err := double.ReadIPCHandles(raw)
	require.NoError(t, err)
	wantA := double.IPCRebuild{Func: double.IPCRebuildFunc, TensorClass: "torch.Tensor", Size: a.size, Stride: a.stride, TensorOffset: 1 << 40,
		StorageClass: "torch.storage.TypedStorage", DType: "bfloat16", Device: -1, StorageHandle: long, StorageBytes: 1<<62 + 5,
		StorageOffset: 300, RefCounterHandle: []byte("/torch_1_2_0"), RefCounterOffset: 65535, EventHandle: event, EventSyncRequired: true}
	wantB := double.IPCRebuild{Func: double.IPCRebuildFunc, TensorClass: "torch._tensor.Tensor", Size: []int64{}, Stride: []int64{},
		StorageClass: "torch.UntypedStorage", DType: "float8_e4m3fn", StorageHandle: []byte{}, RefCounterHandle: []byte("fake_refcounter")}
	assert.Equal(t, []double.IPCHandle{
		{{UUID: testUUID, Rebuild: wantA}, {UUID: "ffffffff-0000-1111-2222-333344445555", Rebuild: wantB}},
		{{UUID: testUUID, Rebuild: wantB}},
	}, got)
	assert.Equal(t, []string{testUUID, "ffffffff-0000-1111-2222-333344445555"}, got[0].UUIDs())
	_, ok := got[1].Find("ffffffff-0000-1111-2222-333344445555")
	assert.False(t, ok)

	// The wide forms Python uses for big values (and may use for any) read
	// the same: BINUNICODE8, BINBYTES8, LONG_BINPUT and LONG_BINGET, in a
	// FRAME.
	body := &pk{wide: true}
	pair := func(p *pk) {
		p.tuple(
			func(p *pk) { p.global("torch.multiprocessing.reductions", "rebuild_cuda_tensor") },
			func(p *pk) { a := f32x4.args(); p.tuple(a[:]...) },
		)
	}
	body.raw(']', '(', '}').str(testUUID).raw('r', 0xe8, 3, 0, 0) // LONG_BINPUT 1000
	pair(body)
	body.raw('s', '}', 'j', 0xe8, 3, 0, 0) // LONG_BINGET 1000
	pair(body)
	body.raw('s', 'e', '.')
	wide := append([]byte{0x80, 4, 0x95}, binary.LittleEndian.AppendUint64(nil, uint64(len(body.b)))...)
	got, err = double.ReadIPCHandles(append(wide, body.b...))
	require.NoError(t, err)
	narrow, err := double.ReadIPCHandles(pickleHandles([]entry{{testUUID, f32x4.args()}}, []entry{{testUUID, f32x4.args()}}))
	require.NoError(t, err)
	assert.Equal(t, narrow, got)
}

func FuzzReadIPCHandles(f *testing.F) {
	fixtures, err := filepath.Glob(filepath.Join("testdata", "*.pkl"))
	require.NoError(f, err)
	require.NotEmpty(f, fixtures)
	for _, path := range fixtures {
		b, err := os.ReadFile(path)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Add(oneTensor(f32x4))
	f.Fuzz(func(t *testing.T, data []byte) {
		got, err := double.ReadIPCHandles(data)
		if err != nil {
			var pe *double.IPCPickleError
			require.True(t, errors.As(err, &pe), "%v", err)
			require.True(t, pe.Offset >= 0 && pe.Offset <= len(data), "offset %d of %d bytes", pe.Offset, len(data))
			return
		}
		for _, h := range got {
			require.LessOrEqual(t, len(h), double.MaxIPCUUIDs)
			for _, e := range h {
				rb := e.Rebuild
				require.Equal(t, double.IPCRebuildFunc, rb.Func)
				require.Len(t, rb.Stride, len(rb.Size))
				require.NotEmpty(t, rb.DType)
				require.True(t, rb.TensorOffset >= 0 && rb.StorageBytes >= 0 && rb.StorageOffset >= 0 && rb.RefCounterOffset >= 0)
			}
		}
	})
}

// Every refusal names the offset of the opcode that made the bad value.
func TestReadIPCHandlesRefusals(t *testing.T) {
	withArg := func(i int, w func(*pk)) []byte {
		a := f32x4.args()
		a[i] = w
		return pickleHandles([]entry{{testUUID, a}})
	}
	p := func(b ...byte) []byte { return append([]byte{0x80, 3}, b...) }
	nones := func(n int) []byte {
		b := p(']', '(')
		for range n {
			b = append(b, 'N')
		}
		return append(b, 'e', '.')
	}
	manyUUIDs := &pk{}
	manyUUIDs.raw(0x80, 3, '}', '(')
	for i := range double.MaxIPCUUIDs + 1 {
		manyUUIDs.str(strings.Repeat("u", i+1)).raw('N')
	}
	manyUUIDs.raw('u', '.')
	deep := p()
	for range double.MaxIPCDims + 1 {
		deep = append(deep, '(')
	}
	cases := map[string][]byte{
		"empty":                  {},
		"no PROTO":               []byte("N."),
		"protocol 2":             {0x80, 2, ']', '.'},
		"PROTO later":            p(0x80, 3, '.'),
		"truncated, no STOP":     p(']'),
		"truncated operand":      p('K'),
		"trailing bytes":         p(']', '.', 'N'),
		"two values at STOP":     p(']', ']', '.'),
		"MARK open at STOP":      p(']', '(', '.'),
		"stack underflow":        p(0x85, '.'),
		"pop across a MARK":      p('N', '(', 0x85, '.'),
		"APPENDS without MARK":   p(']', 'e', '.'),
		"INT (text) opcode":      p('I', '1', '\n', '.'),
		"BINFLOAT opcode":        p('G', 0, 0, 0, 0, 0, 0, 0, 0, '.'),
		"BUILD opcode":           p(']', ']', 'b', '.'),
		"LONG4 opcode":           p(0x8b, 1, 0, 0, 0, 1, '.'),
		"POP opcode":             p(']', 'N', '0', '.'),
		"os.system":              p('c', 'o', 's', '\n', 's', 'y', 's', 't', 'e', 'm', '\n', '.'),
		"builtins.eval stacked":  (&pk{}).raw(0x80, 4, 0x8c, 8).raw([]byte("builtins")...).raw(0x8c, 4).raw([]byte("eval")...).raw(0x93, '.').b,
		"STACK_GLOBAL of ints":   p('K', 1, 'K', 2, 0x93, '.'),
		"GLOBAL too long":        append(p('c'), strings.Repeat("t", 1100)...),
		"GLOBAL without newline": p('c', 't', 'o'),
		"REDUCE of Tensor":       (&pk{b: p()}).global("torch", "Tensor").tuple().raw('R', '.').b,
		"Size of 2 args":         (&pk{b: p()}).global("torch", "Size").tuple(func(p *pk) { p.ints(nil) }, func(p *pk) { p.ints(nil) }).raw('R', '.').b,
		"Size of a negative dim": (&pk{b: p()}).global("torch", "Size").tuple(func(p *pk) { p.ints([]int64{-1}) }).raw('R', '.').b,
		"str too long":           (&pk{b: p()}).str(strings.Repeat("s", double.MaxIPCStringBytes+1)).raw('.').b,
		"str not UTF-8":          p(0x8c, 1, 0xff, '.'),
		"BINUNICODE8 of 2^63":    p(0x8d, 0, 0, 0, 0, 0, 0, 0, 0x80),
		"bytes too long":         (&pk{b: p()}).bytes(make([]byte, double.MaxIPCBytesLen+1)).raw('.').b,
		"bytes past the end":     p('B', 10, 0, 0, 0, 'x'),
		"LONG1 of 9 bytes":       p(0x8a, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, '.'),
		"FRAME past the end":     {0x80, 4, 0x95, 100, 0, 0, 0, 0, 0, 0, 0, ']', '.'},
		"FRAME in a FRAME":       {0x80, 4, 0x95, 11, 0, 0, 0, 0, 0, 0, 0, 0x95, 1, 0, 0, 0, 0, 0, 0, 0, ']', '.'},
		"BINGET never stored":    p(']', 'h', 7, '.'),
		"tuple too long":         append(p('('), []byte(strings.Repeat("N", 65)+"t.")...),
		"MARKs too deep":         deep,
		"list too long":          nones(double.MaxIPCTensors + 1),
		"too many UUIDs":         manyUUIDs.b,
		"SETITEMS odd":           p('}', '(', 'N', 'u', '.'),
		"dict key an int":        p('}', 'K', 1, 'N', 's', '.'),
		"append to a dict":       p('}', 'N', 'a', '.'),
		"set item of a list":     p(']', 'N', 'N', 's', '.'),
		"top is None":            p('N', '.'),
		"element not a dict":     p(']', 'K', 5, 'a', '.'),
		"value not a pair":       p(']', '}', 'X', 1, 0, 0, 0, 'u', 'N', 's', 'a', '.'),
		"args of 14":             (&pk{b: p(']', '}')}).str(testUUID).tuple(func(p *pk) { p.global("torch.multiprocessing.reductions", "rebuild_cuda_tensor") }, func(p *pk) { a := f32x4.args(); p.tuple(a[:14]...) }).raw('s', 'a', '.').b,
		"arg 0 a storage class":  withArg(0, func(p *pk) { p.global("torch.storage", "TypedStorage") }),
		"arg 1 a tuple":          withArg(1, func(p *pk) { p.ints([]int64{2, 2}) }),
		"arg 2 one stride":       withArg(2, func(p *pk) { p.ints([]int64{1}) }),
		"arg 3 negative":         withArg(3, func(p *pk) { p.int(-2) }),
		"arg 5 an int":           withArg(5, func(p *pk) { p.int(6) }),
		"arg 5 unknown dtype":    withArg(5, func(p *pk) { p.global("torch", "complex64") }),
		"arg 6 a bool":           withArg(6, func(p *pk) { p.boolean(true) }),
		"arg 7 a str":            withArg(7, func(p *pk) { p.str("/dev/shm/snap") }),
		"arg 8 None":             withArg(8, func(p *pk) { p.raw('N') }),
		"arg 10 an int":          withArg(10, func(p *pk) { p.int(0) }),
		"arg 13 an int":          withArg(13, func(p *pk) { p.int(0) }),
		"arg 14 None":            withArg(14, func(p *pk) { p.raw('N') }),
	}
	// The func slot holding another allowed global.
	fn := &pk{b: p(']', '}')}
	fn.str(testUUID).tuple(func(p *pk) { p.global("torch", "Size") }, func(p *pk) { a := f32x4.args(); p.tuple(a[:]...) }).raw('s', 'a', '.')
	cases["func is torch.Size"] = fn.b

	names := make([]string, 0, len(cases))
	for name := range cases {
		names = append(names, name)
	}
	sort.Strings(names)
	var out strings.Builder
	for _, name := range names {
		_, err := double.ReadIPCHandles(cases[name])
		require.Error(t, err, name)
		var pe *double.IPCPickleError
		require.True(t, errors.As(err, &pe), "%s: %v", name, err)
		out.WriteString(name + ": " + err.Error() + "\n")
	}
	golden(t, "ipc_pickle_refusals.golden", out.String())
}

func TestDecodeIPCHandlesPickled(t *testing.T) {
	_, err := double.DecodeIPCHandlesPickled("gAN dLg==")
	assert.ErrorContains(t, err, "ipc_handles_pickled is not standard base64")
	_, err = double.DecodeIPCHandlesPickled("gANOLg==") // PROTO 3, NONE, STOP
	assert.EqualError(t, err, "ipc_handles_pickled: ipc pickle: offset 2 (NONE): the pickled ipc_handles is None, want a list")
}
