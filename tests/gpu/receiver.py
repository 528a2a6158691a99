#!/usr/bin/env python3
"""A receiver that behaves like a vLLM worker, for rlflow's GPU tests.

It takes the part of a vLLM worker in a weight transfer (spec
docs/vllm-weight-transfer.md, sections 2, 3 and 6) using only the real
PyTorch and NCCL pieces a vLLM worker uses:

1. torch.distributed.TCPStore client (is_master=False, use_libuv=False,
   timeout 300 s) against the trainer's store at --host:--port;
2. pickle.loads of "broadcast_from/0/0" with a shim module at
   vllm/distributed/device_communicators/pynccl_wrapper.py defining the
   ctypes ncclUniqueId (created in a temporary directory on sys.path);
3. NCCL through ctypes on libnccl.so.2: ncclCommInitRank, the one-element
   float32 SUM all-reduce and a stream sync (the warm-up), then one
   ncclBroadcast per tensor (non-packed) or per chunk (packed), following
   the packing rule implemented here independently of the Go planner;
4. a byte-for-byte comparison of every received tensor with the
   safetensors checkpoint.

The metadata (names, dtype_names, shapes, packed, packed_buffer_size_bytes,
checkpoint) comes from a JSON file (--meta), as update_info would.

Output: progress and diagnostics on stderr; on stdout one line per event,
"READY {json}" once the communicator and its warm-up are done (what
/init_weight_transfer_engine waits for), "PROGRESS {json}" (with --progress)
and finally "RESULT {json}" whose
"verdict" is PASS or FAIL. Exit status: 0 PASS, 1 FAIL (wrong bytes),
2 error, 4 watchdog (--deadline passed).

Raw mode (--raw-bytes N --repeat R) receives R broadcasts of N uint8 bytes
into one buffer (the trainer fills it with i % 251) and checks the last one:
the pure broadcast throughput figure.

--self-test checks the packing rule and the pickle shim, --plan-only prints the
wire sequence it would expect for --meta; neither needs torch or a GPU.
--unpack-check FILE views packed layouts as vLLM's packed consumer does, on
the CPU (torch, no GPU), and prints which tensors torch refuses (UNPACK
{json}): the ground truth for rlflow's refusal of packed checkpoints vLLM
cannot unpack (a 0-dim tensor, an offset not a multiple of the item size).

Non-packed broadcasts use vLLM's NCCL type per dtype (NCCL_DTYPES), among
them float8_e4m3fn as ncclFloat8e4m3 (10, NCCL >= 2.24); a dtype vLLM does
not map is refused with a 500, as vLLM's from_torch raises.

HTTP mode (--http PORT --api C|D|E) is a vLLM-like server front instead of a
one-shot receiver: it serves the dev-mode weight-transfer routes rlflow's
GPU worker calls (GET /get_world_size, POST /init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update, GET
/weight_info), with vLLM's strict payload keys for the generation (an
unknown key is a 500) and its session rules, and does the worker's real
part for each: the TCPStore rendezvous and NCCL init + warm-up on init, the
broadcasts on update_weights (planned from update_info and, on D, the
packed settings of init_info). It keeps the SHA-256 of every tensor of the
last update, served at GET /received for the test to compare with the
checkpoint, and POST /fail_next_update (test control, not vLLM) makes the
next update_weights answer 500 before receiving anything, as a vLLM worker
that rejects the metadata does. It prints "READY {json}" once listening.
One rank per server (world size 1).

Generation E (--api E, vLLM >= 0.30, spec section 8): payloads as D, and
init_info may carry nccl_unique_id_b64 (standard base64 of the 128 id
bytes) instead of master_address/master_port: the communicator is then
built from those bytes, no TCPStore, no pickle; both or neither is a 500
ValueError. Its module tree is the vllm.backends layout, so a pickled id
naming either module loads. The router answers 400 for invalid JSON, a
non-object body, a missing or non-object init_info and an update_info
neither an object nor a list of objects (a list holds one payload per
inference worker: here exactly one); worker errors stay 500, and a failed
update_weights (500) closes the update session, so a following
finish_weight_update answers 500 "... without a matching
start_weight_update". GET /version answers 0.30.0 (C and D serve no
/version) and POST /update_weight_version sets the weight version. GET
/received names, per init, how the id arrived (rendezvous: tcpstore or
unique_id) and the module and size of the pickle the TCPStore held.

It also serves vLLM's generation control, POST /pause?mode=abort|wait|keep
({"status": "paused"}), POST /resume ({"status": "resumed"}) and GET
/is_paused ({"is_paused": bool}); there is no generation, only the state.
With --vllm-unpack every packed chunk is also unpacked as vLLM does (split,
view(dtype), view(*shape)), so a layout vLLM cannot view fails the update
here as it would there. The stats of GET /received name the NCCL type of
every tensor's broadcast (nccl_types). GET /received also holds, for recovery tests: the receive progress of the
running update (chunks and bytes arrived, without a sync), the SHA-256s and
weight version (named by finish_weight_update) of every completed update
and whether it ran paused, every failed update_weights (error, time, chunks
arrived), every init, the pause/resume call counts and an event log. An
update_weights whose trainer dies fails with a 500 as soon as NCCL reports
the lost peer, at the latest after --update-deadline, and aborts the
communicator; the next /init_weight_transfer_engine builds a new one.
--chunk-delay (test control) slows each update down between chunks so that
a test can act in its middle.

--backend ipc (with --http PORT --api E only; default nccl) serves vLLM's
`ipc` weight-transfer backend instead (vllm/distributed/weight_transfer/
ipc_engine.py): no NCCL library is loaded and nothing is rendezvoused.
init_info must be {} (an unknown key is a 500, the dataclass's TypeError);
update_info carries names, dtype_names, shapes and ipc_handles_pickled
(standard base64 of the pickled list of {gpu_uuid: (func, args)}), checked
as IPCWeightTransferUpdateInfo.__post_init__ does, with its messages (the
pickle is only loaded when this process's environment has
VLLM_ALLOW_INSECURE_SERIALIZATION=1, as in vLLM). Each tensor is rebuilt as
IPCWeightTransferEngine.receive_weights does it (this GPU's UUID picks the
handle, args[6] becomes the current device index, func(*args)), then,
stricter than vLLM, func must be torch's rebuild_cuda_tensor and the
rebuilt tensor must have the dtype, shape and device update_info names;
every tensor is copied into this receiver's own tensor for its name (as
vLLM's load_weights copies into the model), the device is synchronized and
every rebuilt tensor is dropped before update_weights answers, so torch's
ref counting releases the producer's shares. The SHA-256s of GET /received
are those of the receiver's own copies, as for nccl; its stats name the
backend, the GPU UUID, the globals the pickle named and how many opened
IPC storages are still alive in torch's shared cache after the drop (0).
"""

import argparse
import base64
import binascii
import ctypes
import datetime
import glob
import io
import json
import os
import pickle
import sys
import tempfile
import threading
import time

# The NCCL type of each dtype a non-packed broadcast carries, as vLLM's
# ncclDataTypeEnum.from_torch maps them (float8_e4m3fn is ncclFloat8e4m3,
# NCCL >= 2.24); packed chunks are ncclUint8 whatever their dtypes.
NCCL_DTYPES = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4,
    "uint64": 5, "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
    "float8_e4m3fn": 10,
}
ITEMSIZE = {
    "int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8,
    "uint64": 8, "float16": 2, "float32": 4, "float64": 8, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e8m0fnu": 1, "bool": 1,
    "int16": 2, "uint16": 2,
}
NCCL_UINT8, NCCL_FLOAT32, NCCL_SUM = 1, 7, 0

SHIM = '''"""Test shim: the ctypes ncclUniqueId at vLLM's dotted path."""
import ctypes


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]
'''


def log(*args):
    print("receiver:", *args, file=sys.stderr, flush=True)


def emit(kind, **fields):
    print(kind, json.dumps(fields, sort_keys=True), flush=True)


# The pickled ncclUniqueId names one of these modules (spec section 8): C
# and D have only the legacy one; generation E's vllm.backends layout keeps
# the class in the backends module and resolves the legacy name through a
# compatibility shim.
LEGACY_MODULE = "vllm.distributed.device_communicators.pynccl_wrapper"
BACKENDS_MODULE = "vllm.backends.distributed.device_communicators.pynccl_wrapper"
COMPAT_SHIM = '''"""Test shim: the legacy module of the vllm.backends layout, re-exporting the class."""
from vllm.backends.distributed.device_communicators.pynccl_wrapper import ncclUniqueId  # noqa: F401
'''
UNIQUE_ID_BYTES = 128
_shim_roots = []  # sys.path entries of the installed shims


def install_shim(backends=False):
    """Create a vllm module tree defining the ctypes ncclUniqueId in a
    temporary directory, put it first on sys.path and import the class's
    module. Default (C, D): only LEGACY_MODULE. backends (E): the class in
    BACKENDS_MODULE and LEGACY_MODULE a compat shim re-exporting it, so a
    pickle naming either module loads as the same class. A shim installed
    before is forgotten first (the self-test installs both layouts)."""
    import importlib
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    while _shim_roots:
        sys.path.remove(_shim_roots.pop())
    root = tempfile.mkdtemp(prefix="rlflow-vllm-shim-")

    def write(module, text):
        d = root
        for part in module.split(".")[:-1]:
            d = os.path.join(d, part)
            os.makedirs(d, exist_ok=True)
            open(os.path.join(d, "__init__.py"), "a").close()
        with open(os.path.join(d, module.split(".")[-1] + ".py"), "w") as f:
            f.write(text)
    if backends:
        write(BACKENDS_MODULE, SHIM)
        write(LEGACY_MODULE, COMPAT_SHIM)
    else:
        write(LEGACY_MODULE, SHIM)
    sys.path.insert(0, root)
    _shim_roots.append(root)
    importlib.invalidate_caches()
    return importlib.import_module(BACKENDS_MODULE if backends else LEGACY_MODULE)


