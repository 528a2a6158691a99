package pipelines

import "embed"

// Examples holds the example pipelines shipped in the binary; `rlflow dev`
// runs examples/hello.yaml when given no file.
//
//go:embed examples/*.yaml
var Examples embed.FS
