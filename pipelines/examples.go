package pipelines

import (
	"embed"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// Examples holds the example pipelines shipped in the binary and the data
// files they read (examples/data); `rlflow dev` runs examples/rlhf-demo.yaml
// when given no file.
//
//go:embed examples/*.yaml examples/data/*
var Examples embed.FS

// CopyExampleData writes the embedded examples/data files under
// dir/data, so an embedded example whose base_dir is dir finds them.
// Existing files are overwritten (the embedded ones are the reference).
func CopyExampleData(dir string) error {
	return fs.WalkDir(Examples, "examples/data", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel("examples", path)
		if err != nil {
			return err
		}
		dst := filepath.Join(dir, rel)
		if d.IsDir() {
			return os.MkdirAll(dst, 0o755)
		}
		b, err := Examples.ReadFile(path)
		if err != nil {
			return err
		}
		if err := os.WriteFile(dst, b, 0o644); err != nil {
			return fmt.Errorf("example data: %w", err)
		}
		return nil
	})
}
