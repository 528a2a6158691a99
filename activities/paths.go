package activities

import (
	"fmt"
	"path/filepath"
	"regexp"

	"github.com/rlflow/rlflow/pipelines"
)

// resolvePath resolves p against the pipeline's base directory; "" gives
// the base itself.
func resolvePath(base, p string) string {
	if p == "" {
		return base
	}
	if filepath.IsAbs(p) || base == "" {
		return p
	}
	return filepath.Join(base, p)
}

var unsafeChars = regexp.MustCompile(`[^A-Za-z0-9._-]+`)

// safeName makes an id usable as one path element.
func safeName(s string) string {
	if s == "" {
		return "_"
	}
	return unsafeChars.ReplaceAllString(s, "_")
}

// stepDir is the step's own directory under root:
// <root>/<run>/iter-<n>/<step>, every element made safe.
func stepDir(root string, sc pipelines.StepContext) string {
	return filepath.Join(root, safeName(sc.RunID), fmt.Sprintf("iter-%d", sc.Iteration), safeName(sc.StepID))
}