def unpickle_unique_id(raw, cls):
    """pickle.loads of the store's value as a vLLM worker does it, also
    returning the module the pickle named for the class: every global a
    pickle names is resolved through Unpickler.find_class, which records it
    here. An unknown module fails as in vLLM (ModuleNotFoundError)."""
    named = []

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            if name == "ncclUniqueId":
                named.append(module)
            return super().find_class(module, name)
    uid = Recorder(io.BytesIO(raw)).load()
    if not isinstance(uid, cls):
        raise RuntimeError("unpickled %r, not the shim's ncclUniqueId" % type(uid))
    return uid, (named[0] if named else None)


def unique_id_source(info):
    """Generation E: how init_info gives the worker the NCCL unique id:
    ("unique_id", the 128 bytes of nccl_unique_id_b64, standard base64) or
    ("tcpstore", (master_address, master_port)). Exactly one way must be
    given; both or neither is a ValueError, which the worker raises (a 500),
    as does an id that is not the base64 of 128 bytes."""
    b64 = info.get("nccl_unique_id_b64")
    addr, port = info.get("master_address"), info.get("master_port")
    if b64 is not None and (addr or port):
        raise ValueError("pass either nccl_unique_id_b64 or master_address/master_port, not both")
    if b64 is None:
        if not addr or not port:
            raise ValueError("master_address and master_port are required (or nccl_unique_id_b64)")
        return "tcpstore", (addr, int(port))
    if not isinstance(b64, str):
        raise ValueError("nccl_unique_id_b64 must be a string, got %s" % type(b64).__name__)
    try:
        raw = base64.b64decode(b64, validate=True)
    except binascii.Error as e:
        raise ValueError("nccl_unique_id_b64 is not standard base64: %s" % e)
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError("nccl_unique_id_b64 holds %d bytes, want %d" % (len(raw), UNIQUE_ID_BYTES))
    return "unique_id", raw


def numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def plan_chunks(sizes, packed, threshold):
    """The wire sequence as lists of tensor indices (spec section 6).

    Non-packed: one broadcast per tensor. Packed: append each tensor to the
    current chunk and add its size to the running total S; after appending,
    if S > T (strict) the chunk is closed, the crossing tensor inside it. The
    remainder is the last chunk."""
    if not packed:
        return [[i] for i in range(len(sizes))]
    chunks, cur, total = [], [], 0
    for i, size in enumerate(sizes):
        cur.append(i)
        total += size
        if total > threshold:
            chunks.append(cur)
            cur, total = [], 0
    if cur:
        chunks.append(cur)
    return chunks


def vllm_view(torch, piece, dtype, shape):
    """vLLM's packed consumer's view of one piece of a received uint8 chunk
    (a piece of chunk.split(sizes)): .contiguous().view(dtype).view(*shape).
    torch raises for a 0-dim shape (view() with no sizes) and for a piece
    whose byte offset is not a multiple of the dtype's item size."""
    return piece.contiguous().view(getattr(torch, dtype)).view(*[int(n) for n in shape])


def vllm_unpack(torch, chunk, names, dtypes, shapes, sizes):
    """One received chunk unpacked as vLLM does; name -> flat uint8 view."""
    return {name: vllm_view(torch, piece, d, shape).reshape(-1).view(torch.uint8)
            for name, d, shape, piece in zip(names, dtypes, shapes, chunk.split(sizes))}


def unpack_check(path):
    """--unpack-check FILE: for every case of FILE ({"cases": [{"names",
    "dtype_names", "shapes"}]}, each case one packed chunk) view every tensor
    as vLLM does, on the CPU, and report the ones torch refuses with its
    message: the ground truth for rlflow's CheckPackedReceivable. A case with
    a dtype this torch lacks gets no verdict (missing_dtypes)."""
    import torch
    with open(path) as f:
        cases = json.load(f)["cases"]
    results = []
    for c in cases:
        names, dtypes, shapes = c["names"], c["dtype_names"], c["shapes"]
        missing = sorted(set(d for d in dtypes if not hasattr(torch, d)))
        if missing:  # an older torch (no float8_e4m3fn before 2.1): no verdict
            results.append({"refused": {}, "missing_dtypes": missing})
            continue
        sizes = [numel(sh) * ITEMSIZE[d] for sh, d in zip(shapes, dtypes)]
        pieces = torch.zeros(sum(sizes), dtype=torch.uint8).split(sizes)
        refused = {}
        for name, d, shape, piece in zip(names, dtypes, shapes, pieces):
            try:
                vllm_view(torch, piece, d, shape)
            except Exception as e:  # TypeError (0-dim), RuntimeError (offset)
                refused[name] = "%s: %s" % (type(e).__name__, str(e).splitlines()[0])
        results.append({"refused": refused})
    emit("UNPACK", torch=torch.__version__, results=results)
    return 0


class Nccl:
    """The few NCCL entry points a vLLM worker calls, through ctypes."""

    def __init__(self, path, uid_type):
        self.lib = ctypes.CDLL(path)
        L = self.lib
        L.ncclGetErrorString.restype = ctypes.c_char_p
        L.ncclGetErrorString.argtypes = [ctypes.c_int]
        L.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        # The unique id is passed by value, as in vLLM's pynccl_wrapper.
        L.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, uid_type, ctypes.c_int]
        coll = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                ctypes.c_void_p, ctypes.c_void_p]
        L.ncclAllReduce.argtypes = coll
        L.ncclBroadcast.argtypes = coll
        L.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        L.ncclCommAbort.argtypes = [ctypes.c_void_p]
        L.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]

    def check(self, r, what):
        if r != 0:
            raise RuntimeError("%s: %s (ncclResult %d)" % (what, self.lib.ncclGetErrorString(r).decode(), r))

    def version(self):
        v = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        return v.value

    def init_rank(self, world, uid, rank):
        comm = ctypes.c_void_p()
        self.check(self.lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank), "ncclCommInitRank")
        return comm

    def all_reduce(self, ptr, count, dtype, comm, stream):
        self.check(self.lib.ncclAllReduce(ptr, ptr, count, dtype, NCCL_SUM, comm, stream), "ncclAllReduce")

    def broadcast(self, ptr, count, dtype, comm, stream):
        self.check(self.lib.ncclBroadcast(ptr, ptr, count, dtype, 0, comm, stream), "ncclBroadcast")

    def async_error(self, comm):
        r = ctypes.c_int()
        self.check(self.lib.ncclCommGetAsyncError(comm, ctypes.byref(r)), "ncclCommGetAsyncError")
        return r.value

    def wait(self, work, comm, deadline, on_poll=None):
        """Wait for work (a CUDA stream or event) while watching the
        communicator, so that a trainer that died or aborted (its sockets
        closed) ends the wait with an error instead of a hang; the caller
        then aborts the communicator. on_poll runs on every poll (progress)."""
        NCCL_IN_PROGRESS = 7
        while not work.query():
            if on_poll is not None:
                on_poll()
            r = self.async_error(comm)
            if r not in (0, NCCL_IN_PROGRESS):
                raise RuntimeError("NCCL error while receiving: %s (ncclResult %d)" % (self.lib.ncclGetErrorString(r).decode(), r))
            if time.monotonic() > deadline:
                raise RuntimeError("receive did not complete before its deadline")
            time.sleep(0.001)
        if on_poll is not None:
            on_poll()


def self_test():
    assert plan_chunks([4, 4, 4], False, 5) == [[0], [1], [2]]
    # S > T is strict: exactly T does not close the chunk.
    assert plan_chunks([5, 1, 10, 2, 2], True, 5) == [[0, 1], [2], [3, 4]]
    assert plan_chunks([3, 3, 3], True, 6) == [[0, 1, 2]]
    assert plan_chunks([7], True, 6) == [[0]]
    assert plan_chunks([], True, 6) == []
    # vLLM's from_torch: float8_e4m3fn is ncclFloat8e4m3; e5m2 has no mapping.
    assert NCCL_DTYPES["float8_e4m3fn"] == 10 and ITEMSIZE["float8_e4m3fn"] == 1
    assert "float8_e5m2" not in NCCL_DTYPES and ITEMSIZE["float8_e5m2"] == 1
    mod = install_shim()
    uid = mod.ncclUniqueId()
    for i in range(128):
        uid.internal[i] = (i * 7 + 1) % 256 - 128
    raw = pickle.dumps(uid, protocol=4)
    assert len(raw) == 247, len(raw)
    back = pickle.loads(raw)
    assert type(back).__module__ == "vllm.distributed.device_communicators.pynccl_wrapper"
    assert bytes(back.internal) == bytes(uid.internal)
    # --http's generation control and report, without torch.
    w = bare_worker("D")
    assert w.is_paused() == {"is_paused": False}
    assert w.pause({}, {"mode": ["keep"]}) == {"status": "paused"}
    assert w.pause({}, {}) == {"status": "paused"}  # mode defaults to abort
    assert w.is_paused() == {"is_paused": True}
    try:
        w.pause({}, {"mode": ["later"]})
        raise AssertionError("pause accepted mode=later")
    except HTTPFailure as e:
        assert e.code == 422, e.code
    assert w.resume({}) == {"status": "resumed"}
    rep = w.report()
    assert (rep["paused"], rep["pause_calls"], rep["resume_calls"]) == (False, 2, 1), rep
    assert [e["what"] for e in rep["events"]] == ["pause keep", "pause abort", "resume"], rep["events"]
    assert w.start({}) == {"message": "Weight update started"}
    entry = {"update": 1, "version": None}
    w.session_updates.append(entry)
    w.finish({"weight_version": "v1"})
    assert entry["version"] == "v1" and w.version == "v1" and not w.session
    self_test_gen_e(mod, raw)
    self_test_ipc()
    print("receiver self-test PASS")


def bare_worker(api, backend="nccl"):
    """An HTTPWorker without torch or NCCL, for the self-test."""
    w = HTTPWorker.__new__(HTTPWorker)
    w.args = argparse.Namespace(api=api, backend=backend)
    w.init_state()
    return w


def expect_error(cls, message, f, *args):
    """f(*args) raises cls whose text is message."""
    try:
        f(*args)
    except cls as e:
        assert str(e) == message, (str(e), message)
        return
    raise AssertionError("%s%r: no %s %s" % (f.__name__, args, cls.__name__, message))


