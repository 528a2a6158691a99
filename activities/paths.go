package activities

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"

	"github.com/rlflow/rlflow/pipelines"
)

// Roots are the directories a worker serves files from: every path a
// pipeline names (spec_path, base_dir, prompts, outputs, checkpoints, an exec
// step's dir and program) must resolve inside one of them, symbolic links
// followed. Anyone who can start a workflow on the cluster can name any path
// in a spec; the roots are what keeps that from reading or writing the rest
// of the worker's host.
//
// Invariants: each root is absolute, exists, is a directory, holds no
// symbolic link in its path, and is neither / nor inside /proc, /sys or
// /dev. A refusal says which field and path were refused, never whether a
// path outside the roots exists: its text depends only on the field, the
// path as given and the roots.
//
// A nil *Roots confines nothing (paths resolve as written); it is for
// programs that trust every spec, such as in-process tests. The rlflow
// worker and dev commands always set roots.
type Roots struct {
	dirs []string
}

// pseudoFS are the kernel's file systems: their files are the host's
// processes, devices and settings, never a pipeline's data.
var pseudoFS = []string{"/proc", "/sys", "/dev"}

// NewRoots checks and resolves dirs (duplicates are dropped).
func NewRoots(dirs ...string) (*Roots, error) {
	if len(dirs) == 0 {
		return nil, errors.New("roots: no directory given")
	}
	r := &Roots{}
	for _, d := range dirs {
		if d == "" {
			return nil, errors.New("roots: an empty directory name")
		}
		abs, err := filepath.Abs(d)
		if err != nil {
			return nil, fmt.Errorf("root %q: %w", d, err)
		}
		real, ok := resolveLinks(abs)
		if !ok {
			return nil, fmt.Errorf("root %q: symbolic links that cannot be resolved", d)
		}
		if real == "/" {
			return nil, fmt.Errorf("root %q: the whole file system cannot be a root; name the directories that hold your pipelines, data and checkpoints", d)
		}
		for _, p := range pseudoFS {
			if within(real, p) {
				return nil, fmt.Errorf("root %q: %s holds the host's processes, devices and settings, not pipeline files", d, p)
			}
		}
		st, err := os.Stat(real)
		if err != nil {
			return nil, fmt.Errorf("root %q: %w", d, err)
		}
		if !st.IsDir() {
			return nil, fmt.Errorf("root %q: not a directory", d)
		}
		if !slices.Contains(r.dirs, real) {
			r.dirs = append(r.dirs, real)
		}
	}
	return r, nil
}

// Dirs returns the roots, resolved, in the order given.
func (r *Roots) Dirs() []string {
	if r == nil {
		return nil
	}
	return append([]string(nil), r.dirs...)
}

// String lists the roots as a --roots value would.
func (r *Roots) String() string {
	if r == nil {
		return "(unconfined)"
	}
	return strings.Join(r.dirs, string(os.PathListSeparator))
}

// Resolve returns the absolute path p names, its symbolic links resolved,
// and refuses it unless it lies inside a root. A relative p is relative to
// base, the pipeline's base_dir ("" is the worker's working directory),
// which must then lie inside a root itself; "" names base. field names p in
// errors: "spec_path", "with.output", ... A path that does not exist yet is
// allowed when it would be created inside a root: what exists of it is
// resolved, and the rest may not climb out with "..". Callers use the path
// returned, not p.
func (r *Roots) Resolve(field, base, p string) (string, error) {
	return r.resolveFrom(field, p, "base_dir", base)
}

// resolveFrom is Resolve with the base named baseField in errors.
func (r *Roots) resolveFrom(field, p, baseField, base string) (string, error) {
	if r == nil {
		return resolvePath(base, p), nil
	}
	if p == "" || !filepath.IsAbs(p) {
		if base == "" {
			wd, err := os.Getwd()
			if err != nil {
				return "", fmt.Errorf("%s: %q: the working directory: %w", field, p, err)
			}
			base = wd
		} else if !filepath.IsAbs(base) {
			return "", fmt.Errorf("%s: %q: %s %q is not an absolute path", field, p, baseField, base)
		}
		if _, ok := r.inside(base); !ok {
			return "", fmt.Errorf("%s: %s %q resolves outside %s", field, baseField, base, r.where())
		}
	}
	target := p
	if !filepath.IsAbs(p) {
		target = filepath.Join(base, p)
	}
	if real, ok := r.inside(filepath.Clean(target)); ok {
		return real, nil
	}
	if filepath.IsAbs(p) {
		return "", fmt.Errorf("%s: %q resolves outside %s", field, p, r.where())
	}
	return "", fmt.Errorf("%s: %q (relative to %s %q) resolves outside %s", field, p, baseField, base, r.where())
}

