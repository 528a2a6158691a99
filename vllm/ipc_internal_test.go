package vllm

import (
	"encoding/hex"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/trainer"
)

// ipcItemSizes is a copy kept because vllm cannot import trainer (the
// source of truth) or safetensors: over every dtype safetensors knows, it
// holds exactly the dtypes trainer.DTypeSize takes, with the same sizes.
func TestIPCItemSizesAgreeWithTrainer(t *testing.T) {
	seen := 0
	for _, d := range safetensors.DTypes() {
		name := d.TorchName()
		want, inTrainer := trainer.DTypeSize(name)
		got, inIPC := ipcItemSizes[name]
		assert.Equal(t, inTrainer, inIPC, "dtype %s: in trainer's table %v, in ipc's %v", name, inTrainer, inIPC)
		if inIPC {
			seen++
			assert.Equal(t, want, got, "dtype %s item size", name)
			assert.Equal(t, int64(d.ItemSize()), got, "dtype %s item size per safetensors", name)
		}
	}
	assert.Equal(t, len(ipcItemSizes), seen, "every ipc dtype is a torch name safetensors knows")
}

// The ints as CPython's protocol-3 pickler writes them (pickle.dumps(v, 3)
// without PROTO and STOP).
func TestPicklerInts(t *testing.T) {
	for v, want := range map[int64]string{
		0: "4b00", 255: "4bff", 256: "4d0001", 65535: "4dffff", 65536: "4a00000100",
		-1: "4affffffff", math.MaxInt32: "4affffff7f", math.MinInt32: "4a00000080",
		math.MaxInt32 + 1: "8a050000008000", math.MinInt32 - 1: "8a05ffffff7fff",
		5 << 30: "8a050000004001", math.MaxInt64: "8a08ffffffffffffff7f", math.MinInt64: "8a080000000000000080",
	} {
		var p pickler
		p.int(v)
		assert.Equal(t, want, hex.EncodeToString(p.b), "int %d", v)
	}
}