def self_test_ipc():
    """--backend ipc without torch or CUDA: the init and update_info rules
    (vLLM's IPCWeightTransferUpdateInfo messages, the environment switch,
    the pickle's recorded globals) and the session an update refused by
    them closes. Rebuilding the tensors needs CUDA (the GPU tests)."""
    # A stand-in for the pickled handles: {uuid: (func, args)} per tensor,
    # func a global the recorder must name (torch's needs torch).
    uuid = "0f2e8a51-7c3d-4b6e-9a10-123456789abc"
    handles = [{uuid: (len, (i,))} for i in range(2)]
    b64 = base64.b64encode(pickle.dumps(handles, protocol=3)).decode()
    ok_env = {INSECURE_SERIALIZATION_ENV: "1"}
    base = {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], []]}

    upd = ipc_update_info(dict(base, ipc_handles_pickled=b64), ok_env)
    assert upd.handles == handles and upd.names == ["a", "b"], upd.handles
    assert upd.pickle_globals == ["builtins.len"], upd.pickle_globals
    assert upd.pickle_bytes == len(base64.b64decode(b64))
    # Python's own protocols 4 and 5 (FRAME, memo, STACK_GLOBAL) load too.
    for proto in (4, 5):
        other = base64.b64encode(pickle.dumps(handles, protocol=proto)).decode()
        assert ipc_update_info(dict(base, ipc_handles_pickled=other), ok_env).handles == handles
    # ipc_handles given directly (JSON: no callables; receive_ipc refuses them).
    assert ipc_update_info(dict(base, ipc_handles=[{}, {}]), {}).pickle_bytes is None

    refused = (
        (dict(base, ipc_handles_pickled=b64, ipc_handles=[]), ok_env, ValueError,
         "Cannot specify both `ipc_handles` and `ipc_handles_pickled`"),
        (dict(base, ipc_handles_pickled=b64), {}, ValueError,
         "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1"),
        (dict(base, ipc_handles_pickled=b64), {INSECURE_SERIALIZATION_ENV: "0"}, ValueError,
         "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1"),
        (dict(base, ipc_handles_pickled=b64), {INSECURE_SERIALIZATION_ENV: "yes"}, ValueError,
         "invalid literal for int() with base 10: 'yes'"),
        (dict(base), ok_env, ValueError, "Either `ipc_handles` or `ipc_handles_pickled` must be provided"),
        (dict(base, ipc_handles_pickled=None), ok_env, ValueError,
         "Either `ipc_handles` or `ipc_handles_pickled` must be provided"),
        (dict(base, dtype_names=["bfloat16"], ipc_handles_pickled=b64), ok_env, ValueError,
         "`dtype_names` should be of the same size as `names`: got 1 and 2"),
        (dict(base, shapes=[[1], [2], [3]], ipc_handles_pickled=b64), ok_env, ValueError,
         "`shapes` should be of the same size as `names`: got 3 and 2"),
        (dict(base, names=["a"], dtype_names=["bfloat16"], shapes=[[1]], ipc_handles_pickled=b64), ok_env, ValueError,
         "`ipc_handles` should be of the same size as `names`: got 2 and 1"),
        ({"dtype_names": [], "shapes": [], "ipc_handles": []}, ok_env, TypeError,
         "__init__() missing 1 required positional argument: 'names'"),
        ({"names": [], "ipc_handles": []}, ok_env, TypeError,
         "__init__() missing 2 required positional arguments: 'dtype_names' and 'shapes'"),
        ({}, ok_env, TypeError,
         "__init__() missing 3 required positional arguments: 'names', 'dtype_names', and 'shapes'"),
    )
    for info, env, cls, message in refused:
        expect_error(cls, message, ipc_update_info, info, env)
    # The environment switch is checked before the pickle is looked at.
    expect_error(ValueError, "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1",
                 ipc_update_info, dict(base, ipc_handles_pickled="not base64, not a pickle"), {})

    # The worker: init_info {} only (E's router first), no torch, no NCCL.
    w = bare_worker("E", "ipc")
    expect_failure(400, "Missing 'init_info'", w.init_engine, {})
    expect_failure(400, "'init_info' must be a JSON object, got list", w.init_engine, {"init_info": []})
    expect_failure(500, "TypeError: __init__() got an unexpected keyword argument 'master_address'", w.init_engine,
                   {"init_info": {"master_address": "127.0.0.1", "master_port": 29500}})
    assert w.start({}) == {"message": "Weight update started"}
    expect_failure(500, "RuntimeError: weight transfer engine is not initialized", w.update,
                   {"update_info": dict(base, ipc_handles_pickled=b64)})
    assert not w.session, "a failed update_weights left E's session open"
    assert w.init_engine({"init_info": {}}) == {"message": "Weight transfer initialized"}
    assert w.report()["inits"][-1]["rendezvous"] == "ipc" and w.report()["backend"] == "ipc"
    # update_info: the ipc fields only (nccl's packed is unknown here), the
    # list form with one entry; a refused update closes E's session.
    for body, detail in (
            ({"update_info": dict(base, ipc_handles_pickled=b64, packed=True)},
             "TypeError: __init__() got an unexpected keyword argument 'packed'"),
            ({"update_info": [dict(base, ipc_handles_pickled=b64, packed_num_buffers=2)]},
             "TypeError: __init__() got an unexpected keyword argument 'packed_num_buffers' (update_info[0])"),
            ({"update_info": [{}, {}]}, "ValueError: update_info has 2 entries")):
        assert w.start({}) == {"message": "Weight update started"}
        expect_failure(500, detail, w.update, body)
        assert not w.session, body
    # ipc_update_info's errors are worker errors (the handler's 500), also
    # closing the session; nothing was received.
    saved = os.environ.pop(INSECURE_SERIALIZATION_ENV, None)
    try:
        assert w.start({}) == {"message": "Weight update started"}
        expect_error(ValueError, "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1",
                     w.update, {"update_info": dict(base, ipc_handles_pickled=b64)})
        assert not w.session
    finally:
        if saved is not None:
            os.environ[INSECURE_SERIALIZATION_ENV] = saved
    assert w.report()["calls"] == 0 and w.report()["failures"] == []
    # The nccl backend keeps refusing the ipc fields.
    e = bare_worker("E")
    e.start({})
    expect_failure(500, "TypeError: __init__() got an unexpected keyword argument 'ipc_handles_pickled'", e.update,
                   {"update_info": dict(base, ipc_handles_pickled=b64)})


def expect_failure(code, detail, f, *args):
    try:
        f(*args)
    except HTTPFailure as e:
        assert (e.code, e.detail[:len(detail)]) == (code, detail), (e.code, e.detail)
        return
    raise AssertionError("%s%r: no HTTP %d %s" % (f.__name__, args, code, detail))


def self_test_gen_e(legacy_mod, legacy_raw):
    """Generation E without torch: the two module layouts and their pickles,
    init_info's two ways to the unique id, the router's 400s, the session a
    failed update closes, /version and /update_weight_version."""
    # Layouts: E resolves a pickle naming either module to its one class (the
    # legacy name through the compat shim); C/D know only the legacy module.
    e_mod = install_shim(backends=True)
    uid = e_mod.ncclUniqueId.from_buffer_copy(bytes(range(128)))
    new_raw = pickle.dumps(uid, protocol=4)
    assert len(new_raw) == 256, len(new_raw)  # what rlflow's ncclid pickles for the backends layout
    for raw, module in ((legacy_raw, LEGACY_MODULE), (new_raw, BACKENDS_MODULE)):
        back, named = unpickle_unique_id(raw, e_mod.ncclUniqueId)
        assert named == module and type(back) is e_mod.ncclUniqueId, (named, type(back))
    assert bytes(unpickle_unique_id(new_raw, e_mod.ncclUniqueId)[0].internal) == bytes(range(128))
    d_mod = install_shim()
    assert unpickle_unique_id(legacy_raw, d_mod.ncclUniqueId)[1] == LEGACY_MODULE
    try:
        unpickle_unique_id(new_raw, d_mod.ncclUniqueId)
        raise AssertionError("the legacy layout unpickled the vllm.backends module")
    except ModuleNotFoundError:
        pass
    assert legacy_mod.__name__ == LEGACY_MODULE

    # init_info: exactly one way to the id.
    b64 = base64.b64encode(bytes(range(128))).decode()
    assert unique_id_source({"nccl_unique_id_b64": b64, "rank_offset": 1, "world_size": 2}) == ("unique_id", bytes(range(128)))
    assert unique_id_source({"master_address": "127.0.0.1", "master_port": 29500}) == ("tcpstore", ("127.0.0.1", 29500))
    for info, why in (
            ({"nccl_unique_id_b64": b64, "master_address": "127.0.0.1", "master_port": 29500}, "pass either"),
            ({"nccl_unique_id_b64": b64, "master_port": 29500}, "pass either"),
            ({"rank_offset": 1, "world_size": 2}, "master_address and master_port are required"),
            ({"master_address": "127.0.0.1"}, "master_address and master_port are required"),
            ({"nccl_unique_id_b64": b64[:-4]}, "nccl_unique_id_b64 holds 126 bytes"),
            ({"nccl_unique_id_b64": "not base64!"}, "nccl_unique_id_b64 is not standard base64"),
            ({"nccl_unique_id_b64": 7}, "nccl_unique_id_b64 must be a string")):
        try:
            unique_id_source(info)
            raise AssertionError("accepted %r" % info)
        except ValueError as e:
            assert str(e).startswith(why), (info, e)

    # The router's 400s, before any worker (or torch) is involved.
    w = bare_worker("E")
    expect_failure(400, "Missing 'init_info'", w.init_engine, {})
    expect_failure(400, "Missing 'init_info'", w.init_engine, {"init_info": None})
    expect_failure(400, "'init_info' must be a JSON object, got list", w.init_engine, {"init_info": []})
    expect_failure(500, "TypeError: __init__() got an unexpected keyword argument 'bogus'", w.init_engine,
                   {"init_info": {"nccl_unique_id_b64": b64, "rank_offset": 1, "world_size": 2, "bogus": 1}})
    try:
        w.init_engine({"init_info": {"rank_offset": 1, "world_size": 2}})
        raise AssertionError("init without a way to the id")
    except ValueError as e:  # a worker error: the handler answers 500 "ValueError: ..."
        assert "required" in str(e)

    # A failed update_weights closes E's session; the router's 400 does not.
    assert w.start({}) == {"message": "Weight update started"}
    expect_failure(400, "Missing 'update_info'", w.update, {})
    expect_failure(400, "'update_info' must be a JSON object or a list of JSON objects, got str", w.update, {"update_info": "x"})
    expect_failure(400, "'update_info' must be a JSON object or a list of JSON objects, got list", w.update, {"update_info": [{}, 1]})
    assert w.session, "a 400 from the router closed the session"
    expect_failure(500, "TypeError: __init__() got an unexpected keyword argument 'packed'", w.update,
                   {"update_info": {"names": [], "dtype_names": [], "shapes": [], "packed": True}})
    assert not w.session, "a failed update_weights left E's session open"
    expect_failure(500, E_NO_SESSION, w.finish, {})
    assert w.start({}) == {"message": "Weight update started"}
    expect_failure(500, "ValueError: update_info has 2 entries", w.update, {"update_info": [{}, {}]})
    assert not w.session
    assert w.start({}) == {"message": "Weight update started"}
    expect_failure(500, "TypeError: __init__() got an unexpected keyword argument 'packed' (update_info[0])", w.update,
                   {"update_info": [{"names": [], "dtype_names": [], "shapes": [], "packed": True}]})
    assert not w.session
    assert [e["what"] for e in w.report()["events"]].count("session closed by the worker: update_weights failed") == 3
    # C and D keep their wording, and D's failed update leaves the session open.
    d = bare_worker("D")
    expect_failure(500, "RuntimeError: no open weight update session", d.finish, {})
    d.start({})
    expect_failure(500, "TypeError: __init__() got an unexpected keyword argument 'packed'", d.update,
                   {"update_info": {"names": [], "dtype_names": [], "shapes": [], "packed": True}})
    assert d.session

    # Routes: E has /version 0.30.0 (what rlflow reads as E) and
    # /update_weight_version; D has neither, as before.
    posts, _, gets = routes(w, "E")
    assert gets["/version"]() == {"version": "0.30.0"}
    assert posts["/update_weight_version"]({"new_version": "run/iter-3-failed"})["weight_version"] == "run/iter-3-failed"
    assert gets["/weight_info"]() == {"weight_version": "run/iter-3-failed"}
    expect_failure(400, "'new_version' must be a non-empty string", posts["/update_weight_version"], {})
    posts, _, gets = routes(d, "D")
    assert "/version" not in gets and "/update_weight_version" not in posts


