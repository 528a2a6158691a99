"""rlflow_trainer: the trainer's side of rlflow's resident trainer protocol
(trainer/PROTOCOL.md, version 1) for any torch.nn.Module.

How to use it (the pipeline's trainer.command runs this script; rlflow's GPU
worker starts it with RLFLOW_TRAINER_FDS and RLFLOW_TRAINER_DEVICE set):

    import os; os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch
    import torch, rlflow_trainer
    dev = rlflow_trainer.device()                  # cuda:<RLFLOW_TRAINER_DEVICE>
    rlflow_trainer.seed_everything(0)              # the same initial weights on every start
    model = MyModel().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    def train_step(model, opt, batch, args):       # batch: the rollouts file's lines (dicts)
        loss = ...; loss.backward(); opt.step(); opt.zero_grad()
        return {"loss": loss.item()}               # metrics: name -> number
    rlflow_trainer.serve(model, opt, train_step, seed=0, device=dev)

Import it from the repository's trainer/python (PYTHONPATH or sys.path).

What serve() guarantees, and what it needs from you:

* Replays are bit for bit: a restarted trainer loads the last checkpoint
  (parameters, buffers, optimizer state, every RNG's state) and trains the
  journaled iterations again. So train_step must depend only on (model,
  optimizer, batch, args, the global RNGs): no state of its own (a running
  baseline, an LR scheduler) unless it lives in the model's state dict or
  the optimizer's. Build the model the same way on every start (seed first).
* deterministic=True (the default) turns on torch.use_deterministic_algorithms
  and cuDNN's deterministic mode. cuBLAS reads CUBLAS_WORKSPACE_CONFIG when
  its first handle is made: set it before importing torch (as above) or in
  the pipeline's trainer.env; serve() sets it when unset and warns when CUDA
  was already initialised (too late to be sure).
* Raise RequestError from train_step BEFORE touching the model to refuse a
  request (bad args): the trainer stays usable. Any other exception answers
  ok:false too, but the trainer's state is then unknown: it refuses train,
  publish and save until a load (the worker restarts it from its checkpoint).
* publish copies the state dict into one device buffer it exports by CUDA
  IPC; PYTORCH_CUDA_ALLOC_CONF expandable_segments:True cannot be exported
  (publish refuses it). The buffer is never freed while the process lives.
* stdout is yours; this module logs to stderr; the protocol uses fds 3 and 4.

The protocol loop (run, Session) does not import torch: its tests run
without it, with a test double in place of TorchBackend.
"""

import base64
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
import traceback

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 16 << 20  # one frame's JSON, the newline not counted

# A checkpoint directory: what save writes and load reads.
CHECKPOINT_FORMAT = "rlflow-trainer-checkpoint"
CHECKPOINT_VERSION = 1
MODEL_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
META_FILE = "meta.json"
MAX_META_BYTES = 1 << 20

PUBLISH_DTYPES = ("keep", "bfloat16", "float16")

# Item sizes of the dtypes a snapshot may hold (trainer/layout.go's
# itemSizes: the GPU worker refuses any other).
SNAPSHOT_ITEMSIZE = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}

# safetensors dtype names by torch dtype name.
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
    "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}

# The fields of each request besides id and op, with their types; the ones
# in OPTIONAL_FIELDS may be missing (train's args: {}, publish's ipc_refs:
# False).
REQUESTS = {
    "hello": {"protocol": int},
    "load": {"path": str},
    "train": {"iteration": int, "rollouts": str, "args": dict},
    "publish": {"version": str, "dtype": str, "ipc_refs": bool},
    "release": {"version": str},
    "save": {"path": str, "iteration": int},
    "shutdown": {},
}
OPTIONAL_FIELDS = {("train", "args"), ("publish", "ipc_refs")}

# The fake_shm snapshot's ipc_refs entries (PROTOCOL.md "publish"): a test
# double's ref-counter handle, which names no file.
FAKE_REF_COUNTER_HANDLE = b"fake_refcounter"


def log(msg):
    print("rlflow_trainer %s: %s" % (time.strftime("%H:%M:%S"), msg), file=sys.stderr, flush=True)


class RequestError(Exception):
    """A request refused with nothing changed: the reply is ok:false with
    this text and the trainer stays as it was. train_step may raise it before
    touching the model (e.g. for bad args)."""


class ProtocolError(Exception):
    """A frame the trainer cannot answer (no usable id, too long, not JSON):
    the pipe is out of step, so the trainer stops."""


# -- frames ---------------------------------------------------------------


