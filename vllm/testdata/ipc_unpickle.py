"""Reads an ipc_handles_pickled value (base64 on stdin) as vLLM's worker
would, without torch, and prints JSON of what it found (ipc_python_test.go).

The Unpickler's find_class maps the globals the ipc contract allows to
stand-ins in fake torch modules and refuses any other. The output:

  handles: one {uuid: {"func": "module.name", "args": [...]}} per tensor,
           args as JSON: a global as {"global": "module.name"}, bytes as
           {"bytes": base64}, torch.Size as {"size": [dims]}, tuples as lists;
  opcodes: the sorted opcode names (pickletools) of the input;
  repickled_hex: pickle.dumps of what was read, protocol 3 with the memo
           off (fast mode), through the same stand-ins: CPython's spelling
           of the same objects.
"""

import base64
import io
import json
import pickle
import pickletools
import sys
import types


def fake_module(name):
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    return mod


# The stand-ins live in fake modules under their real names, so pickling
# them again writes the same globals. Nothing imports the real torch.
for _name in ("torch", "torch.storage", "torch.multiprocessing", "torch.multiprocessing.reductions"):
    fake_module(_name)


def _named(cls, module, name):
    cls.__module__, cls.__name__, cls.__qualname__ = module, name, name
    return cls


Tensor = _named(type("Tensor", (), {}), "torch", "Tensor")
TypedStorage = _named(type("TypedStorage", (), {}), "torch.storage", "TypedStorage")


class Size(tuple):
    def __reduce__(self):
        return (Size, (tuple(self),))


_named(Size, "torch", "Size")


def rebuild_cuda_tensor(*args):
    raise AssertionError("the receiver calls this, the test does not")


rebuild_cuda_tensor.__module__ = "torch.multiprocessing.reductions"


class DType:
    """torch.dtype: pickled by name, as a global of module torch."""

    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return self.name


DType.__module__ = "torch"

DTYPES = ["bfloat16", "float16", "float32", "float64", "int8", "uint8", "int16",
          "int32", "int64", "bool", "float8_e4m3fn", "float8_e5m2"]

ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): rebuild_cuda_tensor,
    ("torch", "Tensor"): Tensor,
    ("torch", "Size"): Size,
    ("torch.storage", "TypedStorage"): TypedStorage,
}
for _name in DTYPES:
    ALLOWED[("torch", _name)] = DType(_name)
for (_module, _name), _obj in ALLOWED.items():
    setattr(sys.modules[_module], _name, _obj)


class Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed") from None


def name_of(obj):
    if isinstance(obj, DType):
        return "torch." + obj.name
    return obj.__module__ + "." + obj.__qualname__


def as_json(obj):
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, bytes):
        return {"bytes": base64.b64encode(obj).decode()}
    if isinstance(obj, Size):
        return {"size": list(obj)}
    if isinstance(obj, tuple):
        return [as_json(x) for x in obj]
    if any(obj is allowed for allowed in ALLOWED.values()):
        return {"global": name_of(obj)}
    raise TypeError(f"unexpected {type(obj).__name__} in the pickle")


def main():
    raw = base64.b64decode(sys.stdin.read().strip(), validate=True)
    handles = Unpickler(io.BytesIO(raw)).load()
    if type(handles) is not list:
        raise TypeError(f"top level is {type(handles).__name__}, want list")
    out = []
    for handle in handles:
        if type(handle) is not dict:
            raise TypeError(f"handle is {type(handle).__name__}, want dict")
        entry = {}
        for uuid, value in handle.items():
            func, args = value
            entry[uuid] = {"func": name_of(func), "args": as_json(args)}
        out.append(entry)
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=3)
    pickler.fast = True  # no memo: the Go writer writes none
    pickler.dump(handles)
    print(json.dumps({
        "handles": out,
        "opcodes": sorted({op.name for op, _, _ in pickletools.genops(raw)}),
        "repickled_hex": buf.getvalue().hex(),
    }))


if __name__ == "__main__":
    main()
