#!/usr/bin/env python3
"""Writes the ipc_handles_pickled fixtures of the vLLM double's pickle reader.

Run from this directory: python3 make_ipc_pickles.py (no torch needed).

vLLM's ipc backend sends `pickle.dumps(ipc_handles)`: a list with one
{gpu_uuid: (rebuild_cuda_tensor, args)} dict per tensor, args being the
15-tuple torch's reduce_tensor builds for a CUDA tensor. This script builds
the same objects from stand-ins whose __module__ and __qualname__ are
torch's, registered in sys.modules under torch's module names, so pickle
writes exactly the GLOBAL / STACK_GLOBAL opcodes real torch objects produce:

* classes and functions pickle by reference (module + qualname), as
  torch._tensor.Tensor, torch.storage.TypedStorage and
  torch.multiprocessing.reductions.rebuild_cuda_tensor do;
* torch.Size is a tuple subclass whose __reduce__ is (Size, (tuple(self),));
* a torch dtype's __reduce__ returns its attribute name, so pickle writes
  the global torch.<name> (pickle checks that torch.<name> is the object).

For each fixture it writes NAME_p3.pkl, NAME_p4.pkl and NAME_p5.pkl
(pickle protocols 3, 4 and 5 of the same object) and NAME.json, the values
the Go reader must decode them to (field names of double.IPCHandle's
entries; bytes as standard base64, as Go's encoding/json writes []byte).
"""

import base64
import json
import pickle
import sys
import types


def _module(name):
    m = types.ModuleType(name)
    sys.modules[name] = m
    return m


torch = _module("torch")
torch_tensor = _module("torch._tensor")
torch_storage = _module("torch.storage")
_module("torch.multiprocessing")
reductions = _module("torch.multiprocessing.reductions")


class Tensor:  # torch.Tensor lives in torch._tensor
    pass


Tensor.__module__ = "torch._tensor"
torch_tensor.Tensor = Tensor
torch.Tensor = Tensor


class TypedStorage:
    pass


TypedStorage.__module__ = "torch.storage"
torch_storage.TypedStorage = TypedStorage


class Size(tuple):
    def __reduce__(self):
        return (Size, (tuple(self),))


Size.__module__ = "torch"
torch.Size = Size


class dtype:
    def __init__(self, name, itemsize):
        self.name = name
        self.itemsize = itemsize

    def __reduce__(self):
        return self.name


dtype.__module__ = "torch"
DTYPES = {}
for _name, _size in [("float32", 4), ("bfloat16", 2), ("float16", 2), ("int64", 8)]:
    _d = dtype(_name, _size)
    _d.__module__ = "torch"  # pickle's whichmodule reads the object's __module__
    setattr(torch, _name, _d)
    DTYPES[_name] = _d


def rebuild_cuda_tensor(*args):
    raise RuntimeError("a stand-in: never called")


rebuild_cuda_tensor.__module__ = "torch.multiprocessing.reductions"
reductions.rebuild_cuda_tensor = rebuild_cuda_tensor

UUID_A = "0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
UUID_B = "ffffffff-0000-1111-2222-333344445555"
HANDLE = b"\x01c" + bytes(range(64))  # torch's: a version byte, 'c', the 64-byte cudaIpcMemHandle_t
REF_COUNTER = b"/torch_4242_1234567890_0"
EVENT = bytes(range(100, 164))
STORAGE_BYTES = 3 << 30  # past int32: LONG1
STORAGE_OFFSET = 1 << 20  # BININT


def contiguous_stride(shape):
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def args(shape, dtype_name, offset_elems, device, ref_offset, event=None, sync=False,
         storage_bytes=STORAGE_BYTES, storage_offset=STORAGE_OFFSET):
    """reduce_tensor's args for a contiguous CUDA tensor of the snapshot storage."""
    return (
        Tensor,
        Size(shape),
        contiguous_stride(shape),
        offset_elems,
        TypedStorage,
        DTYPES[dtype_name],
        device,
        bytes(bytearray(HANDLE)),  # a new object per tensor, as each _share_cuda_() call gives
        storage_bytes,
        storage_offset,
        False,
        bytes(bytearray(REF_COUNTER)),
        ref_offset,
        event,
        sync,
    )


def expected(handle):
    """One tensor's dict as the Go reader's result (double.IPCHandle)."""
    out = []
    for uuid, (func, a) in handle.items():
        b64 = lambda b: None if b is None else base64.b64encode(b).decode()
        out.append({
            "UUID": uuid,
            "Rebuild": {
                "Func": func.__module__ + "." + func.__qualname__,
                "TensorClass": a[0].__module__ + "." + a[0].__qualname__,
                "Size": list(a[1]),
                "Stride": list(a[2]),
                "TensorOffset": a[3],
                "StorageClass": a[4].__module__ + "." + a[4].__qualname__,
                "DType": a[5].name,
                "Device": a[6],
                "StorageHandle": b64(a[7]),
                "StorageBytes": a[8],
                "StorageOffset": a[9],
                "RequiresGrad": a[10],
                "RefCounterHandle": b64(a[11]),
                "RefCounterOffset": a[12],
                "EventHandle": b64(a[13]),
                "EventSyncRequired": a[14],
            },
        })
    return out


def fixtures():
    four = [
        # A 2-dim float32 tensor at the storage's start.
        {UUID_A: (rebuild_cuda_tensor, args((128, 128), "float32", 0, 1, 0))},
        # A scalar: torch.Size(()), stride (), with an event to wait on.
        {UUID_A: (rebuild_cuda_tensor, args((), "bfloat16", 32768, 1, 1, bytes(bytearray(EVENT)), True))},
        # A 4-dim tensor (TUPLE with MARK), offered for two GPUs (SETITEMS).
        {
            UUID_A: (rebuild_cuda_tensor, args((2, 3, 4, 5), "float16", 70000, 1, 2)),
            UUID_B: (rebuild_cuda_tensor, args((2, 3, 4, 5), "float16", 70000, 3, 3)),
        },
        # An empty tensor.
        {UUID_A: (rebuild_cuda_tensor, args((0,), "int64", 0, 1, 4))},
    ]
    # One tensor filling its storage (APPEND, SETITEM): a bigram table the
    # double's HTTP tests load.
    one = [{UUID_A: (rebuild_cuda_tensor, args((128, 128), "float32", 0, 0, 0,
                                               storage_bytes=128 * 128 * 4, storage_offset=0))}]
    return {"ipc_four": four, "ipc_one": one}


def main():
    for name, handles in fixtures().items():
        for proto in (3, 4, 5):
            with open(f"{name}_p{proto}.pkl", "wb") as f:
                f.write(pickle.dumps(handles, protocol=proto))
        with open(f"{name}.json", "w") as f:
            json.dump([expected(h) for h in handles], f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