class FrameReader:
    """Reads request frames (one JSON line each) from a file descriptor."""

    def __init__(self, fd):
        self.f = os.fdopen(fd, "rb", buffering=1 << 16, closefd=False)

    def next(self):
        """The next frame's bytes without the newline; None at end of file
        (a frame cut short by end of file is the worker gone, too)."""
        line = self.f.readline(MAX_FRAME_BYTES + 1)
        if not line:
            return None
        if not line.endswith(b"\n"):
            if len(line) > MAX_FRAME_BYTES:
                raise ProtocolError("a request frame is longer than %d MiB" % (MAX_FRAME_BYTES >> 20))
            log("end of file inside a request frame (%d bytes): the worker is gone" % len(line))
            return None
        return line[:-1]


def encode_frame(obj):
    """One reply frame, newline included. ASCII JSON (every other character
    escaped) and no NaN or infinity, which JSON has not."""
    return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii") + b"\n"


def write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _no_duplicates(pairs):
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise ValueError("key %r appears twice" % k[:64])
        obj[k] = v
    return obj


def _no_constant(name):
    raise ValueError("%s is not JSON" % name)


def decode_request(line):
    """A frame's JSON object; ProtocolError when the frame has no usable id
    (it cannot be answered in step)."""
    try:
        text = line.decode("utf-8")
        req = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError("a request frame is not a JSON object: %s" % e)
    if not isinstance(req, dict):
        raise ProtocolError("a request frame is a JSON %s, not an object" % type(req).__name__)
    rid = req.get("id")
    if not _is_int(rid) or rid <= 0:
        raise ProtocolError("a request frame has no positive integer id")
    return req


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def check_fields(req):
    """The request's op and fields, checked against REQUESTS: an unknown
    op or key, a missing field or a field of the wrong type is a
    RequestError naming it."""
    op = req.get("op")
    if not isinstance(op, str):
        raise RequestError("request field \"op\": want a string")
    spec = REQUESTS.get(op)
    if spec is None:
        raise RequestError("request field \"op\": unknown op %r (want one of %s)" % (op[:64], ", ".join(sorted(REQUESTS))))
    unknown = sorted(set(req) - set(spec) - {"id", "op"})
    if unknown:
        raise RequestError("%s request: unknown field %r" % (op, unknown[0][:64]))
    fields = {}
    for name, typ in spec.items():
        if name not in req:
            if (op, name) in OPTIONAL_FIELDS:
                fields[name] = typ()
                continue
            raise RequestError("%s request: field %r missing" % (op, name))
        v = req[name]
        ok = _is_int(v) if typ is int else isinstance(v, typ)
        if not ok:
            raise RequestError("%s request: field %r: want %s, got %s" % (op, name, _type_word(typ), _json_type(v)))
        fields[name] = v
    return op, fields


def _type_word(typ):
    return {int: "an integer", str: "a string", dict: "an object", bool: "a bool"}[typ]


def _json_type(v):
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a bool"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def error_text(e):
    """An exception as a reply's error: its type and message, bounded."""
    msg = str(e).strip()
    if isinstance(e, RequestError):
        text = msg
    else:
        text = "%s: %s" % (type(e).__name__, msg) if msg else type(e).__name__
    return text[:4000]


# -- the protocol's state -------------------------------------------------


def _abs_path(field, path):
    if not os.path.isabs(path):
        raise RequestError("field %r: not an absolute path" % field)
    return os.path.normpath(path)


