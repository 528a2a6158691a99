package double_test

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

const otherUUID = "ffffffff-0000-1111-2222-333344445555"

// countingOpener is FileIPC that counts its opens.
type countingOpener struct {
	mu    sync.Mutex
	opens int
}

func (c *countingOpener) OpenIPC(handle []byte, storageBytes, storageOffset int64) ([]byte, error) {
	c.mu.Lock()
	c.opens++
	c.mu.Unlock()
	return double.FileIPC{}.OpenIPC(handle, storageBytes, storageOffset)
}

func (c *countingOpener) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.opens
}

// fakeShm is a fake_shm snapshot as the fake trainer writes one: a file
// standing in for the device block, whose storage starts storageOffset
// bytes in; the tensors lie at the given byte offsets of the storage.
type fakeShm struct {
	path          string
	storageOffset int64
	storageBytes  int64
}

// writeFakeShm lays models' logits one after another from byte 64 of a
// storage that starts 4096 bytes into a new file; the bytes around them
// are junk, so a wrong offset loads garbage (and fails the test).
func writeFakeShm(t *testing.T, models ...*bigram.Model) fakeShm {
	t.Helper()
	const storageOffset, pad = 4096, 64
	var file bytes.Buffer
	file.Write(bytes.Repeat([]byte{0x7f}, storageOffset+pad))
	for _, m := range models {
		file.Write(m.Bytes())
	}
	file.Write(bytes.Repeat([]byte{0x7f}, 100))
	path := filepath.Join(t.TempDir(), "snapshot.shm")
	require.NoError(t, os.WriteFile(path, file.Bytes(), 0o600))
	return fakeShm{path: path, storageOffset: storageOffset, storageBytes: int64(file.Len()) - storageOffset}
}

// logits is the handle of the i-th model written by writeFakeShm, its
// ref-counter slot i.
func (f fakeShm) logits(i int) ipcTensor {
	return ipcTensor{dtype: "float32", size: []int64{bigram.Vocab, bigram.Vocab}, stride: []int64{bigram.Vocab, 1},
		offset: 16 + int64(i)*bigram.Vocab*bigram.Vocab, handle: []byte(f.path), storageBytes: f.storageBytes,
		storageOffset: f.storageOffset, refOffset: int64(i), device: 2}
}

// updateBody is a JSON update_info carrying pickled for names, all
// bigram.logits-shaped float32 unless dtypes/shapes say otherwise.
func updateBody(names []string, pickled []byte, extra string) string {
	dtypes, shapes := make([]string, len(names)), make([]string, len(names))
	for i := range names {
		dtypes[i], shapes[i] = `"float32"`, "[128,128]"
	}
	n, _ := json.Marshal(names)
	return `{"update_info":{"names":` + string(n) + `,"dtype_names":[` + strings.Join(dtypes, ",") + `],"shapes":[` +
		strings.Join(shapes, ",") + `],"ipc_handles_pickled":"` + base64.StdEncoding.EncodeToString(pickled) + `"` + extra + `}}`
}

func ipcConfig(gen double.Generation, opener double.IPCOpener) double.Config {
	return double.Config{Generation: gen, Backend: double.BackendIPC, DevMode: true, GPUUUID: testUUID,
		IPCOpener: opener, AllowInsecureSerialization: true}
}

func TestIPCConfig(t *testing.T) {
	for name, cfg := range map[string]double.Config{
		"gen A":          {Generation: double.GenA, Backend: double.BackendIPC, GPUUUID: testUUID},
		"gen B":          {Generation: double.GenB, Backend: double.BackendIPC, GPUUUID: testUUID},
		"no UUID":        {Generation: double.GenE, Backend: double.BackendIPC},
		"GPU- prefix":    {Generation: double.GenE, Backend: double.BackendIPC, GPUUUID: "GPU-" + testUUID},
		"uppercase UUID": {Generation: double.GenE, Backend: double.BackendIPC, GPUUUID: strings.ToUpper(testUUID)},
	} {
		_, err := double.New(cfg)
		assert.Error(t, err, name)
	}
	s := start(t, ipcConfig(double.GenE, nil))
	assert.Contains(t, s.ok("GET", "/server_info?config_format=json", ""), `"weight_transfer_config":{"backend":"ipc"}`)
}

