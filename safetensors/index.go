package safetensors

import "slices"

// tensorIndex is a list of tensors in a fixed order (a file's data-offset
// order, or a checkpoint's file by file) with a lookup by name. It is
// built once and never changes, so File and Checkpoint, which embed it,
// share it between goroutines freely.
type tensorIndex struct {
	tensors []TensorInfo
	byName  map[string]int
}

func newTensorIndex(capacity int) tensorIndex {
	return tensorIndex{tensors: make([]TensorInfo, 0, capacity), byName: make(map[string]int, capacity)}
}

// add appends t; the caller has checked its name is new.
func (x *tensorIndex) add(t TensorInfo) {
	x.byName[t.Name] = len(x.tensors)
	x.tensors = append(x.tensors, t)
}

// Tensors lists every tensor in order. The result is a copy.
func (x *tensorIndex) Tensors() []TensorInfo {
	out := make([]TensorInfo, len(x.tensors))
	for i, t := range x.tensors {
		t.Shape = slices.Clone(t.Shape)
		out[i] = t
	}
	return out
}

// Tensor looks a tensor up by name. The result is a copy.
func (x *tensorIndex) Tensor(name string) (TensorInfo, bool) {
	i, ok := x.byName[name]
	if !ok {
		return TensorInfo{}, false
	}
	t := x.tensors[i]
	t.Shape = slices.Clone(t.Shape)
	return t, true
}
