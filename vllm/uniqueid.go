package vllm

import (
	"encoding/base64"
	"fmt"
)

// ncclUniqueIDBytes is the size of NCCL's ncclUniqueId, whose standard
// base64 is init_info.nccl_unique_id_b64 (spec section 8).
const ncclUniqueIDBytes = 128

// checkUniqueID refuses an nccl_unique_id_b64 that is not the base64 of an
// ncclUniqueId, so a bad id fails here rather than inside the server. (The
// trainer side encodes ids with nccl/ncclid; this client, which control
// workers use, checks the contract's shape without depending on nccl.)
func checkUniqueID(b64 string) error {
	b, err := base64.StdEncoding.Strict().DecodeString(b64)
	if err == nil && len(b) != ncclUniqueIDBytes {
		err = fmt.Errorf("%d bytes, want %d", len(b), ncclUniqueIDBytes)
	}
	if err != nil {
		return fmt.Errorf("init_info: nccl_unique_id_b64: %w", err)
	}
	return nil
}