// A whole ipc update over HTTP, as rlflow sends it: three tensors of one
// storage (the last one wins, as vLLM's load_weights of one name three
// times), each dict offering two GPUs. The storage is opened once and the
// three ref-counter slots are consumed: one held, two released.
func TestIPCUpdateRoundTrip(t *testing.T) {
	for _, gen := range []double.Generation{double.GenC, double.GenD, double.GenE} {
		for _, listForm := range []bool{false, true} {
			if listForm && gen != double.GenE {
				continue
			}
			opener := &countingOpener{}
			s := start(t, ipcConfig(gen, opener))
			models := []*bigram.Model{bigram.Random(11), bigram.Random(12), bigram.Random(13)}
			shm := writeFakeShm(t, models...)
			var dicts [][]entry
			for i := range models {
				other := shm.logits(i)
				other.device = 0
				dicts = append(dicts, []entry{{otherUUID, other.args()}, {testUUID, shm.logits(i).args()}})
			}
			body := updateBody([]string{bigram.TensorName, bigram.TensorName, bigram.TensorName}, pickleHandles(dicts...), "")
			if listForm { // E: one entry per inference worker
				body = strings.Replace(strings.Replace(body, `{"update_info":{`, `{"update_info":[{`, 1), `}}`, `}]}`, 1)
			}
			s.ok("POST", "/init_weight_transfer_engine", `{"init_info":{}}`)
			s.ok("POST", "/start_weight_update", `{}`)
			s.ok("POST", "/update_weights", body)
			s.ok("POST", "/finish_weight_update", `{"weight_version":"v7"}`)
			assert.Equal(t, models[2].Bytes(), s.Model().Bytes(), "gen %s", gen)
			assert.Equal(t, "v7", s.WeightVersion())
			assert.Equal(t, 1, opener.count(), "one open per storage per update")
			assert.Equal(t, double.IPCRefs{Held: 1, Released: 2, LastOffsets: []int64{0, 1, 2}}, s.IPCRefs(), "gen %s", gen)

			// The next update opens the storage again (torch's cache holds
			// the storage only while a tensor of it lives).
			s.ok("POST", "/start_weight_update", `{}`)
			s.ok("POST", "/update_weights", updateBody([]string{bigram.TensorName}, pickleHandles(dicts[0]), ""))
			s.ok("POST", "/finish_weight_update", `{}`)
			assert.Equal(t, models[0].Bytes(), s.Model().Bytes())
			assert.Equal(t, 2, opener.count())
			assert.Equal(t, double.IPCRefs{Held: 2, Released: 2, LastOffsets: []int64{0}}, s.IPCRefs())
		}
	}
}

// The Python fixture of one tensor (protocol 3, 4 or 5) goes through the
// whole HTTP path; an opener standing in for CUDA serves its storage.
func TestIPCUpdateFromPythonPickles(t *testing.T) {
	m := bigram.Random(5)
	for _, proto := range []string{"3", "4", "5"} {
		raw, err := os.ReadFile(filepath.Join("testdata", "ipc_one_p"+proto+".pkl"))
		require.NoError(t, err)
		opener := storageOpener{data: m.Bytes()}
		s := start(t, ipcConfig(double.GenE, opener))
		s.ok("POST", "/start_weight_update", `{}`)
		s.ok("POST", "/update_weights", updateBody([]string{bigram.TensorName}, raw, ""))
		assert.Equal(t, m.Bytes(), s.Model().Bytes(), "protocol %s", proto)
	}
}

// storageOpener stands in for CUDA: every storage is data.
type storageOpener struct{ data []byte }

func (o storageOpener) OpenIPC(_ []byte, storageBytes, _ int64) ([]byte, error) {
	if storageBytes != int64(len(o.data)) {
		return nil, fmt.Errorf("test opener: a storage of %d bytes, it serves %d", storageBytes, len(o.data))
	}
	return bytes.Clone(o.data), nil
}