def read_rollouts(path):
    """The rollouts JSONL as a list of dicts (blank lines skipped). Errors
    name the line, never its content."""
    path = _abs_path("rollouts", path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise RequestError("rollouts: cannot open %s: %s" % (path, e.strerror or e))
    batch = []
    with f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                raise RequestError("rollouts %s line %d: not JSON (%s)" % (path, n, type(e).__name__))
            if not isinstance(row, dict):
                raise RequestError("rollouts %s line %d: a JSON %s, not an object" % (path, n, _json_type(row)))
            batch.append(row)
    return batch


def check_metrics(metrics):
    """train_step's metrics as name -> float. None is no metrics; a value
    with .item() (a 0-dim tensor) is read; a bool, a non-number or a NaN or
    infinity is an error (JSON has no NaN, and a NaN loss is news)."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise ValueError("train_step returned %s, want a dict of metrics" % type(metrics).__name__)
    out = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise ValueError("train_step's metrics: a key of type %s, want str" % type(k).__name__)
        if hasattr(v, "item") and callable(v.item):
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError("train_step's metric %r is %s, want a number" % (k[:64], type(v).__name__))
        v = float(v)
        if not math.isfinite(v):
            raise ValueError("train_step's metric %r is %r" % (k[:64], v))
        out[k] = v
    return out


def _fsync_path(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(8 << 20)
            if not b:
                return h.hexdigest()
            h.update(b)


class Session:
    """The protocol's state and rules, over a backend that does the model's
    work (TorchBackend, or a test double with the same methods):

      framework() -> str; device_index() -> int
      train(batch, args) -> (metrics, step_done_unix)
      publish(dtype, ipc_refs) -> reply fields (ipc, handle or path,
          storage_bytes, storage_offset, device, gpu_uuid, tensors,
          snapshot_seconds, and ipc_refs, one per tensor, exactly when asked)
      write_checkpoint(tmpdir, iteration): writes MODEL_FILE and STATE_FILE
      read_checkpoint(path, iteration): restores them

    Invariants: iteration is the last trained (or loaded) one; published is
    the version not yet released (None: none); tainted says why the model's
    state is unknown (a train or load that failed midway): train, publish
    and save are then refused until a load succeeds."""

    def __init__(self, backend):
        self.backend = backend
        self.iteration = 0
        self.published = None
        self.tainted = None
        self.last_id = 0
        self.done = False

    def handle(self, req):
        """The reply to one decoded request (never raises)."""
        rid = req["id"]
        op = req.get("op") if isinstance(req.get("op"), str) else "?"
        t0 = time.perf_counter()
        try:
            if rid <= self.last_id:
                raise RequestError("request id %d: not above the previous id %d" % (rid, self.last_id))
            self.last_id = rid
            op, fields = check_fields(req)
            out = getattr(self, "op_" + op)(**fields)
            reply = {"id": rid, "ok": True}
            reply.update(out)
            log("%s (id %d): ok in %.3fs" % (op, rid, time.perf_counter() - t0))
            return reply
        except Exception as e:  # every failure is a reply; the loop goes on
            if not isinstance(e, RequestError):
                log("%s (id %d) failed:\n%s" % (op, rid, traceback.format_exc().rstrip()))
            text = error_text(e)
            log("%s (id %d): refused: %s" % (op, rid, text))
            return {"id": rid, "ok": False, "error": text}

    def _check_state(self, op):
        if self.tainted:
            raise RequestError("%s refused: the trainer's state is unknown after %s; load a checkpoint (or restart the trainer) first" % (op, self.tainted))

    def op_hello(self, protocol):
        if protocol != PROTOCOL_VERSION:
            raise RequestError("protocol %d: this trainer speaks protocol %d" % (protocol, PROTOCOL_VERSION))
        return {"protocol": PROTOCOL_VERSION, "pid": os.getpid(), "device": self.backend.device_index(),
                "framework": self.backend.framework(), "iteration": self.iteration}

    def op_train(self, iteration, rollouts, args):
        self._check_state("train")
        if iteration != self.iteration + 1:
            raise RequestError("train iteration %d: the trainer is at iteration %d, so the next is %d" % (iteration, self.iteration, self.iteration + 1))
        batch = read_rollouts(rollouts)
        t0 = time.perf_counter()
        try:
            metrics, step_done = self.backend.train(batch, args)
            metrics = check_metrics(metrics)
        except RequestError:
            raise
        except Exception as e:
            self.tainted = "the failed train of iteration %d (%s)" % (iteration, type(e).__name__)
            raise
        self.iteration = iteration
        return {"iteration": iteration, "metrics": metrics, "seconds": time.perf_counter() - t0,
                "step_done_unix": step_done}

    def op_publish(self, version, dtype, ipc_refs):
        self._check_state("publish")
        if not version:
            raise RequestError("publish request: field 'version' is empty")
        if dtype not in PUBLISH_DTYPES:
            raise RequestError("publish request: field 'dtype': %r, want one of %s" % (dtype[:64], ", ".join(PUBLISH_DTYPES)))
        if self.published is not None:
            raise RequestError("publish %r refused: version %r is published and not released" % (version[:200], self.published[:200]))
        out = self.backend.publish(dtype, ipc_refs)
        # The worker refuses a reply whose ipc_refs are there unasked or
        # not one per tensor: say it here, where the cause is.
        refs = out.get("ipc_refs")
        if not ipc_refs and "ipc_refs" in out:
            raise RuntimeError("the backend's publish gave ipc_refs that were not asked for")
        if ipc_refs and (not isinstance(refs, list) or len(refs) != len(out.get("tensors") or ())):
            raise RuntimeError("the backend's publish gave %s ipc_refs for %d tensors, want one per tensor"
                               % (len(refs) if isinstance(refs, list) else "no", len(out.get("tensors") or ())))
        self.published = version
        reply = {"version": version}
        reply.update(out)
        return reply

    def op_release(self, version):
        if self.published is None:
            raise RequestError("release %r: no version is published" % version[:200])
        if version != self.published:
            raise RequestError("release %r: the published version is %r" % (version[:200], self.published[:200]))
        self.published = None
        return {}

    def op_save(self, path, iteration):
        self._check_state("save")
        if iteration != self.iteration:
            raise RequestError("save at iteration %d: the trainer is at iteration %d" % (iteration, self.iteration))
        path = _abs_path("path", path)
        parent, base = os.path.split(path)
        if not base:
            raise RequestError("field 'path': names no directory")
        if not os.path.isdir(parent):
            raise RequestError("save: the parent directory %s does not exist" % parent)
        if os.path.lexists(path):
            raise RequestError("save: %s exists already" % path)
        t0 = time.perf_counter()
        tmp = os.path.join(parent, ".%s.tmp-%d" % (base, os.getpid()))
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)
        os.mkdir(tmp)
        try:
            self.backend.write_checkpoint(tmp, iteration)
            files = {}
            for name in sorted(os.listdir(tmp)):
                p = os.path.join(tmp, name)
                if not os.path.isfile(p) or os.path.islink(p):
                    raise RuntimeError("the checkpoint holds %s, not a regular file" % name)
                files[name] = {"bytes": os.path.getsize(p), "sha256": _sha256_file(p)}
            for need in (MODEL_FILE, STATE_FILE):
                if need not in files:
                    raise RuntimeError("the backend wrote no %s" % need)
            meta = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "iteration": iteration,
                    "protocol": PROTOCOL_VERSION, "framework": self.backend.framework(), "files": files}
            with open(os.path.join(tmp, META_FILE), "w") as f:
                json.dump(meta, f, indent=1, sort_keys=True)
                f.write("\n")
            for name in os.listdir(tmp):
                _fsync_path(os.path.join(tmp, name))
            _fsync_path(tmp, directory=True)
            if os.path.lexists(path):  # rename would replace an empty directory
                raise RequestError("save: %s appeared while saving" % path)
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_path(parent, directory=True)
        total = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
        return {"path": path, "bytes": total, "seconds": time.perf_counter() - t0}

    def op_load(self, path):
        path = _abs_path("path", path)
        t0 = time.perf_counter()
        meta = read_meta(path)
        for name, want in sorted(meta["files"].items()):
            p = os.path.join(path, name)
            if not os.path.isfile(p):
                raise RequestError("load %s: %s is missing" % (path, name))
            if os.path.getsize(p) != want["bytes"] or _sha256_file(p) != want["sha256"]:
                raise RequestError("load %s: %s is not the file save wrote (size or SHA-256 differ)" % (path, name))
        try:
            self.backend.read_checkpoint(path, meta["iteration"])
        except RequestError:
            raise
        except Exception as e:
            self.tainted = "the failed load of %s (%s)" % (path, type(e).__name__)
            raise
        self.iteration = meta["iteration"]
        self.tainted = None
        return {"iteration": self.iteration, "seconds": time.perf_counter() - t0}

    def op_shutdown(self):
        self.done = True
        return {}


def read_meta(path):
    """A checkpoint's meta.json, checked: format, version, iteration and the
    files it lists (plain names with their size and SHA-256)."""
    p = os.path.join(path, META_FILE)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_META_BYTES + 1)
    except OSError as e:
        raise RequestError("load %s: cannot read %s: %s" % (path, META_FILE, e.strerror or e))
    if len(raw) > MAX_META_BYTES:
        raise RequestError("load %s: %s is larger than %d bytes" % (path, META_FILE, MAX_META_BYTES))
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise RequestError("load %s: %s is not JSON" % (path, META_FILE))
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise RequestError("load %s: %s is not an rlflow trainer checkpoint's" % (path, META_FILE))
    if meta.get("version") != CHECKPOINT_VERSION:
        raise RequestError("load %s: checkpoint format version %r, this trainer reads %d" % (path, meta.get("version"), CHECKPOINT_VERSION))
    it = meta.get("iteration")
    if not _is_int(it) or it < 0:
        raise RequestError("load %s: %s field 'iteration': want an integer >= 0" % (path, META_FILE))
    files = meta.get("files")
    if not isinstance(files, dict) or MODEL_FILE not in files or STATE_FILE not in files:
        raise RequestError("load %s: %s lists no %s and %s" % (path, META_FILE, MODEL_FILE, STATE_FILE))
    for name, want in files.items():
        if "/" in name or name in (".", "..", META_FILE) or not isinstance(want, dict) \
                or not _is_int(want.get("bytes")) or not isinstance(want.get("sha256"), str):
            raise RequestError("load %s: %s field 'files': a bad entry" % (path, META_FILE))
    return meta


def run(backend, rfd, wfd):
    """The protocol loop: a reply per request, in order, until shutdown
    ("shutdown") or end of file ("eof"). ProtocolError for a frame that
    cannot be answered."""
    session = Session(backend)
    reader = FrameReader(rfd)
    while True:
        line = reader.next()
        if line is None:
            log("end of file on the request pipe: the GPU worker is gone; exiting")
            return "eof"
        req = decode_request(line)
        reply = session.handle(req)
        try:
            frame = encode_frame(reply)
        except ValueError as e:  # a NaN or such that slipped through
            frame = encode_frame({"id": req["id"], "ok": False, "error": "the reply cannot be encoded as JSON: %s" % e})
        if len(frame) - 1 > MAX_FRAME_BYTES:
            frame = encode_frame({"id": req["id"], "ok": False,
                                  "error": "the reply is %d bytes, more than the %d MiB a frame may hold" % (len(frame) - 1, MAX_FRAME_BYTES >> 20)})
        write_all(wfd, frame)
        if session.done:
            log("shutdown: exiting")
            return "shutdown"


def trainer_fds(environ=None):
    """The request and reply file descriptors from RLFLOW_TRAINER_FDS ("3,4")."""
    env = os.environ if environ is None else environ
    v = env.get("RLFLOW_TRAINER_FDS")
    if not v:
        raise SystemExit("rlflow_trainer: RLFLOW_TRAINER_FDS is not set: this program is started by rlflow's GPU worker "
                         "(pipeline trainer.command), which passes its request and reply pipes")
    parts = v.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise SystemExit("rlflow_trainer: RLFLOW_TRAINER_FDS=%r: want two file descriptors, e.g. 3,4" % v)
    return int(parts[0]), int(parts[1])


# -- pure helpers (no torch) ------------------------------------------------


def plan_layout(entries):
    """The snapshot layout of (dtype name, shape) entries in state-dict
    order: a list of (offset, bytes) and the total. Each tensor starts at
    the next multiple of its item size (PROTOCOL.md "publish")."""
    out, end = [], 0
    for dtype, shape in entries:
        size = SNAPSHOT_ITEMSIZE[dtype]
        n = size
        for d in shape:
            n *= int(d)
        off = (end + size - 1) // size * size
        out.append((off, n))
        end = off + n
    return out, end


def expandable_segments_on(environ=None):
    """Whether the CUDA allocator config turns expandable segments on
    (PYTORCH_CUDA_ALLOC_CONF, or PYTORCH_ALLOC_CONF of newer torch): their
    memory cannot be opened by cudaIpcOpenMemHandle."""
    env = os.environ if environ is None else environ
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in (env.get(var) or "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() in ("true", "1"):
                return True
    return False


_UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def gpu_uuid_text(raw):
    """A GPU UUID as the protocol spells it (lowercase 8-4-4-4-12 hex, no
    "GPU-"), from torch's device property (text or 16 bytes); None when it
    is neither."""
    if raw is None:
        return None
    if isinstance(raw, (bytes, bytearray)):
        if len(raw) != 16:
            return None
        h = bytes(raw).hex()
    else:
        s = str(raw).strip().lower()
        if s.startswith("gpu-"):
            s = s[4:]
        h = s.replace("-", "")
    if not re.fullmatch(r"[0-9a-f]{32}", h):
        return None
    s = "%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:])
    return s if _UUID_RE.match(s) else None


def torch_share(share):
    """storage._share_cuda_()'s whole tuple as JSON (bytes in base64): what
    torch's own importer (UntypedStorage._new_shared_cuda) takes, for a
    Python reader; the worker needs only handle and the offsets."""
    b64 = lambda b: None if b is None else base64.b64encode(bytes(b)).decode("ascii")  # noqa: E731
    return {"device": int(share[0]), "handle": b64(share[1]), "size": int(share[2]), "offset": int(share[3]),
            "ref_counter_handle": b64(share[4]), "ref_counter_offset": int(share[5]),
            "event_handle": b64(share[6]), "event_sync_required": bool(share[7])}


def ipc_ref_entry(share):
    """One ipc_refs entry of a publish reply (PROTOCOL.md) from a
    storage._share_cuda_() tuple: its ref-counter handle and offset, event
    handle (None stays None) and event_sync_required."""
    b64 = lambda b: None if b is None else base64.b64encode(bytes(b)).decode("ascii")  # noqa: E731
    return {"ref_counter_handle": b64(share[4]), "ref_counter_offset": int(share[5]),
            "event_handle": b64(share[6]), "event_sync_required": bool(share[7])}


def check_share_matches(share, i, device, handle, size, offset):
    """A _share_cuda_() tuple made for tensor i's ipc_refs entry must name
    the storage the reply names (device, handle, storage_bytes,
    storage_offset): a RequestError naming what differs otherwise."""
    want = (("device", device), ("handle", bytes(handle)), ("size", size), ("offset", offset))
    got = (int(share[0]), bytes(share[1]), int(share[2]), int(share[3]))
    differ = [name for (name, w), g in zip(want, got) if w != g]
    if differ:
        raise RequestError("publish: torch changed the export under us: the _share_cuda_() call for tensor %d "
                           "gave another %s than the reply's" % (i, " and ".join(differ)))


def share_refs(storage, n, device, handle, size, offset):
    """n ipc_refs entries, each from a _share_cuda_() call of its own on
    storage: every call takes its own ref-counter slot, as torch's
    reduce_tensor does per tensor (the receiver releases one per tensor)."""
    refs = []
    for i in range(n):
        share = storage._share_cuda_()
        check_share_matches(share, i, device, handle, size, offset)
        refs.append(ipc_ref_entry(share))
    return refs


def check_share_handle(handle):
    """torch's shareable handle (storage._share_cuda_()[1]) must name a
    cudaMalloc block: 64 raw bytes, or a version byte, 'c' and 64 bytes."""
    if len(handle) == 64:
        return
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise RequestError("publish: the snapshot buffer lies in an expandable segment, which CUDA IPC cannot export: "
                           "run the trainer with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")
    if len(handle) != 66 or handle[1:2] != b"c":
        raise RequestError("publish: torch's IPC handle is %d bytes of an unknown kind (type byte %r): want a cudaMalloc block"
                           % (len(handle), handle[1:2]))


def encode_safetensors_header(entries, metadata=None):
    """The safetensors header for (name, torch dtype name, shape, nbytes)
    entries laid out back to back in the given order: the 8-byte
    little-endian length and the JSON, padded with spaces to a multiple of
    8 bytes."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": [int(d) for d in shape], "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def decode_safetensors_header(f):
    """The (name, torch dtype name, shape, begin, end) entries of a
    safetensors file open at its start, with begin and end absolute file
    offsets, and the metadata."""
    n = int.from_bytes(f.read(8), "little")
    if n <= 0 or n > 100 << 20:
        raise ValueError("safetensors header length %d" % n)
    header = json.loads(f.read(n).decode("utf-8"))
    meta = header.pop("__metadata__", None) or {}
    out = []
    for name, h in header.items():
        b, e = h["data_offsets"]
        out.append((name, TORCH_DTYPES[h["dtype"]], list(h["shape"]), 8 + n + b, 8 + n + e))
    out.sort(key=lambda x: x[3])
    return out, meta


# -- torch ------------------------------------------------------------------


def trainer_device():
    """The torch device the GPU worker gave this trainer (cuda:<N> from
    RLFLOW_TRAINER_DEVICE); without it, the current CUDA device, or the CPU
    when there is no CUDA (tests)."""
    import torch
    v = os.environ.get("RLFLOW_TRAINER_DEVICE", "").strip()
    if v:
        if not v.isdigit():
            raise ValueError("RLFLOW_TRAINER_DEVICE=%r: want a CUDA ordinal" % v)
        return torch.device("cuda", int(v))
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


device = trainer_device  # the name the module doc uses; serve's parameter shadows it


def seed_everything(seed):
    """Seeds Python's random, numpy's global RNG (when numpy is there),
    torch's CPU RNG and every CUDA device's."""
    import torch
    random.seed(seed)
    try:
        import numpy
        numpy.random.seed(seed % (1 << 32))
    except ImportError:
        pass
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def enable_determinism(torch):
    """Deterministic kernels (PROTOCOL.md's replays must be bit for bit)."""
    if not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            log("warning: CUBLAS_WORKSPACE_CONFIG was unset and CUDA is initialised already: set it to :4096:8 "
                "before importing torch (or in trainer.env), or cuBLAS may not be deterministic")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def dtype_name(dt):
    return str(dt).rsplit(".", 1)[-1]


def rng_state(torch):
    """Every global RNG's state, in types torch.load(weights_only=True) reads."""
    st = {"python": random.getstate(), "torch_cpu": torch.get_rng_state(), "torch_cuda": [], "numpy": None}
    if torch.cuda.is_available():
        st["torch_cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        st["numpy"] = [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return st


def set_rng_state(torch, st):
    version, internal, gauss = st["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(st["torch_cpu"].cpu())
    cuda = st["torch_cuda"]
    if cuda:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < len(cuda):
            log("warning: the checkpoint holds the RNG state of %d CUDA devices, %d are visible: restoring those" % (len(cuda), have))
        for i, s in enumerate(cuda[:have]):
            torch.cuda.set_rng_state(s.cpu(), i)
    if st.get("numpy") is not None:
        try:
            import numpy
        except ImportError:
            log("warning: the checkpoint holds numpy's RNG state and numpy is not importable")
        else:
            name, keys, pos, has_gauss, cached = st["numpy"]
            numpy.random.set_state((name, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))


def _tensor_bytes(t):
    """A CPU contiguous tensor's bytes (no numpy needed)."""
    import ctypes
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def save_safetensors(torch, tensors, path):
    """tensors (name -> CPU contiguous tensor, distinct storages) as a
    safetensors file: safetensors' own writer when importable, else ours."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        save_file = None
    if save_file is not None:
        save_file(tensors, path, metadata={"format": "pt"})
        return
    entries = [(k, dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size()) for k, t in tensors.items()]
    with open(path, "wb") as f:
        f.write(encode_safetensors_header(entries, {"format": "pt"}))
        for t in tensors.values():
            f.write(_tensor_bytes(t))


def load_safetensors(torch, path):
    """A safetensors file as name -> CPU tensor."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        load_file = None
    if load_file is not None:
        return load_file(path, device="cpu")
    out = {}
    with open(path, "rb") as f:
        entries, _ = decode_safetensors_header(f)
        for name, dt, shape, b, e in entries:
            f.seek(b)
            raw = f.read(e - b)
            if len(raw) != e - b:
                raise ValueError("%s: %s is cut short" % (path, name))
            tdt = getattr(torch, dt)
            if not raw:
                out[name] = torch.empty(shape, dtype=tdt)
            else:
                out[name] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(tdt).reshape(shape)
    return out


def pack_into(buf, plan, layout):
    """Copies each (name, source tensor, target dtype) of plan into the
    uint8 tensor buf at its (offset, bytes) of layout, through a view of
    the target dtype and the source's shape (copy_ casts, e.g. float32 to
    bfloat16 rounding to nearest even, as .to() does)."""
    for (_, t, tdt), (off, n) in zip(plan, layout):
        if n:
            buf[off:off + n].view(tdt).view(t.shape).copy_(t)


class _Buffer:
    """One snapshot buffer and its export (storage._share_cuda_())."""

    def __init__(self, tensor, share):
        self.tensor, self.share = tensor, share
        self.capacity = tensor.numel()


class TorchBackend:
    """Session's backend for a torch.nn.Module and its optimizer."""

    def __init__(self, model, optimizer, train_step, dev):
        import torch
        self.torch, self.model, self.optimizer, self.train_step, self.dev = torch, model, optimizer, train_step, dev
        self.snapshot = None  # the current _Buffer
        # Every buffer ever exported stays referenced until the process
        # exits: the worker may still map one, and freeing it would hand
        # the memory to the caching allocator under the worker's feet.
        self.exported = []
        self.side = None

    def framework(self):
        return "torch " + self.torch.__version__

    def device_index(self):
        return self.dev.index if self.dev.type == "cuda" else 0

    def sync(self):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize(self.dev)

    def state_items(self):
        items = list(self.model.state_dict().items())
        for name, t in items:
            if not isinstance(t, self.torch.Tensor):
                raise RequestError("state_dict entry %r is a %s, not a tensor" % (name, type(t).__name__))
        return items

    def train(self, batch, args):
        metrics = self.train_step(self.model, self.optimizer, batch, args)
        self.sync()
        return metrics, time.time()

    # -- publish --

    def _buffer(self, total):
        """The snapshot buffer, grown to total bytes when smaller."""
        torch = self.torch
        if self.snapshot is not None and self.snapshot.capacity >= total:
            return self.snapshot
        if expandable_segments_on():
            raise RequestError("publish: PYTORCH_CUDA_ALLOC_CONF turns expandable segments on, whose memory CUDA IPC "
                               "cannot export: run the trainer with expandable_segments:False")
        backend = torch.cuda.get_allocator_backend()
        if backend != "native":
            raise RequestError("publish: the CUDA allocator backend is %r; CUDA IPC export needs the native caching allocator" % backend)
        buf = torch.empty(total, dtype=torch.uint8, device=self.dev)
        self.exported.append(buf)
        share = buf.untyped_storage()._share_cuda_()
        check_share_handle(share[1])
        if share[2] < total:
            raise RuntimeError("the exported storage holds %d bytes, the snapshot needs %d" % (share[2], total))
        self.snapshot = _Buffer(buf, share)
        log("snapshot buffer: %d bytes on %s, storage offset %d in its block" % (total, self.dev, share[3]))
        return self.snapshot

    def publish(self, dtype, ipc_refs=False):
        torch = self.torch
        if self.dev.type != "cuda":
            raise RequestError("publish needs a CUDA device; the trainer runs on %s" % self.dev)
        items = self.state_items()
        if not items:
            raise RequestError("publish: the model's state dict is empty")
        cast = None if dtype == "keep" else getattr(torch, dtype)
        plan = []  # (name, source, target dtype)
        for name, t in items:
            tdt = cast if (cast is not None and t.dtype == torch.float32) else t.dtype
            if dtype_name(tdt) not in SNAPSHOT_ITEMSIZE:
                raise RequestError("publish: state_dict entry %r is %s, which a snapshot cannot hold" % (name, dtype_name(tdt)))
            if t.device != self.dev:
                raise RequestError("publish: state_dict entry %r is on %s, not %s" % (name, t.device, self.dev))
            plan.append((name, t, tdt))
        layout, total = plan_layout([(dtype_name(tdt), list(t.shape)) for _, t, tdt in plan])
        snap = self._buffer(max(total, 1))
        buf = snap.tensor
        if self.side is None:
            self.side = torch.cuda.Stream(device=self.dev)
        t0 = time.perf_counter()
        self.side.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.no_grad(), torch.cuda.stream(self.side):
            pack_into(buf, plan, layout)
        self.side.synchronize()
        seconds = time.perf_counter() - t0
        share = snap.share
        try:
            uuid = gpu_uuid_text(getattr(torch.cuda.get_device_properties(self.dev), "uuid", None))
        except Exception:  # an older torch: the worker reads it without
            uuid = None
        out = {
            "ipc": "cuda",
            "handle": base64.b64encode(bytes(share[1])).decode("ascii"),
            "storage_bytes": int(share[2]),
            "storage_offset": int(share[3]),
            "device": self.device_index(),
            "gpu_uuid": uuid,
            "tensors": [{"name": name, "dtype": dtype_name(tdt), "shape": [int(d) for d in t.shape], "offset": off, "bytes": n}
                        for (name, t, tdt), (off, n) in zip(plan, layout)],
            "snapshot_seconds": seconds,
            "torch_share": torch_share(share),
        }
        if ipc_refs:
            # After the copies completed (the events torch records are
            # then past them). The slots live as long as the buffer.
            out["ipc_refs"] = share_refs(buf.untyped_storage(), len(plan), out["device"], share[1],
                                         out["storage_bytes"], out["storage_offset"])
        return out

    # -- checkpoints --

    def write_checkpoint(self, tmp, iteration):
        torch = self.torch
        tensors = {}
        for name, t in self.state_items():
            # copy=True: distinct storages even for tied weights on the CPU
            tensors[name] = t.detach().to("cpu", copy=True).contiguous()
        save_safetensors(torch, tensors, os.path.join(tmp, MODEL_FILE))
        state = {"iteration": iteration, "optimizer": self.optimizer.state_dict(), "rng": rng_state(torch)}
        torch.save(state, os.path.join(tmp, STATE_FILE))

    def read_checkpoint(self, path, iteration):
        torch = self.torch
        sd = load_safetensors(torch, os.path.join(path, MODEL_FILE))
        # The map to the CPU keeps the RNG states CPU tensors (set_rng_state
        # wants them there); optimizer.load_state_dict moves each state
        # tensor where torch's own policy puts it (param's device; Adam's
        # step stays on the CPU unless capturable or fused), as before save.
        # weights_only: plain types and tensors only (torch 1.x's restricted
        # unpickler cannot even read the floats of an optimizer's groups).
        safe = int(torch.__version__.split(".")[0]) >= 2
        state = torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=safe)
        if state.get("iteration") != iteration:
            raise RequestError("load %s: %s is of iteration %r, meta.json says %d" % (path, STATE_FILE, state.get("iteration"), iteration))
        have = dict(self.state_items())
        if set(have) != set(sd):
            missing, extra = sorted(set(have) - set(sd)), sorted(set(sd) - set(have))
            raise RequestError("load %s: the checkpoint's tensors differ from the model's (missing %s, unexpected %s)"
                               % (path, missing[:3], extra[:3]))
        for name, t in have.items():
            if sd[name].dtype != t.dtype or tuple(sd[name].shape) != tuple(t.shape):
                raise RequestError("load %s: %r is %s %s in the checkpoint, %s %s in the model"
                                   % (path, name, dtype_name(sd[name].dtype), list(sd[name].shape), dtype_name(t.dtype), list(t.shape)))
        with torch.no_grad():
            self.model.load_state_dict(sd, strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        set_rng_state(torch, state["rng"])
        self.sync()


def _check_model_device(model, dev):
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.device != dev:
                raise ValueError("rlflow_trainer.serve: %s %r is on %s, not on the trainer's device %s" % (kind, name, t.device, dev))


def serve(model, optimizer, train_step, *, seed=0, device=None, deterministic=True):
    """train_step(model, optimizer, batch: list[dict], args: dict) -> dict[str, float] of metrics.
    Runs the protocol loop on fds from RLFLOW_TRAINER_FDS until shutdown or EOF.

    device: the model's torch.device (default: trainer_device()); every
    parameter and buffer must be there. seed: every global RNG is seeded
    with it before the first request. Returns "shutdown" or "eof"; raises
    ProtocolError for a frame it cannot answer (the pipe is out of step)."""
    rfd, wfd = trainer_fds()
    import torch
    if deterministic:
        enable_determinism(torch)
    dev = trainer_device() if device is None else torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    _check_model_device(model, dev)
    if expandable_segments_on():
        log("warning: expandable segments are on (PYTORCH_CUDA_ALLOC_CONF): publish will refuse to export")
    seed_everything(seed)
    backend = TorchBackend(model, optimizer, train_step, dev)
    log("serving protocol %d on fds %d,%d: torch %s on %s, deterministic=%s, seed %d, pid %d"
        % (PROTOCOL_VERSION, rfd, wfd, torch.__version__, dev, deterministic, seed, os.getpid()))
    return run(backend, rfd, wfd)