def open_expected(path, device):
    """name -> (safe_open handle) over a file or a directory of shards."""
    from safetensors import safe_open
    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise RuntimeError("no safetensors files at %s" % path)
    handles, where = [], {}
    for f in files:
        h = safe_open(f, framework="pt", device=device)
        handles.append(h)
        for k in h.keys():
            where[k] = h
    return handles, where


class HTTPFailure(Exception):
    def __init__(self, code, detail):
        Exception.__init__(self, detail)
        self.code, self.detail = code, detail


INIT_KEYS = {"master_address", "master_port", "rank_offset", "world_size"}
UPDATE_KEYS = {"names", "dtype_names", "shapes"}

# --backend ipc: the fields of vLLM's IPCWeightTransferUpdateInfo (its
# IPCWeightTransferInitInfo has none), the required ones in field order,
# and the environment switch its __post_init__ reads before unpickling.
IPC_UPDATE_KEYS = UPDATE_KEYS | {"ipc_handles", "ipc_handles_pickled"}
IPC_REQUIRED_KEYS = ("names", "dtype_names", "shapes")
INSECURE_SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"
REBUILD_CUDA_TENSOR = "torch.multiprocessing.reductions.rebuild_cuda_tensor"
REBUILD_DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device, which vLLM overwrites


def missing_arguments(missing):
    """The TypeError text of a dataclass __init__ called without the
    required fields missing (CPython's wording)."""
    quoted = ["'%s'" % m for m in missing]
    if len(quoted) == 1:
        listed = quoted[0]
    elif len(quoted) == 2:
        listed = " and ".join(quoted)
    else:
        listed = ", ".join(quoted[:-1]) + ", and " + quoted[-1]
    return "__init__() missing %d required positional argument%s: %s" % (
        len(missing), "" if len(missing) == 1 else "s", listed)


def load_pickle_recording_globals(raw):
    """pickle.loads(raw) (same Unpickler, same defaults), also returning
    the sorted "module.name" of every global the pickle named."""
    named = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            named.add(module + "." + name)
            return super().find_class(module, name)
    return Recorder(io.BytesIO(raw)).load(), sorted(named)


class IPCUpdate:
    """update_info of the ipc backend after vLLM's checks: names,
    dtype_names, shapes and handles (one {gpu_uuid: (func, args)} per
    name), plus what the receiver reports of the pickle (pickle_bytes and
    pickle_globals; None when ipc_handles came as JSON)."""

    def __init__(self, names, dtype_names, shapes, handles, pickle_bytes, pickle_globals):
        self.names, self.dtype_names, self.shapes, self.handles = names, dtype_names, shapes, handles
        self.pickle_bytes, self.pickle_globals = pickle_bytes, pickle_globals


def ipc_update_info(info, environ):
    """vLLM's IPCWeightTransferUpdateInfo(**info) with its __post_init__,
    in its order and with its messages: the required fields (TypeError),
    both or neither of ipc_handles and ipc_handles_pickled, the
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 switch of environ (parsed as vLLM's
    envs does: bool(int(value))) before pickle.loads(base64.b64decode(...)),
    then the lengths of dtype_names, shapes and ipc_handles against names
    (ValueError). Unknown keys are refused before (strict_keys). No torch:
    the pickle's torch globals are only resolved when loaded."""
    missing = [k for k in IPC_REQUIRED_KEYS if k not in info]
    if missing:
        raise TypeError(missing_arguments(missing))
    handles, pickled = info.get("ipc_handles"), info.get("ipc_handles_pickled")
    pickle_bytes, pickle_globals = None, None
    if pickled is not None:
        if handles is not None:
            raise ValueError("Cannot specify both `ipc_handles` and `ipc_handles_pickled`")
        if not bool(int(environ.get(INSECURE_SERIALIZATION_ENV, "0"))):
            raise ValueError("Refusing to deserialize `ipc_handles_pickled` without "
                             "VLLM_ALLOW_INSECURE_SERIALIZATION=1")
        raw = base64.b64decode(pickled)
        handles, pickle_globals = load_pickle_recording_globals(raw)
        pickle_bytes = len(raw)
    if handles is None:
        raise ValueError("Either `ipc_handles` or `ipc_handles_pickled` must be provided")
    names = info["names"]
    for key, value in (("dtype_names", info["dtype_names"]), ("shapes", info["shapes"]), ("ipc_handles", handles)):
        if len(value) != len(names):
            raise ValueError("`%s` should be of the same size as `names`: got %d and %d" % (key, len(value), len(names)))
    return IPCUpdate(names, info["dtype_names"], info["shapes"], handles, pickle_bytes, pickle_globals)


def live_shared_storages(cache):
    """How many storages torch's multiprocessing shared cache still holds
    alive (None when this torch's cache has another shape)."""
    try:
        with cache.lock:
            refs = list(cache.values())
        return sum(1 for ref in refs if not ref.expired())
    except Exception:  # noqa: BLE001 - a report field, not a check
        return None
PACKED_KEYS = {"packed", "packed_buffer_size_bytes", "packed_num_buffers"}
UNIQUE_ID_KEY = "nccl_unique_id_b64"

# GET /version per generation: E's is where rlflow's client (vllm package,
# firstGenE) reads a server as E, as the vLLM double answers. C and D serve
# no /version here (404), as before E existed.
VERSIONS = {"E": "0.30.0"}

# Generation E's worker refuses to finish when there is no session (after a
# failed update_weights it closed its own): rlflow's vllm.NoSessionOpen
# recognises this text.
E_NO_SESSION = "RuntimeError: finish_weight_update called without a matching start_weight_update"


PAUSE_MODES = ("abort", "wait", "keep")