// Every way an ipc init or update is refused over HTTP, on D (worker
// errors and non-object bodies are 500) and E (non-object bodies are 400),
// with the messages in testdata/ipc_update_refusals.golden.
func TestIPCRefusals(t *testing.T) {
	m := bigram.Random(3)
	for _, gen := range []double.Generation{double.GenD, double.GenE} {
		t.Run(string(gen), func(t *testing.T) {
			shm := writeFakeShm(t, m)
			good := shm.logits(0)
			one := func(tt ipcTensor) []byte { return oneTensor(tt) }
			with := func(f func(*ipcTensor)) []byte {
				tt := good
				f(&tt)
				return one(tt)
			}
			logits := []string{bigram.TensorName}
			b64 := base64.StdEncoding.EncodeToString(one(good))
			type row struct {
				name, path, body string
				cfg              func(*double.Config) // a server of its own
			}
			rows := []row{
				{"init packed", "/init_weight_transfer_engine", `{"init_info":{"packed":true}}`, nil},
				{"init a list", "/init_weight_transfer_engine", `{"init_info":[]}`, nil},
				{"unknown key", "/update_weights", updateBody(logits, one(good), `,"packed":true`), nil},
				{"missing names", "/update_weights", `{"update_info":{"dtype_names":[],"shapes":[],"ipc_handles_pickled":"` + b64 + `"}}`, nil},
				{"names not strings", "/update_weights", `{"update_info":{"names":[1],"dtype_names":[],"shapes":[],"ipc_handles_pickled":"` + b64 + `"}}`, nil},
				{"both forms", "/update_weights", updateBody(logits, one(good), `,"ipc_handles":[{}]`), nil},
				{"insecure serialization off", "/update_weights", updateBody(logits, one(good), ""), func(c *double.Config) { c.AllowInsecureSerialization = false }},
				{"neither form", "/update_weights", `{"update_info":{"names":[],"dtype_names":[],"shapes":[],"ipc_handles_pickled":null}}`, nil},
				{"Ray form", "/update_weights", `{"update_info":{"names":[],"dtype_names":[],"shapes":[],"ipc_handles":[]}}`, nil},
				{"dtype_names short", "/update_weights", `{"update_info":{"names":["a"],"dtype_names":[],"shapes":[[1]],"ipc_handles_pickled":"` + b64 + `"}}`, nil},
				{"shapes short", "/update_weights", `{"update_info":{"names":["a"],"dtype_names":["float32"],"shapes":[],"ipc_handles_pickled":"` + b64 + `"}}`, nil},
				{"ipc_handles long", "/update_weights", updateBody(logits, pickleHandles([]entry{{testUUID, good.args()}}, []entry{{testUUID, good.args()}}), ""), nil},
				{"not base64", "/update_weights", strings.Replace(updateBody(logits, one(good), ""), `"ipc_handles_pickled":"`, `"ipc_handles_pickled":"*`, 1), nil},
				{"not an ipc pickle", "/update_weights", updateBody(logits, []byte("\x80\x03cos\nsystem\n."), ""), nil},
				{"UUID not found", "/update_weights", updateBody(logits, pickleHandles([]entry{{otherUUID, good.args()}, {"11111111-2222-3333-4444-555555555555", good.args()}}), ""), nil},
				{"dtype disagrees", "/update_weights", updateBody(logits, with(func(tt *ipcTensor) { tt.dtype = "bfloat16" }), ""), nil},
				{"shape disagrees", "/update_weights", updateBody(logits, with(func(tt *ipcTensor) { tt.size, tt.stride = []int64{16384}, []int64{1} }), ""), nil},
				{"not contiguous", "/update_weights", updateBody(logits, with(func(tt *ipcTensor) { tt.stride = []int64{1, 128} }), ""), nil},
				{"shared ref slot", "/update_weights", updateBody([]string{"a", "b"}, pickleHandles([]entry{{testUUID, good.args()}}, []entry{{testUUID, good.args()}}), ""), nil},
				{"past the storage", "/update_weights", updateBody(logits, with(func(tt *ipcTensor) { tt.offset = shm.storageBytes/4 - 100 }), ""), nil},
				{"empty storage", "/update_weights", updateBody(logits, with(func(tt *ipcTensor) { tt.storageBytes = 0 }), ""), nil},
				{"storage past the file", "/update_weights", updateBody(logits, with(func(tt *ipcTensor) { tt.storageOffset = 1 << 20 }), ""), nil},
				{"a CUDA handle", "/update_weights", updateBody(logits, with(func(tt *ipcTensor) { tt.handle = append([]byte{1, 'c'}, make([]byte, 64)...) }), ""), nil},
				{"no such file", "/update_weights", updateBody(logits, with(func(tt *ipcTensor) { tt.handle = []byte(filepath.Join(filepath.Dir(shm.path), "gone.shm")) }), ""), nil},
				{"no opener", "/update_weights", updateBody(logits, one(good), ""), func(c *double.Config) { c.IPCOpener = nil }},
				{"unknown weight", "/update_weights", updateBody([]string{"lm_head.weight"}, one(good), ""), nil},
				{"not a bigram table", "/update_weights", strings.Replace(updateBody(logits, with(func(tt *ipcTensor) { tt.size, tt.stride = []int64{2, 2}, []int64{2, 1} }), ""), "[128,128]", "[2,2]", 1), nil},
				{"no session", "/update_weights", updateBody(logits, one(good), ""), func(*double.Config) {}},
			}
			shared := start(t, ipcConfig(gen, double.FileIPC{}))
			var out strings.Builder
			for _, r := range rows {
				s := shared
				if r.cfg != nil {
					cfg := ipcConfig(gen, double.FileIPC{})
					r.cfg(&cfg)
					s = start(t, cfg)
				}
				if r.path == "/update_weights" && r.name != "no session" {
					s.call("POST", "/start_weight_update", `{}`) // open (or already open on D: a 500)
				}
				status, body := s.call("POST", r.path, r.body)
				assert.NotEqual(t, 200, status, "%s: %s", r.name, body)
				var e struct {
					Error struct{ Message string } `json:"error"`
				}
				require.NoError(t, json.Unmarshal([]byte(body), &e), body)
				msg := strings.ReplaceAll(e.Error.Message, filepath.Dir(shm.path), "$TMP")
				fmt.Fprintf(&out, "%s: %d %s\n", r.name, status, msg)
			}
			golden(t, "ipc_update_refusals_"+string(gen)+".golden", out.String())
			assert.NotEqual(t, m.Bytes(), shared.Model().Bytes(), "no refused update loaded weights")
		})
	}
}
