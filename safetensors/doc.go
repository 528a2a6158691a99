// Package safetensors reads and writes the safetensors checkpoint format
// (https://github.com/huggingface/safetensors) without copying tensor bytes.
//
// Invariants:
//
//   - A *File is only ever returned for a file whose whole header was
//     validated: the 8-byte little-endian header length is at most
//     MaxHeaderSize and lies within the file, the header is a UTF-8 JSON
//     object without duplicate keys, "__metadata__" (optional) maps strings to
//     strings, every other entry has exactly dtype, shape and data_offsets,
//     the dtype is known, dimensions are non-negative, prod(shape)*itemsize
//     equals end-begin (prod([]) = 1) with overflow-checked arithmetic, and
//     the tensors tile the data area exactly: no overlap, no gap, no trailing
//     bytes (the reference implementation requires this contiguity).
//   - Tensors are reported in data-offset order (ties, possible only between
//     zero-size tensors, broken by end offset then name), so two reads of the
//     same file always yield the same order.
//   - TensorInfo.Offset is absolute within the file (header included), so it
//     can be used directly with pread, O_DIRECT or cudaHostRegister ranges.
//   - Bytes returns slices that alias a read-only mapping: they must not be
//     written to and must not be used after Close.
//   - Write never leaves a partial file at the destination: it writes a
//     temporary file in the same directory, syncs it and renames it.
//
// The package never logs; every error names the file and, where there is
// one, the tensor.
package safetensors