class HTTPWorker:
    """The state of one emulated single-rank vLLM server (--http mode).

    self.lock serialises the worker RPCs (init, start, update, finish) as
    vLLM runs them, one at a time. What a test reads while an update runs
    (progress, pause state, history) is guarded by self.state instead,
    which is never held across NCCL work: GET /received, /is_paused and
    POST /pause, /resume answer during a broadcast, as vLLM's API server
    does while its workers receive."""

    def __init__(self, args):
        import torch
        self.torch, self.dist, self.args = torch, None, args
        self.shim, self.nccl = None, None
        if args.backend == "nccl":  # ipc needs no NCCL library, no rendezvous, no shim
            import torch.distributed as dist
            self.dist = dist
            self.shim = install_shim(backends=args.api == "E")
            self.nccl = Nccl(args.nccl_lib, self.shim.ncclUniqueId)
        self.dev = torch.device("cuda", args.device)
        self.init_state()

    def init_state(self):
        """Everything but torch and NCCL (the self-test builds only this)."""
        self.backend = getattr(self.args, "backend", "nccl")
        self.lock = threading.Lock()  # vLLM runs these worker RPCs one at a time
        self.state = threading.Lock()  # what the report reads; never held across NCCL work
        self.settling = threading.Lock()  # one settle() at a time (ipc overwrites what a pending one hashes)
        self.ipc_weights = {}  # --backend ipc: name -> this receiver's own tensor (its "model")
        self.comm = None
        self.store = None
        self.init_info = None
        self.session = False
        self.session_updates = []  # history entries of the open session: finish names their version
        self.version = None
        self.fail_next = 0
        self.updates = 0  # update_weights that completed
        self.calls = 0  # update_weights that started receiving
        self.last = {}
        self.last_stats = {}
        self.history = []  # per completed update: SHA-256 per tensor, version, paused
        self.pending = []  # --lazy-digest: (history entry, received tensors, names) not hashed yet
        self.failures = []  # per update_weights that failed while receiving
        self.inits = []  # per completed init_weight_transfer_engine
        self.progress = {}  # the running (or last) update's receive progress
        self.paused = False
        self.pause_calls = 0
        self.resume_calls = 0
        self.events = []  # control and transfer calls in order, for the test's logs

    def event(self, what):
        """Record what happened (call with self.state held)."""
        self.events.append({"t": time.time(), "what": what})

    @staticmethod
    def info(body, name, allowed):
        info = body.get(name)
        if not isinstance(info, dict):
            raise HTTPFailure(400, "Missing '%s' in request body" % name)
        return HTTPWorker.strict_keys(info, allowed)

    @staticmethod
    def strict_keys(info, allowed, where=""):
        extra = sorted(set(info) - allowed)
        if extra:
            # vLLM decodes into a strict dataclass: an unknown key is a 500.
            raise HTTPFailure(500, "TypeError: __init__() got an unexpected keyword argument '%s'%s" % (extra[0], where))
        return info

    # Generation E's router checks the shape of a body before any worker
    # sees it (400); what the workers' dataclasses refuse stays a 500.

    @staticmethod
    def router_present(body, name):
        info = body.get(name)
        if info is None:
            raise HTTPFailure(400, "Missing '%s' in request body" % name)
        return info

    @staticmethod
    def router_init_info(body):
        info = HTTPWorker.router_present(body, "init_info")
        if not isinstance(info, dict):
            raise HTTPFailure(400, "'init_info' must be a JSON object, got %s" % type(info).__name__)
        return info

    @staticmethod
    def router_update_info(body):
        info = HTTPWorker.router_present(body, "update_info")
        if not isinstance(info, dict) and not (isinstance(info, list) and all(isinstance(e, dict) for e in info)):
            raise HTTPFailure(400, "'update_info' must be a JSON object or a list of JSON objects, got %s" % type(info).__name__)
        return info

    @staticmethod
    def worker_update_info(info, allowed=UPDATE_KEYS):
        """E's worker side of update_info: an object, or a list with one
        payload per inference worker (data_parallel_index * (TP*PP) + rank;
        this server has one), each with the dataclass's strict keys
        (allowed: the backend's fields)."""
        if isinstance(info, dict):
            return HTTPWorker.strict_keys(info, allowed)
        if len(info) != 1:
            raise HTTPFailure(500, "ValueError: update_info has %d entries but the server has 1 inference worker; send one entry per worker, or one object for all" % len(info))
        return HTTPWorker.strict_keys(info[0], allowed, " (update_info[0])")

    def drop_comm(self):
        if self.comm is not None:
            log("aborting the communicator")
            self.nccl.lib.ncclCommAbort(self.comm)
            self.comm = None
        self.store = None

    # -- generation control (no generation runs here: only the state) --

    def pause(self, body, query):
        mode = (query.get("mode") or ["abort"])[-1]
        if mode not in PAUSE_MODES:
            raise HTTPFailure(422, "query.mode: Input should be 'abort', 'wait' or 'keep', got %r" % mode)
        # No requests are in flight here: abort has nothing to abort, keep
        # nothing to freeze, wait nothing to wait for.
        with self.state:
            self.paused = True
            self.pause_calls += 1
            self.event("pause " + mode)
        return {"status": "paused"}

    def resume(self, body):
        with self.state:
            self.paused = False
            self.resume_calls += 1
            self.event("resume")
        return {"status": "resumed"}

    def is_paused(self):
        with self.state:
            return {"is_paused": self.paused}

    # -- weight transfer --

    def init_engine(self, body):
        """init_weight_transfer_engine. C and D: the TCPStore rendezvous
        (master_address, master_port) and the pickled id, which must name
        LEGACY_MODULE. E: either nccl_unique_id_b64 (the communicator is
        built from those bytes, no TCPStore, no pickle) or the TCPStore,
        whose pickle may name either module (unique_id_source). --backend
        ipc: init_ipc."""
        if self.backend == "ipc":
            return self.init_ipc(body)
        gen_e = self.args.api == "E"
        if gen_e:
            info = self.strict_keys(self.router_init_info(body), INIT_KEYS | PACKED_KEYS | {UNIQUE_ID_KEY})
            how, source = unique_id_source(info)  # before the old group goes, as vLLM validates first
        else:
            allowed = INIT_KEYS | (PACKED_KEYS if self.args.api == "D" else set())
            info = self.info(body, "init_info", allowed)
        torch = self.torch
        # Waits for a running update_weights: when its trainer died, that
        # one fails within --update-deadline (sooner on the NCCL error).
        with self.lock:
            torch.cuda.set_device(self.args.device)
            # Re-initialising replaces the communicator: a trainer that died
            # left the old one without a peer, so it is aborted, not destroyed.
            self.drop_comm()
            world, rank = int(info["world_size"]), int(info["rank_offset"])
            if not gen_e:
                how, source = "tcpstore", (info["master_address"], info["master_port"])
            if how == "tcpstore":
                log("init: TCPStore %s:%s, rank %d of %d" % (source[0], source[1], rank, world))
            else:
                log("init: %s (%d bytes, no TCPStore, no pickle), rank %d of %d" % (UNIQUE_ID_KEY, len(source), rank, world))
            t0 = time.perf_counter()
            store, raw, module = None, None, None
            try:
                if how == "tcpstore":
                    store = self.dist.TCPStore(source[0], int(source[1]), world_size=world, is_master=False,
                                               timeout=datetime.timedelta(seconds=self.args.store_timeout), use_libuv=False)
                    raw = store.get("broadcast_from/0/0")
                    uid, module = unpickle_unique_id(raw, self.shim.ncclUniqueId)
                    log("init: the %d-byte pickled unique id names %s" % (len(raw), module))
                else:
                    uid = self.shim.ncclUniqueId.from_buffer_copy(source)
                comm = self.nccl.init_rank(world, uid, rank)
                stream = torch.cuda.current_stream(self.dev)
                warm = torch.zeros(1, dtype=torch.float32, device=self.dev)
                self.nccl.all_reduce(ctypes.c_void_p(warm.data_ptr()), 1, NCCL_FLOAT32, comm, ctypes.c_void_p(stream.cuda_stream))
                stream.synchronize()
            except Exception as e:
                with self.state:
                    self.event("init failed: %s: %s" % (type(e).__name__, e))
                raise
            self.comm, self.store, self.init_info = comm, store, info
            secs = time.perf_counter() - t0
            with self.state:
                # rendezvous: how the id arrived (tcpstore or unique_id);
                # pickle_module and pickle_bytes: what the TCPStore held.
                self.inits.append({"at": time.time(), "master_port": int(source[1]) if how == "tcpstore" else None,
                                   "seconds": secs, "rendezvous": how, "pickle_module": module,
                                   "pickle_bytes": len(raw) if raw is not None else None, "rank": rank, "world_size": world})
                self.event("init port %s" % source[1] if how == "tcpstore" else "init " + UNIQUE_ID_KEY)
            log("init: communicator ready (warm-up done) in %.2fs, rendezvous %s%s" % (
                secs, how, " (pickle of %d bytes naming %s)" % (len(raw), module) if raw is not None else ""))
        return {"message": "Weight transfer initialized"}

    def init_ipc(self, body):
        """init_weight_transfer_engine of the ipc backend: E's router rules
        for the body, then IPCWeightTransferInitInfo(**init_info), which has
        no fields (an unknown key is a 500), and a no-op, as in vLLM. No
        torch: a failed update leaves it initialized (there is nothing to
        tear down)."""
        info = self.strict_keys(self.router_init_info(body), set())
        with self.lock:
            self.init_info = info
            with self.state:
                self.inits.append({"at": time.time(), "master_port": None, "seconds": 0.0, "rendezvous": "ipc",
                                   "pickle_module": None, "pickle_bytes": None, "rank": None, "world_size": None})
                self.event("init ipc")
        log("init: ipc backend (nothing to set up)")
        return {"message": "Weight transfer initialized"}

    def start(self, body):
        with self.lock:
            if self.session:
                raise HTTPFailure(500, "RuntimeError: a weight update session is already open")
            with self.state:
                self.session = True
                self.session_updates = []
                self.event("start")
        return {"message": "Weight update started"}

    def finish(self, body):
        with self.lock:
            if not self.session:
                raise HTTPFailure(500, E_NO_SESSION if self.args.api == "E" else "RuntimeError: no open weight update session")
            version = body.get("weight_version")
            with self.state:
                self.session = False
                self.version = version or self.version
                # The version names the updates of this session (none when a
                # trainer closes a dead one's session with an empty version).
                for e in self.session_updates:
                    e["version"] = version or None
                self.session_updates = []
                self.event("finish %s" % (version or "-"))
        return {"message": "Weight update finished"}

    def update_version(self, body):
        """POST /update_weight_version (E here): what rlflow labels an E
        server's weights with after the server closed a failed update's
        session itself."""
        v = body.get("new_version")
        if not isinstance(v, str) or not v:
            raise HTTPFailure(400, "'new_version' must be a non-empty string")
        self.strict_keys(body, {"new_version"})
        with self.lock:
            with self.state:
                self.version = v
                self.event("update_weight_version %s" % v)
        return {"message": "Weight version updated", "weight_version": v}

    def update(self, body):
        if self.args.api == "E":
            return self.update_e(body)
        allowed = UPDATE_KEYS | (PACKED_KEYS if self.args.api == "C" else set())
        info = self.info(body, "update_info", allowed)
        with self.lock:
            return self.update_locked(info)

    def update_e(self, body):
        """Generation E's update_weights: the router's 400s leave the
        session as it is; any failure past the router (a 500: bad keys, a
        wrong list, no session, the injected failure, NCCL) closes the
        session, as E's worker does, so a following finish_weight_update
        answers E_NO_SESSION."""
        raw = self.router_update_info(body)
        allowed = IPC_UPDATE_KEYS if self.backend == "ipc" else UPDATE_KEYS
        with self.lock:
            try:
                return self.update_locked(self.worker_update_info(raw, allowed))
            except Exception as e:
                with self.state:
                    if self.session:
                        self.session = False
                        self.session_updates = []
                        self.event("session closed by the worker: update_weights failed")
                        log("update_weights failed (%s): the worker closed its update session" % e)
                raise

    def update_locked(self, info):
        """The worker's update_weights (self.lock held)."""
        if not self.session:
            raise HTTPFailure(500, "RuntimeError: update_weights called without an open weight update session")
        if (self.init_info if self.backend == "ipc" else self.comm) is None:
            raise HTTPFailure(500, "RuntimeError: weight transfer engine is not initialized")
        if self.fail_next > 0:
            self.fail_next -= 1
            raise HTTPFailure(500, "RuntimeError: receiver: injected failure (POST /fail_next_update)")
        if self.backend == "ipc":
            return self.update_ipc_locked(info)
        torch = self.torch
        torch.cuda.set_device(self.args.device)
        src = self.init_info if self.args.api in ("D", "E") else info
        packed = bool(src.get("packed", False))
        threshold = int(src.get("packed_buffer_size_bytes") or (1 << 30))
        names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
        if not (len(names) == len(dtypes) == len(shapes)):
            raise HTTPFailure(500, "ValueError: update_info lists differ in length")
        unknown = sorted(set(d for d in dtypes if d not in (ITEMSIZE if packed else NCCL_DTYPES)))
        if unknown:
            # vLLM's from_torch raises for a non-packed dtype it does not map.
            raise HTTPFailure(500, "ValueError: Unsupported dtype %s" % ", ".join(unknown))
        sizes = [numel(sh) * ITEMSIZE[d] for sh, d in zip(shapes, dtypes)]
        chunks = plan_chunks(sizes, packed, threshold)
        n = self.begin_update(len(chunks), sum(sizes), "%d chunks" % len(chunks))
        t0 = time.perf_counter()
        try:
            received, types = self.receive(names, dtypes, shapes, sizes, chunks, packed)
        except Exception as e:
            # The trainer died or aborted (NCCL error) or the deadline
            # passed: abort the communicator, whose kernels then exit; the
            # next init builds a new one. The session stays open on C and
            # D: the next trainer closes it (E closes it, update_e).
            self.drop_comm()
            self.record_failure(n, e, time.perf_counter() - t0, len(chunks))
            raise
        secs = time.perf_counter() - t0
        stats = {"backend": "nccl", "broadcasts": len(chunks), "bytes": sum(sizes), "seconds": secs,
                 "gbps": sum(sizes) / max(secs, 1e-9) / 1e9, "packed": packed,
                 "vllm_unpack": bool(packed and self.args.vllm_unpack), "nccl_types": types}
        self.record_update(n, received, names, stats)
        log("update %d: %d tensors, %d broadcasts, %d bytes in %.3fs" % (n, len(names), len(chunks), sum(sizes), secs))
        return {"message": "Weights updated"}

    def begin_update(self, chunks, nbytes, what):
        """Counts an update_weights that starts receiving; returns its number."""
        with self.state:
            self.calls += 1
            n = self.calls
            self.progress = {"update": n, "running": True, "chunks": chunks, "chunks_done": 0,
                             "bytes": nbytes, "bytes_done": 0}
            self.event("update %d: receiving %s" % (n, what))
        return n

    def record_failure(self, n, e, secs, chunks):
        """An update_weights that failed while receiving (GET /received's failures)."""
        with self.state:
            self.progress["running"] = False
            self.failures.append({"update": n, "at": time.time(), "seconds": secs,
                                  "error": "%s: %s" % (type(e).__name__, e),
                                  "chunks_done": self.progress["chunks_done"], "chunks": chunks})
            self.event("update %d failed after %.2fs: %s" % (n, secs, e))
        log("update %d failed after %.2fs: %s" % (n, secs, e))

    def record_update(self, n, received, names, stats):
        """A completed update: its SHA-256 per tensor of received (name ->
        uint8 view) in the history and as the last update. --lazy-digest:
        the tensors are kept and hashed when GET /received asks, so
        update_weights answers as soon as the bytes are here (as vLLM's
        does; timing benchmarks use it)."""
        digests = None if self.args.lazy_digest else sha256s(received, names)
        with self.state:
            entry = {"update": n, "at": time.time(), "sha256": digests, "version": None,
                     "paused": self.paused, "stats": stats}
            self.history.append(entry)
            self.session_updates.append(entry)
            if digests is None:
                self.pending.append((entry, received, names))
            self.last, self.last_stats = digests, stats
            self.updates += 1
            self.progress["running"] = False
            self.event("update %d: done, %d bytes in %.2fs" % (n, stats["bytes"], stats["seconds"]))

    def update_ipc_locked(self, info):
        """update_weights of the ipc backend (self.lock held): vLLM's
        update_info checks (ipc_update_info, a 500 before anything is
        opened), then receive_ipc."""
        upd = ipc_update_info(info, os.environ)
        try:
            planned = sum(numel(sh) * ITEMSIZE[d] for sh, d in zip(upd.shapes, upd.dtype_names))
        except (KeyError, TypeError, ValueError):
            planned = None  # receive_ipc refuses what this cannot size
        n = self.begin_update(len(upd.names), planned, "%d tensors over CUDA IPC" % len(upd.names))
        t0 = time.perf_counter()
        try:
            received, stats = self.receive_ipc(upd)
        except Exception as e:
            self.record_failure(n, e, time.perf_counter() - t0, len(upd.names))
            raise
        stats["seconds"] = time.perf_counter() - t0
        stats["gbps"] = stats["bytes"] / max(stats["seconds"], 1e-9) / 1e9
        self.record_update(n, received, upd.names, stats)
        log("update %d: %d tensors, %d bytes over CUDA IPC in %.3fs (%d storages opened, %s alive after the drop)" % (
            n, len(upd.names), stats["bytes"], stats["seconds"], stats["storages"], stats["storages_alive_after_drop"]))
        return {"message": "Weights updated"}

    def receive_ipc(self, upd):
        """vLLM's IPCWeightTransferEngine.receive_weights, then its
        load_weights as a copy into this receiver's own tensor per name.

        Per tensor, as vLLM: this GPU's UUID picks the handle (else the
        ValueError "IPC handle not found ..."), func, args = handle[uuid],
        args[6] = the current device index, weight = func(*args). Stricter
        than vLLM: func must be torch's rebuild_cuda_tensor and the weight
        must have the dtype, shape and device update_info names, and be
        contiguous. Every weight is rebuilt before any is loaded (vLLM
        builds the list, then calls load_weights once); then the device is
        synchronized (vLLM's torch.accelerator.synchronize()) and every
        rebuilt tensor is dropped, also on an error, so that torch's ref
        counting releases the producer's shares (the first tensor of a
        storage opens it and holds its ref-counter slot until the storage
        dies; the cache hits release theirs at once). Returns name -> uint8
        view of the receiver's own tensor, and the stats."""
        torch = self.torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, shared_cache
        torch.cuda.set_device(self.args.device)
        self.settle()  # --lazy-digest: the last update's bytes are hashed before they are overwritten
        weights, weight, list_args, w = [], None, None, None
        storages, nbytes, allocated, uuid, device_index = set(), 0, 0, None, None
        try:
            for name, dtype_name, shape, ipc_handle in zip(upd.names, upd.dtype_names, upd.shapes, upd.handles):
                device_index = current_device_index(torch)
                uuid = str(torch.cuda.get_device_properties(device_index).uuid)
                if uuid not in ipc_handle:
                    raise ValueError("IPC handle not found for GPU UUID %s. Available UUIDs: %s" % (uuid, list(ipc_handle.keys())))
                func, args = ipc_handle[uuid]
                if func is not rebuild_cuda_tensor:
                    raise ValueError("update_info: tensor %r: the handle's function is %r, not %s (receiver.py is stricter than vLLM here)" % (
                        name, func, REBUILD_CUDA_TENSOR))
                list_args = list(args)
                list_args[REBUILD_DEVICE_ARG] = device_index
                weight = func(*list_args)
                storages.add((list_args[7], list_args[9]))
                check_rebuilt(torch, name, weight, dtype_name, shape, device_index)
                weights.append((name, weight))
                nbytes += weight.numel() * weight.element_size()
                weight = None
                with self.state:
                    self.progress["chunks_done"] += 1
                    self.progress["bytes_done"] = nbytes
            received = {}
            for name, w in weights:  # load_weights: copies into the "model"
                own = self.ipc_weights.get(name)
                if own is None or own.dtype != w.dtype or own.shape != w.shape:
                    own = torch.empty(w.shape, dtype=w.dtype, device=self.dev)
                    self.ipc_weights[name] = own
                    allocated += 1
                own.copy_(w)
                received[name] = own.reshape(-1).view(torch.uint8)
            torch.cuda.synchronize(self.dev)
        except BaseException as e:
            # The frames the error left (rebuild_cuda_tensor's, check_rebuilt's)
            # hold rebuilt tensors or storages until the handler has answered:
            # clear them now, this one's locals below.
            import traceback
            traceback.clear_frames(e.__traceback__)
            raise
        finally:
            if weights:  # no copy may still read the producer's memory once its shares are released
                try:
                    torch.cuda.synchronize(self.dev)
                except Exception as sync_error:  # noqa: BLE001 - the first error is the one reported
                    log("receive_ipc: synchronize before dropping the rebuilt tensors: %s" % sync_error)
            weights.clear()
            weight = list_args = w = None
        stats = {"backend": "ipc", "tensors": len(upd.names), "bytes": nbytes, "gpu_uuid": uuid,
                 "device_index": device_index, "rebuild": REBUILD_CUDA_TENSOR, "pickle_bytes": upd.pickle_bytes,
                 "pickle_globals": upd.pickle_globals, "storages": len(storages), "allocated": allocated,
                 "storages_alive_after_drop": live_shared_storages(shared_cache)}
        return received, stats

    def receive(self, names, dtypes, shapes, sizes, chunks, packed):
        """The broadcasts of one update; returns name -> uint8 view and the
        NCCL type of each broadcast (per tensor name; ncclUint8 for packed).
        With --vllm-unpack each packed chunk is unpacked as vLLM does
        (vllm_unpack), so a layout vLLM cannot view fails here as it would
        there.

        A CUDA event after each chunk's broadcast tells, without a sync,
        how many chunks have arrived (GET /received's progress). With
        --chunk-delay each chunk is awaited and followed by a pause before
        the next receive is posted: the trainer's next broadcast waits for
        it, so an update lasts long enough for a test to act in its middle.
        Every wait watches the communicator and --update-deadline."""
        torch = self.torch
        stream = torch.cuda.current_stream(self.dev)
        sp = ctypes.c_void_p(stream.cuda_stream)
        deadline = time.monotonic() + self.args.update_deadline
        ends = []  # bytes received once chunk k has arrived
        for chunk in chunks:
            ends.append((ends[-1] if ends else 0) + sum(sizes[i] for i in chunk))
        events, done = [], [0]

        def advance():
            k = done[0]
            while k < len(events) and events[k].query():
                k += 1
            if k != done[0]:
                done[0] = k
                with self.state:
                    self.progress["chunks_done"] = k
                    self.progress["bytes_done"] = ends[k - 1]

        received, types = {}, {}
        for chunk in chunks:
            if packed:
                nbytes = sum(sizes[i] for i in chunk)
                buf = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
                self.nccl.broadcast(ctypes.c_void_p(buf.data_ptr()), nbytes, NCCL_UINT8, self.comm, sp)
                for i in chunk:
                    types[names[i]] = NCCL_UINT8
                if self.args.vllm_unpack:
                    received.update(vllm_unpack(torch, buf, [names[i] for i in chunk], [dtypes[i] for i in chunk],
                                                [shapes[i] for i in chunk], [sizes[i] for i in chunk]))
                else:
                    off = 0
                    for i in chunk:
                        received[names[i]] = buf[off:off + sizes[i]]
                        off += sizes[i]
            else:
                i = chunk[0]
                t = torch.empty([int(d) for d in shapes[i]], dtype=getattr(torch, dtypes[i]), device=self.dev)
                self.nccl.broadcast(ctypes.c_void_p(t.data_ptr()), t.numel(), NCCL_DTYPES[dtypes[i]], self.comm, sp)
                types[names[i]] = NCCL_DTYPES[dtypes[i]]
                received[names[i]] = t.reshape(-1).view(torch.uint8)
            ev = torch.cuda.Event()
            ev.record(stream)
            events.append(ev)
            if self.args.chunk_delay > 0:
                self.nccl.wait(ev, self.comm, deadline, advance)
                time.sleep(self.args.chunk_delay)
        self.nccl.wait(stream, self.comm, deadline, advance)
        return received, types

    def settle(self):
        """Hashes the updates --lazy-digest kept (oldest first). One call at
        a time: when it returns, every kept update is hashed, also those a
        concurrent call was hashing (receive_ipc then overwrites them)."""
        with self.settling:
            while True:
                with self.state:
                    if not self.pending:
                        return
                    entry, received, names = self.pending.pop(0)
                d = sha256s(received, names)
                with self.state:
                    entry["sha256"] = d
                    if self.history and self.history[-1] is entry:
                        self.last = d

    def report(self):
        self.settle()
        with self.state:
            # A deep copy: the reply is encoded after the lock is released.
            return json.loads(json.dumps({
                "updates": self.updates, "sha256": self.last, "stats": self.last_stats, "version": self.version,
                "calls": self.calls, "history": self.history, "failures": self.failures, "inits": self.inits,
                "progress": self.progress, "session_open": self.session, "paused": self.paused,
                "pause_calls": self.pause_calls, "resume_calls": self.resume_calls, "events": self.events,
                "api": self.args.api, "backend": self.backend,
            }))


