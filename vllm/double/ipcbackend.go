package double

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// IPCOpener opens the storage an ipc handle names, as torch's
// rebuild_cuda_tensor does with _new_shared_cuda: handle is the pickle's
// storage_handle, and the result is the storage's storageBytes bytes,
// which start storageOffset bytes into the block the handle names. The
// double opens each distinct (handle, storageOffset) once per update, as
// torch's shared storage cache does, and reads tensors from the bytes.
type IPCOpener interface {
	OpenIPC(handle []byte, storageBytes, storageOffset int64) ([]byte, error)
}

// FileIPC is the TEST DOUBLE IPCOpener for the fake trainer's fake_shm
// snapshots (trainer.IPCFakeShm): the handle bytes are the absolute path
// of the file standing in for the device block, and the storage is the
// storageBytes bytes at storageOffset in that file (the snapshot's
// storage_offset is its offset in the block, and the file is the block).
// It copies the bytes; it opens no CUDA handle and refuses one.
type FileIPC struct{}

var _ IPCOpener = FileIPC{}

// maxFileIPCBytes bounds what FileIPC reads into memory at once.
const maxFileIPCBytes = 1 << 30

// OpenIPC reads the storage from the file the handle names.
func (FileIPC) OpenIPC(handle []byte, storageBytes, storageOffset int64) ([]byte, error) {
	path := string(handle)
	if !utf8.Valid(handle) || bytes.IndexByte(handle, 0) >= 0 || !filepath.IsAbs(path) {
		return nil, fmt.Errorf("double.FileIPC (a test double) opens fake_shm handles only, an absolute file path; this %d-byte handle is not one (a CUDA IPC handle needs a real GPU)", len(handle))
	}
	if storageBytes < 0 || storageOffset < 0 || storageBytes > maxFileIPCBytes {
		return nil, fmt.Errorf("double.FileIPC: %s: storage of %d bytes at offset %d, want 0..%d bytes at an offset >= 0", path, storageBytes, storageOffset, maxFileIPCBytes)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("double.FileIPC: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("double.FileIPC: %w", err)
	}
	if end := storageOffset + storageBytes; end < storageOffset || end > st.Size() {
		return nil, fmt.Errorf("double.FileIPC: %s holds %d bytes; the storage ends at byte %d", path, st.Size(), storageOffset+storageBytes)
	}
	buf := make([]byte, storageBytes)
	if _, err := f.ReadAt(buf, storageOffset); err != nil && err != io.EOF {
		return nil, fmt.Errorf("double.FileIPC: read %s: %w", path, err)
	}
	return buf, nil
}

// IPCRefs counts the producer's ref-counter slots the ipc updates took, as
// torch's rebuild_cuda_tensor does: the first open of a storage in an
// update holds its tensor's slot until the storage is freed (for the
// double, when the update ends), and each further tensor of the same
// storage releases its slot at once (_release_ipc_counter). So Held +
// Released grows by one per tensor received (none for a tensor whose
// storage_size_bytes is 0: torch opens nothing then).
type IPCRefs struct {
	Held     int // storages opened, each holding one slot (cumulative)
	Released int // cache hits, each releasing one slot at once (cumulative)
	// LastOffsets are the ref_counter_offset of every slot the last ipc
	// update took, in tensor order.
	LastOffsets []int64
}

// IPCRefs returns the ref-counter counts of the ipc updates so far.
func (s *Server) IPCRefs() IPCRefs {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.wstate.ipcRefs
	out.LastOffsets = slices.Clone(out.LastOffsets)
	return out
}

// ipcHandles runs IPCWeightTransferUpdateInfo.__post_init__: the checks in
// vLLM's order with vLLM's messages, except that the Ray form ipc_handles
// is refused (JSON cannot carry it) and the pickle is read by the
// restricted reader.
func (s *Server) ipcHandles(info map[string]json.RawMessage) ([]IPCHandle, error) {
	names, _ := get[[]string](info, "names")
	dtypes, _ := get[[]string](info, "dtype_names")
	shapes, _ := get[[][]int64](info, "shapes")
	_, ray := info["ipc_handles"]
	pickled, hasPickled := get[string](info, "ipc_handles_pickled")
	var handles []IPCHandle
	switch {
	case hasPickled && ray:
		return nil, workerError("ValueError: Cannot specify both `ipc_handles` and `ipc_handles_pickled`")
	case hasPickled && !s.cfg.AllowInsecureSerialization:
		return nil, workerError("ValueError: Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1")
	case hasPickled:
		var err error
		if handles, err = DecodeIPCHandlesPickled(pickled); err != nil {
			var pe *IPCPickleError
			if errors.As(err, &pe) {
				return nil, workerError("UnpicklingError: double: update_info.%v (the vLLM double reads only what vLLM's ipc backend pickles)", err)
			}
			return nil, workerError("binascii.Error: double: update_info.%v", err)
		}
	case ray:
		return nil, workerError("ValueError: double: update_info.ipc_handles is the Ray form (live (func, args) objects), which cannot arrive over HTTP: send ipc_handles_pickled, the standard base64 of pickle.dumps(ipc_handles)")
	default:
		return nil, workerError("ValueError: Either `ipc_handles` or `ipc_handles_pickled` must be provided")
	}
	for _, l := range []struct {
		field string
		n     int
	}{{"dtype_names", len(dtypes)}, {"shapes", len(shapes)}, {"ipc_handles", len(handles)}} {
		if l.n != len(names) {
			return nil, workerError("ValueError: `%s` should be of the same size as `names`: got %d and %d", l.field, l.n, len(names))
		}
	}
	return handles, nil
}

// ipcTensor is one tensor of an ipc update, validated.
type ipcTensor struct {
	name         string
	rb           IPCRebuild
	offset, size int64 // bytes within the storage
	item         int64
}

// receiveIPC is the ipc engine's receive_weights followed by load_weights.
func (s *Server) receiveIPC(info map[string]json.RawMessage) (*bigram.Model, error) {
	handles, err := s.ipcHandles(info)
	if err != nil {
		return nil, err
	}
	names, _ := get[[]string](info, "names")
	dtypes, _ := get[[]string](info, "dtype_names")
	shapes, _ := get[[][]int64](info, "shapes")
	s.mu.Lock()
	s.wstate.ipcRefs.LastOffsets = nil
	s.mu.Unlock()
	uuid := s.cfg.GPUUUID
	plan := make([]ipcTensor, len(names))
	slots := map[string]string{} // ref-counter slot -> the tensor that took it
	var total int64
	for i, name := range names {
		rb, ok := handles[i].Find(uuid)
		if !ok {
			return nil, workerError("ValueError: IPC handle not found for GPU UUID %s. Available UUIDs: %s", uuid, pyStrList(handles[i].UUIDs()))
		}
		t, err := checkIPCTensor(name, dtypes[i], shapes[i], rb)
		if err != nil {
			return nil, err
		}
		slot := strconv.Quote(string(rb.RefCounterHandle)) + ":" + strconv.FormatInt(rb.RefCounterOffset, 10)
		if other, dup := slots[slot]; dup {
			return nil, workerError("ValueError: double: tensors %q and %q share one ref-counter slot (ref_counter_offset %d): torch's reduce_tensor takes a slot per tensor (one _share_cuda_() call each) and vLLM's worker releases one per tensor, so a shared slot drives the producer's count negative",
				other, name, rb.RefCounterOffset)
		}
		slots[slot] = name
		plan[i] = t
		total += t.size
	}
	if s.cfg.IPCOpener == nil {
		return nil, workerError("double: no IPC opener: the update_info is valid (%d tensors, %d bytes) but the double cannot open CUDA IPC handles; configure Config.IPCOpener (FileIPC for fake_shm snapshots)",
			len(plan), total)
	}
	return s.openAndLoad(plan)
}

// checkIPCTensor holds one tensor's pickled handle against the update's
// metadata. vLLM ignores dtype_names and shapes here and loads whatever
// the handle rebuilds (garbage when they disagree): the double refuses.
func checkIPCTensor(name, dtype string, shape []int64, rb IPCRebuild) (ipcTensor, error) {
	t := ipcTensor{name: name, rb: rb}
	if rb.DType != dtype {
		return t, workerError("ValueError: double: tensor %q: the pickled handle's dtype is %s but update_info.dtype_names says %q (vLLM would load the handle's tensor regardless; the double is stricter)", name, rb.DType, dtype)
	}
	if !slices.Equal(rb.Size, shape) {
		return t, workerError("ValueError: double: tensor %q: the pickled handle's size is %s but update_info.shapes says %s (vLLM would load the handle's tensor regardless; the double is stricter)", name, pyIntList(rb.Size), pyIntList(shape))
	}
	if !contiguous(rb.Size, rb.Stride) {
		return t, workerError("ValueError: double: tensor %q: stride %s is not C-contiguous for size %s; the vLLM double reads a tensor as contiguous bytes (a double limitation: vLLM's load_weights copies any view)", name, pyIntList(rb.Stride), pyIntList(rb.Size))
	}
	dt, err := safetensors.DTypeFromTorch(rb.DType)
	if err != nil { // the reader allows only known dtypes
		return t, workerError("ValueError: double: tensor %q: %v", name, err)
	}
	t.item = int64(dt.ItemSize())
	size, ok := tensorBytes(rb.Size, t.item)
	hi, off := bits.Mul64(uint64(rb.TensorOffset), uint64(t.item))
	if !ok || hi != 0 || off > math.MaxInt64-uint64(size) {
		return t, workerError("ValueError: double: tensor %q: size %s at element offset %d is too large", name, pyIntList(rb.Size), rb.TensorOffset)
	}
	t.offset, t.size = int64(off), size
	return t, nil
}

// contiguous is torch's is_contiguous: strides of dims of size 1 do not
// count, and an empty tensor is contiguous.
func contiguous(size, stride []int64) bool {
	if slices.Contains(size, 0) {
		return true
	}
	expected := int64(1)
	for i := len(size) - 1; i >= 0; i-- {
		if size[i] == 1 {
			continue
		}
		if stride[i] != expected {
			return false
		}
		expected *= size[i] // an overflow only lets a too-large tensor pass here; tensorBytes refuses it next
	}
	return true
}

// storageKey is torch's shared storage cache key.
type storageKey struct {
	handle string
	offset int64
}

// openAndLoad opens each distinct storage once (torch's cache), takes the
// tensors' bytes and loads them as the NCCL path loads received tensors.
func (s *Server) openAndLoad(plan []ipcTensor) (*bigram.Model, error) {
	storages := map[storageKey][]byte{}
	tensors := make([]Tensor, 0, len(plan))
	var offsets []int64
	defer func() {
		s.mu.Lock()
		s.wstate.ipcRefs.LastOffsets = offsets
		s.mu.Unlock()
	}()
	for _, t := range plan {
		rb := t.rb
		var storage []byte
		if rb.StorageBytes > 0 { // torch opens nothing for an empty storage
			key := storageKey{string(rb.StorageHandle), rb.StorageOffset}
			var hit bool
			if storage, hit = storages[key]; hit {
				s.countIPCRef(&offsets, rb.RefCounterOffset, false)
			} else {
				var err error
				if storage, err = s.cfg.IPCOpener.OpenIPC(rb.StorageHandle, rb.StorageBytes, rb.StorageOffset); err != nil {
					return nil, workerError("RuntimeError: tensor %q: open the IPC storage (%d bytes at offset %d of its block): %v", t.name, rb.StorageBytes, rb.StorageOffset, err)
				}
				if int64(len(storage)) != rb.StorageBytes {
					return nil, workerError("RuntimeError: double: tensor %q: the IPC opener gave %d bytes for a storage of %d", t.name, len(storage), rb.StorageBytes)
				}
				storages[key] = storage
				s.countIPCRef(&offsets, rb.RefCounterOffset, true)
			}
		}
		// torch's setStorage bound (computeStorageNbytes for a contiguous tensor).
		need := int64(0)
		if t.size > 0 {
			need = t.offset + t.size
		}
		if need > int64(len(storage)) {
			return nil, workerError("RuntimeError: setStorage: sizes %s, strides %s, storage offset %d, and itemsize %d requiring a storage size of %d are out of bounds for storage of size %d",
				pyIntList(rb.Size), pyIntList(rb.Stride), rb.TensorOffset, t.item, need, len(storage))
		}
		var data []byte
		if t.size > 0 {
			data = bytes.Clone(storage[t.offset : t.offset+t.size])
		}
		tensors = append(tensors, Tensor{Name: t.name, DType: rb.DType, Shape: rb.Size, Data: data})
	}
	return loadTensors(tensors)
}

// countIPCRef records one ref-counter slot taken: held by an open, or
// released by a cache hit.
func (s *Server) countIPCRef(offsets *[]int64, offset int64, held bool) {
	*offsets = append(*offsets, offset)
	s.mu.Lock()
	defer s.mu.Unlock()
	if held {
		s.wstate.ipcRefs.Held++
	} else {
		s.wstate.ipcRefs.Released++
	}
}

// pyIntList is Python's repr of a list of ints: [2, 3].
func pyIntList(l []int64) string {
	parts := make([]string, len(l))
	for i, v := range l {
		parts[i] = strconv.FormatInt(v, 10)
	}
	return "[" + strings.Join(parts, ", ") + "]"
}