// where names the roots in a refusal.
func (r *Roots) where() string {
	return fmt.Sprintf("this worker's roots (%s): every path a pipeline names must lie inside them, symbolic links followed (rlflow worker --roots)",
		strings.Join(r.dirs, ", "))
}

// inside resolves the clean absolute path p and reports whether the result
// lies inside a root.
func (r *Roots) inside(p string) (string, bool) {
	real, ok := resolveLinks(p)
	if !ok {
		return "", false
	}
	return real, r.contains(real)
}

func (r *Roots) contains(p string) bool {
	for _, d := range r.dirs {
		if within(p, d) {
			return true
		}
	}
	return false
}

// within reports whether the clean absolute path p is dir or below it.
func within(p, dir string) bool {
	return p == dir || strings.HasPrefix(p, dir+string(filepath.Separator))
}

// maxLinks bounds the symbolic links one resolution follows (Linux stops
// at 40; a loop never ends).
const maxLinks = 255

// resolveLinks returns the clean absolute path p with every symbolic link
// followed, component by component as the kernel does: ".." after a link
// climbs from the link's target. Past the first component that does not
// exist (or cannot be read) nothing can be a link, so the rest is appended
// as written, unless it climbs with "..", which the kernel would refuse
// through a missing directory and which could climb back into a link: that,
// a dangling or looping chain of links, is reported as !ok. A dangling link
// is followed to its target, so a file created through it is checked where
// it would land.
func resolveLinks(p string) (string, bool) {
	rest := strings.Split(p, string(filepath.Separator))
	dest := string(filepath.Separator)
	links := 0
	for len(rest) > 0 {
		c := rest[0]
		rest = rest[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			dest = filepath.Dir(dest)
			continue
		}
		next := filepath.Join(dest, c)
		fi, err := os.Lstat(next)
		if err != nil {
			for _, x := range rest {
				if x == ".." {
					return "", false
				}
			}
			return filepath.Join(append([]string{next}, rest...)...), true
		}
		if fi.Mode()&os.ModeSymlink == 0 {
			dest = next
			continue
		}
		if links++; links > maxLinks {
			return "", false
		}
		target, err := os.Readlink(next)
		if err != nil {
			return "", false
		}
		if filepath.IsAbs(target) {
			dest = string(filepath.Separator)
		}
		rest = append(strings.Split(target, string(filepath.Separator)), rest...)
	}
	return dest, true
}

// openRegular opens a file for reading only if it is a regular file: a FIFO
// would block the read until a writer comes, a device may never end. The
// open does not wait for a FIFO's writer, and the opened file is checked
// again, closing the race with a path replaced in between.
func openRegular(path string) (*os.File, error) {
	if st, err := os.Stat(path); err != nil {
		return nil, err
	} else if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: %s, not a regular file", path, fileKind(st.Mode()))
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if !st.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%s: %s, not a regular file", path, fileKind(st.Mode()))
	}
	return f, nil
}

func fileKind(m os.FileMode) string {
	switch {
	case m.IsDir():
		return "a directory"
	case m&os.ModeNamedPipe != 0:
		return "a named pipe (FIFO)"
	case m&os.ModeSocket != 0:
		return "a socket"
	case m&os.ModeCharDevice != 0:
		return "a character device"
	case m&os.ModeDevice != 0:
		return "a block device"
	}
	return "not a regular file"
}

// resolvePath resolves p against the pipeline's base directory; "" gives
// the base itself. It neither follows links nor confines: Roots does.
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

// safeName makes an id usable as one path element that stays where it is
// put: a leading dot becomes "_", so "." and ".." (a workflow id is anyone's
// choice) never climb, and no id hides its files or meets the worker's own
// dot-directories.
func safeName(s string) string {
	if s == "" {
		return "_"
	}
	s = unsafeChars.ReplaceAllString(s, "_")
	if strings.HasPrefix(s, ".") {
		s = "_" + s[1:]
	}
	return s
}

// stepDir is the step's own directory under root:
// <root>/<run>/iter-<n>/<step>, every element made safe.
func stepDir(root string, sc pipelines.StepContext) string {
	return filepath.Join(root, safeName(sc.RunID), fmt.Sprintf("iter-%d", sc.Iteration), safeName(sc.StepID))
}