def current_device_index(torch):
    """vLLM's torch.accelerator.current_device_index() (torch >= 2.6), else
    torch.cuda.current_device()."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "current_device_index"):
        return acc.current_device_index()
    return torch.cuda.current_device()


def check_rebuilt(torch, name, weight, dtype_name, shape, device_index):
    """receiver.py, stricter than vLLM (which passes the weight on as it
    is): the rebuilt tensor has update_info's dtype and shape, lies on this
    device and is contiguous (ValueError otherwise)."""
    want = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
    if not isinstance(want, torch.dtype):
        raise ValueError("update_info: tensor %r: dtype_names holds %r, not a torch dtype" % (name, dtype_name))
    if weight.dtype != want:
        raise ValueError("update_info: tensor %r: rebuilt as %s, dtype_names says %s" % (name, weight.dtype, dtype_name))
    if list(weight.shape) != [int(d) for d in shape]:
        raise ValueError("update_info: tensor %r: rebuilt with shape %s, shapes says %s" % (name, list(weight.shape), shape))
    if weight.device.type != "cuda" or weight.device.index != device_index:
        raise ValueError("update_info: tensor %r: rebuilt on %s, not cuda:%d" % (name, weight.device, device_index))
    if not weight.is_contiguous():
        raise ValueError("update_info: tensor %r: rebuilt with strides %s, not contiguous" % (name, list(weight.stride())))


def sha256s(received, names):
    """SHA-256 per tensor of one update's received bytes."""
    import hashlib
    return {nm: hashlib.sha256(received[nm].cpu().numpy().tobytes()).hexdigest() for nm in names}


