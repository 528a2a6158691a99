package vllm

import (
	"fmt"

	"github.com/rlflow/rlflow/nccl/ncclid"
)

// checkUniqueID refuses an nccl_unique_id_b64 that is not the base64 of an
// ncclUniqueId, so a bad id fails here rather than inside the server.
func checkUniqueID(b64 string) error {
	if _, err := ncclid.DecodeB64(b64); err != nil {
		return fmt.Errorf("init_info: nccl_unique_id_b64: %w", err)
	}
	return nil
}