def routes(worker, api):
    """The routes of --http for generation api: POST handlers taking the
    body, POST handlers also taking the query, GET handlers. E adds GET
    /version and POST /update_weight_version."""
    posts = {
        "/init_weight_transfer_engine": worker.init_engine,
        "/start_weight_update": worker.start,
        "/update_weights": worker.update,
        "/finish_weight_update": worker.finish,
        "/resume": worker.resume,
    }
    posts_query = {"/pause": worker.pause}  # handlers that read the query string

    def fail_next(body):
        with worker.lock:
            worker.fail_next += 1
        return {"message": "the next update_weights fails"}
    posts["/fail_next_update"] = fail_next
    gets = {
        "/get_world_size": lambda: {"world_size": 1},
        "/weight_info": lambda: {"weight_version": worker.version},
        "/is_paused": worker.is_paused,
        "/received": worker.report,
    }
    if api in VERSIONS:
        gets["/version"] = lambda: {"version": VERSIONS[api]}
    if api == "E":
        posts["/update_weight_version"] = worker.update_version
    return posts, posts_query, gets


def serve_http(args):
    import http.server
    from urllib.parse import parse_qs, urlparse

    wd = threading.Timer(args.deadline, lambda: (log("watchdog: %.0fs deadline passed, exiting" % args.deadline), os._exit(4)))
    wd.daemon = True
    wd.start()
    worker = HTTPWorker(args)
    posts, posts_query, gets = routes(worker, args.api)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # TCP_NODELAY on every connection, as vLLM's server (uvicorn on
        # asyncio, which sets it on TCP sockets) has: http.server writes a
        # response's header lines one send each, and with Nagle's algorithm
        # a client that keeps the connection alive (Go's) waits for a
        # delayed ACK, about 40 ms, on every call.
        disable_nagle_algorithm = True

        def log_message(self, fmt, *a):
            if urlparse(getattr(self, "path", "")).path == "/received":
                return  # tests poll it every few milliseconds
            log("http: " + fmt % a)

        def reply(self, code, obj):
            b = json.dumps(obj).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(b)))
                self.end_headers()
                self.wfile.write(b)
            except (BrokenPipeError, ConnectionResetError) as e:
                # The caller is gone (a killed trainer's update_weights).
                log("http: %s %s: could not answer %d, the client went away (%s)" % (self.command, self.path, code, e))
                self.close_connection = True

        def do_GET(self):
            path = urlparse(self.path).path
            if path in gets:
                self.reply(200, gets[path]())
            elif path in posts or path in posts_query:
                self.reply(405, {"detail": "Method Not Allowed"})
            else:
                self.reply(404, {"detail": "Not Found"})

        def do_POST(self):
            url = urlparse(self.path)
            path = url.path
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            if path not in posts and path not in posts_query:
                self.reply(405 if path in gets else 404, {"detail": "Not Found"})
                return
            try:
                try:
                    body = json.loads(raw) if raw.strip() else {}
                except ValueError as e:
                    if args.api != "E":
                        raise  # C, D: a 500, as before
                    raise HTTPFailure(400, "JSON decode error: %s" % e)
                if not isinstance(body, dict):
                    raise HTTPFailure(400, "body is not a JSON object")
                if path in posts_query:
                    out = posts_query[path](body, parse_qs(url.query))
                else:
                    out = posts[path](body)
                self.reply(200, out)
            except HTTPFailure as e:
                self.reply(e.code, {"detail": e.detail})
            except Exception as e:  # a worker exception: vLLM answers 500
                import traceback
                traceback.print_exc()
                self.reply(500, {"detail": "%s: %s" % (type(e).__name__, e)})

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", args.http), Handler)
    srv.daemon_threads = True
    ready = {"port": args.http, "api": args.api, "backend": args.backend}
    if worker.nccl is not None:
        ready["nccl"] = worker.nccl.version()
    emit("READY", **ready)
    log("serving on 127.0.0.1:%d (generation %s, backend %s)" % (args.http, args.api, args.backend))
    srv.serve_forever()
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--meta", help="JSON: names, dtype_names, shapes, packed, packed_buffer_size_bytes, checkpoint")
    ap.add_argument("--nccl-lib", default=os.environ.get("RECEIVER_NCCL_LIB", "libnccl.so.2"),
                    help="NCCL to load (default libnccl.so.2: torch's own copy when torch already loaded one)")
    ap.add_argument("--store-timeout", type=float, default=300.0)
    ap.add_argument("--deadline", type=float, default=900.0, help="watchdog: exit 4 after this many seconds")
    ap.add_argument("--progress", action="store_true", help="sync and print PROGRESS after every broadcast")
    ap.add_argument("--exit-after", type=int, default=-1, help="die (os._exit) after this many broadcasts")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--raw-bytes", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--http", type=int, default=0, metavar="PORT",
                    help="serve the vLLM-like HTTP routes on 127.0.0.1:PORT (see the module doc)")
    ap.add_argument("--api", default="D", choices=["C", "D", "E"], help="--http: the API generation to emulate")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "ipc"],
                    help="--http: vLLM's weight-transfer backend to serve (ipc: CUDA IPC handles in update_info, "
                         "needs --api E and VLLM_ALLOW_INSECURE_SERIALIZATION=1; no NCCL is loaded)")
    ap.add_argument("--update-deadline", type=float, default=120.0,
                    help="--http: seconds one update_weights may take; past it (or on an NCCL error, e.g. the trainer died) it fails with a 500 and the communicator is aborted")
    ap.add_argument("--chunk-delay", type=float, default=0.0, metavar="SECONDS",
                    help="--http, test control: after each chunk has arrived, wait this long before receiving the next "
                         "(the trainer's next broadcast waits too), so that a test can act in the middle of an update")
    ap.add_argument("--lazy-digest", action="store_true", default=os.environ.get("RECEIVER_LAZY_DIGEST") == "1",
                    help="--http: hash an update's tensors when GET /received asks, not before update_weights answers "
                         "(for timing; default: RECEIVER_LAZY_DIGEST=1)")
    ap.add_argument("--vllm-unpack", action="store_true", default=os.environ.get("RECEIVER_VLLM_UNPACK") == "1",
                    help="--http: unpack every packed chunk as vLLM does (split, view(dtype), view(*shape)), "
                         "so that a layout vLLM cannot view fails here too (default: RECEIVER_VLLM_UNPACK=1)")
    ap.add_argument("--unpack-check", metavar="FILE",
                    help="view the packed cases of FILE as vLLM does, on the CPU, print UNPACK {json} with the "
                         "tensors torch refuses and exit (needs torch, no GPU)")
    ap.add_argument("--plan-only", action="store_true",
                    help="print the wire sequence planned from --meta as PLAN {json} and exit (no torch, no GPU)")
    args = ap.parse_args()
    if args.backend == "ipc" and not (args.http and args.api == "E"):
        ap.error("--backend ipc is served by the HTTP mode of generation E only: add --http PORT --api E")

    if args.self_test:
        self_test()
        return 0
    if args.unpack_check:
        return unpack_check(args.unpack_check)
    if args.http:
        return serve_http(args)
    if args.plan_only:
        with open(args.meta) as f:
            meta = json.load(f)
        sizes = [numel(s) * ITEMSIZE[d] for s, d in zip(meta["shapes"], meta["dtype_names"])]
        chunks = plan_chunks(sizes, bool(meta.get("packed", False)), int(meta.get("packed_buffer_size_bytes", 1 << 30)))
        emit("PLAN", chunks=[[meta["names"][i] for i in c] for c in chunks],
             bytes=[sum(sizes[i] for i in c) for c in chunks])
        return 0

    def watchdog():
        log("watchdog: %.0fs deadline passed, exiting" % args.deadline)
        emit("RESULT", verdict="FAIL", rank=args.rank, error="watchdog deadline passed")
        os._exit(4)
    wd = threading.Timer(args.deadline, watchdog)
    wd.daemon = True
    wd.start()

    import torch
    import torch.distributed as dist

    shim = install_shim()
    torch.cuda.set_device(args.device)
    dev = torch.device("cuda", args.device)

    t_start = time.perf_counter()
    log("rank %d/%d: TCPStore client to %s:%d" % (args.rank, args.world_size, args.host, args.port))
    store = dist.TCPStore(args.host, args.port, world_size=args.world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=args.store_timeout), use_libuv=False)
    raw = store.get("broadcast_from/0/0")
    uid = pickle.loads(raw)
    if not isinstance(uid, shim.ncclUniqueId):
        raise RuntimeError("unpickled %r, not the shim's ncclUniqueId" % type(uid))
    log("got the %d-byte pickled unique id" % len(raw))

    nccl = Nccl(args.nccl_lib, shim.ncclUniqueId)
    log("NCCL %d from %s" % (nccl.version(), args.nccl_lib))
    comm = nccl.init_rank(args.world_size, uid, args.rank)
    stream = torch.cuda.current_stream(dev)
    sp = ctypes.c_void_p(stream.cuda_stream)
    warm = torch.zeros(1, dtype=torch.float32, device=dev)
    nccl.all_reduce(ctypes.c_void_p(warm.data_ptr()), 1, NCCL_FLOAT32, comm, sp)
    stream.synchronize()
    t_ready = time.perf_counter()
    log("communicator ready after %.2fs (warm-up done)" % (t_ready - t_start))
    emit("READY", rank=args.rank, nccl=nccl.version(), seconds=t_ready - t_start)

    count = [0]

    def after_broadcast(nbytes, what):
        count[0] += 1
        if args.progress:
            stream.synchronize()
            emit("PROGRESS", rank=args.rank, index=count[0] - 1, bytes=nbytes, what=what)
        if args.exit_after >= 0 and count[0] >= args.exit_after:
            log("exiting on purpose after %d broadcasts" % count[0])
            os._exit(3)

    if args.raw_bytes > 0:
        buf = torch.empty(args.raw_bytes, dtype=torch.uint8, device=dev)
        t0 = time.perf_counter()
        for i in range(args.repeat):
            nccl.broadcast(ctypes.c_void_p(buf.data_ptr()), args.raw_bytes, NCCL_UINT8, comm, sp)
            after_broadcast(args.raw_bytes, "raw %d" % i)
        stream.synchronize()
        secs = time.perf_counter() - t0
        ok = True
        if not args.no_verify:
            want = (torch.arange(args.raw_bytes, device=dev, dtype=torch.int64) % 251).to(torch.uint8)
            ok = bool(torch.equal(buf, want))
        total = args.raw_bytes * args.repeat
        emit("RESULT", verdict="PASS" if ok else "FAIL", rank=args.rank, mode="raw", bytes=total,
             broadcasts=args.repeat, seconds=secs, gbps=total / secs / 1e9)
        return 0 if ok else 1

    with open(args.meta) as f:
        meta = json.load(f)
    names, dtypes, shapes = meta["names"], meta["dtype_names"], meta["shapes"]
    if not (len(names) == len(dtypes) == len(shapes)):
        raise RuntimeError("names, dtype_names and shapes differ in length")
    packed = bool(meta.get("packed", False))
    threshold = int(meta.get("packed_buffer_size_bytes", 1 << 30))
    sizes = [numel(s) * ITEMSIZE[d] for s, d in zip(shapes, dtypes)]
    chunks = plan_chunks(sizes, packed, threshold)
    total = sum(sizes)
    log("%d tensors, %d bytes, %s, %d broadcasts" % (len(names), total, "packed T=%d" % threshold if packed else "non-packed", len(chunks)))

    torch_dtype = {n: getattr(torch, n) for n in set(dtypes)}
    received = {}  # name -> uint8 view of the received bytes
    t0 = time.perf_counter()
    for k, chunk in enumerate(chunks):
        if packed:
            nbytes = sum(sizes[i] for i in chunk)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            nccl.broadcast(ctypes.c_void_p(buf.data_ptr()), nbytes, NCCL_UINT8, comm, sp)
            off = 0
            for i in chunk:
                received[names[i]] = buf[off:off + sizes[i]]
                off += sizes[i]
            after_broadcast(nbytes, "chunk %d (%d tensors)" % (k, len(chunk)))
        else:
            i = chunk[0]
            t = torch.empty([int(d) for d in shapes[i]], dtype=torch_dtype[dtypes[i]], device=dev)
            nccl.broadcast(ctypes.c_void_p(t.data_ptr()), t.numel(), NCCL_DTYPES[dtypes[i]], comm, sp)
            received[names[i]] = t.reshape(-1).view(torch.uint8)
            after_broadcast(sizes[i], names[i])
    stream.synchronize()
    secs = time.perf_counter() - t0
    log("received %d bytes in %.3fs (%.2f GB/s)" % (total, secs, total / max(secs, 1e-9) / 1e9))

    mismatches, converted = [], 0
    if not args.no_verify:
        _, where = open_expected(meta["checkpoint"], "cuda:%d" % args.device)
        for name, dname, shape in zip(names, dtypes, shapes):
            h = where.get(name)
            if h is None:
                mismatches.append({"name": name, "why": "not in the checkpoint"})
                continue
            want = h.get_tensor(name)
            if list(want.shape) != [int(d) for d in shape]:
                mismatches.append({"name": name, "why": "shape %s, file has %s" % (shape, list(want.shape))})
                continue
            if want.dtype != torch_dtype[dname]:
                # The trainer converted during staging (e.g. F32 -> BF16):
                # compare with torch's own round-to-nearest-even conversion.
                want = want.to(torch_dtype[dname])
                converted += 1
            want = want.contiguous().reshape(-1).view(torch.uint8)
            got = received[name]
            if got.numel() != want.numel() or not torch.equal(got, want):
                diff = (got != want).nonzero() if got.numel() == want.numel() else None
                first = int(diff[0]) if diff is not None and diff.numel() else -1
                mismatches.append({"name": name, "why": "bytes differ", "first_byte": first})
            if len(mismatches) >= 20:
                break
    verdict = "PASS" if not mismatches else "FAIL"
    emit("RESULT", verdict=verdict, rank=args.rank, mode="packed" if packed else "non-packed",
         tensors=len(names), broadcasts=len(chunks), bytes=total, seconds=secs,
         gbps=total / max(secs, 1e-9) / 1e9, converted=converted, verified=not args.no_verify,
         mismatches=mismatches[:20], ready_seconds=t_ready - t_start)
    log("verdict %s" % verdict)
    nccl.lib.ncclCommDestroy(comm)
    del store
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    try:
        code = main()
    except Exception as e:  # report every failure as a verdict line
        import traceback
        traceback.print_exc()
        emit("RESULT", verdict="FAIL", error="%s: %s" % (type(e).__name__, e))
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
