#!/usr/bin/env python3
"""Tests of rlflow_trainer (trainer/PROTOCOL.md's trainer side).

    python3 trainer/python/test_rlflow_trainer.py -v      # or: python3 -m pytest trainer/python

Without torch: the frames, the request rules, the protocol's state (train
order, publish/release, save/load directories, the state a failed train
leaves) through FakeBackend (a TEST DOUBLE of TorchBackend), over real pipes
in a child process, and the pure helpers (layout, safetensors header, GPU
UUID, allocator config). The torch tests skip, saying so.

With torch (CPU is enough): a save/load round trip restores training bit for
bit (train 2, save, train 2; load, train the same 2: identical bytes).

With CUDA (the GPU host): the same round trip on the GPU in deterministic
mode; publish's snapshot read back by a second process through the CUDA IPC
handle of the reply alone (cudaIpcOpenMemHandle + storage_offset, as the Go
importer does), byte-exact against the state dict, cast to bfloat16, the
buffer reused across publishes and untouched until release; a publish with
ipc_refs rebuilt tensor by tensor by another process with torch's
rebuild_cuda_tensor (as vLLM's ipc backend does), each ref-counter slot
released once; serve() end to end over real pipes; expandable segments
refused.
"""

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# cuBLAS reads it when its first handle is made: before torch is imported
# (the deterministic round trip needs it).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import rlflow_trainer as rt  # noqa: E402

torch = None
# The protocol children (--child-fake) run the loop over the model double:
# importing torch and initialising CUDA in each would cost seconds apiece.
if "--child-fake" not in sys.argv:
    try:
        import torch
    except ImportError:  # the CPU-only CI machine
        pass
HAVE_CUDA = torch is not None and torch.cuda.is_available()
NO_TORCH = "torch is not importable by %s: torch tests skipped (run them on the GPU host)" % sys.executable
NO_CUDA = "no CUDA device (torch %s): CUDA tests skipped" % (torch.__version__ if torch is not None else "absent")


# -- the worker's side, for the tests -----------------------------------------


class Driver:
    """Plays the GPU worker: starts argv with the request and reply pipes
    (RLFLOW_TRAINER_FDS) and sends one request at a time."""

    def __init__(self, argv, env=None, timeout=120):
        req_r, self.req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        env = dict(os.environ if env is None else env)
        env["RLFLOW_TRAINER_FDS"] = "%d,%d" % (req_r, rep_w)
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, env=env, pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=self.stderr)
        os.close(req_r)
        os.close(rep_w)
        self.replies = os.fdopen(rep_r, "rb")
        self.next_id = 0
        self.timeout = timeout
        self._log = ""

    def send_raw(self, data):
        os.write(self.req_w, data)

    def reply(self):
        line = self.replies.readline()
        if not line:
            raise AssertionError("the trainer closed its reply pipe; its stderr:\n" + self.log())
        return json.loads(line)

    def call(self, op, **fields):
        self.next_id += 1
        req = {"id": self.next_id, "op": op}
        req.update(fields)
        self.send_raw(json.dumps(req).encode() + b"\n")
        rep = self.reply()
        if rep.get("id") != self.next_id:
            raise AssertionError("reply id %r, want %d" % (rep.get("id"), self.next_id))
        return rep

    def ok(self, op, **fields):
        rep = self.call(op, **fields)
        if not rep.get("ok"):
            raise AssertionError("%s refused: %s\ntrainer stderr:\n%s" % (op, rep.get("error"), self.log()))
        return rep

    def close(self):
        """Closes the request pipe (end of file) and returns the exit status."""
        try:
            os.close(self.req_w)
        except OSError:
            pass
        try:
            return self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # the trainer this Driver started
            self.proc.wait()
            raise AssertionError("the trainer did not exit within %ds of end of file" % self.timeout)
        finally:
            if not self.replies.closed:
                self.replies.close()
            if not self.stderr.closed:
                self._log = self.log()
                self.stderr.close()

    def log(self):
        if self.stderr.closed:
            return self._log
        self.stderr.seek(0)
        return self.stderr.read().decode("utf-8", "replace")


def write_rollouts(dirname, name, rows):
    path = os.path.join(dirname, name)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


# -- FakeBackend: the TEST DOUBLE of TorchBackend -----------------------------


class FakeBackend:
    """TEST DOUBLE of TorchBackend. The "model" is a list of numbers: train
    appends the batch size; args steer failures ({"fail": "request"} raises
    RequestError before touching the model, "runtime" changes the model then
    raises, "nan" returns a NaN metric, "bool" a bool one; "sleep" waits).
    publish answers a fake_shm snapshot of two tensors, with the fake_shm
    ipc_refs when asked; mangle_publish, when set, edits its reply."""

    def __init__(self):
        self.weights = [7]
        self.publishes = []
        self.mangle_publish = None

    def framework(self):
        return "fake 1.0"

    def device_index(self):
        return 3

    def train(self, batch, args):
        fail = args.get("fail")
        if fail == "request":
            raise rt.RequestError("bad args: %s" % sorted(args))
        self.weights.append(len(batch))
        if fail == "runtime":
            raise RuntimeError("boom at %d" % len(self.weights))
        if fail == "nan":
            return {"loss": float("nan")}, time.time()
        if fail == "bool":
            return {"done": True}, time.time()
        return {"loss": 1.0 / max(1, len(batch)), "samples": len(batch)}, time.time()

    def publish(self, dtype, ipc_refs):
        self.publishes.append(dtype)
        out = {"ipc": "fake_shm", "path": "/dev/shm/rlflow-fake", "storage_bytes": 12, "storage_offset": 0,
               "device": 3, "gpu_uuid": None, "snapshot_seconds": 0.0,
               "tensors": [{"name": "w", "dtype": "float32", "shape": [2], "offset": 0, "bytes": 8},
                           {"name": "b", "dtype": "bfloat16", "shape": [2], "offset": 8, "bytes": 4}]}
        if ipc_refs:
            out["ipc_refs"] = fake_refs(len(out["tensors"]))
        if self.mangle_publish is not None:
            self.mangle_publish(out)
        return out

    def write_checkpoint(self, tmp, iteration):
        if self.weights and self.weights[-1] == -99:
            raise OSError("disk full (test)")
        with open(os.path.join(tmp, rt.MODEL_FILE), "w") as f:
            json.dump(self.weights, f)
        with open(os.path.join(tmp, rt.STATE_FILE), "w") as f:
            json.dump({"iteration": iteration}, f)

    def read_checkpoint(self, path, iteration):
        with open(os.path.join(path, rt.STATE_FILE)) as f:
            if json.load(f)["iteration"] != iteration:
                raise rt.RequestError("iteration mismatch")
        with open(os.path.join(path, rt.MODEL_FILE)) as f:
            self.weights = json.load(f)


def fake_refs(n):
    """A fake_shm snapshot's ipc_refs for n tensors (PROTOCOL.md): the fake
    ref-counter handle, slots 0 to n-1, no event."""
    return [rt.ipc_ref_entry((3, b"", 0, 0, rt.FAKE_REF_COUNTER_HANDLE, i, None, False)) for i in range(n)]


FAKE_REFS_2 = [{"ref_counter_handle": "ZmFrZV9yZWZjb3VudGVy", "ref_counter_offset": 0, "event_handle": None, "event_sync_required": False},
               {"ref_counter_handle": "ZmFrZV9yZWZjb3VudGVy", "ref_counter_offset": 1, "event_handle": None, "event_sync_required": False}]


def child_fake():
    """--child-fake: the protocol loop over FakeBackend on RLFLOW_TRAINER_FDS."""
    r, w = rt.trainer_fds()
    reason = rt.run(FakeBackend(), r, w)
    rt.log("run ended: " + reason)
    return 0


class Call:
    """In-process requests to a Session (no pipes)."""

    def __init__(self, backend=None):
        self.backend = backend or FakeBackend()
        self.s = rt.Session(self.backend)
        self.next_id = 0

    def __call__(self, op, **fields):
        self.next_id += 1
        req = {"id": self.next_id, "op": op}
        req.update(fields)
        return self.s.handle(req)


def setUpModule():
    """In-process sessions log to a list (children log to their stderr,
    which the tests read): RLFLOW_TRAINER_TEST_LOG=1 prints it instead."""
    if os.environ.get("RLFLOW_TRAINER_TEST_LOG") != "1":
        rt.log = LOGGED.append


LOGGED = []


# -- tests without torch ---------------------------------------------------------


class PipeProtocolTest(unittest.TestCase):
    """The loop in a child process over real pipes, as the worker runs it."""

    def start(self):
        d = Driver([sys.executable, os.path.abspath(__file__), "--child-fake"])
        self.addCleanup(d.close)
        return d

    def test_session_over_pipes(self):
        tmp = tempfile.mkdtemp(prefix="rlflow-trainer-test-")
        ro = write_rollouts(tmp, "r.jsonl", [{"prompt": "a", "text": "b"}, {"prompt": "c", "text": "d"}])
        d = self.start()
        h = d.ok("hello", protocol=1)
        self.assertEqual((h["protocol"], h["device"], h["framework"], h["iteration"]), (1, 3, "fake 1.0", 0))
        self.assertGreater(h["pid"], 0)
        t = d.ok("train", iteration=1, rollouts=ro, args={})
        self.assertEqual(t["iteration"], 1)
        self.assertEqual(t["metrics"], {"loss": 0.5, "samples": 2.0})
        self.assertGreaterEqual(t["seconds"], 0)
        self.assertLess(abs(t["step_done_unix"] - time.time()), 60)
        self.assertEqual(d.call("train", iteration=3, rollouts=ro),
                         {"id": 3, "ok": False, "error": "train iteration 3: the trainer is at iteration 1, so the next is 2"})
        p = d.ok("publish", version="v1", dtype="bfloat16")
        self.assertEqual((p["version"], p["ipc"], p["storage_bytes"]), ("v1", "fake_shm", 12))
        self.assertNotIn("ipc_refs", p)
        self.assertFalse(d.call("publish", version="v2", dtype="keep")["ok"])
        d.ok("release", version="v1")
        p = d.ok("publish", version="v1r", dtype="keep", ipc_refs=True)
        self.assertEqual(p["ipc_refs"], FAKE_REFS_2)
        d.ok("release", version="v1r")
        ck = os.path.join(tmp, "ckpt-1")
        s = d.ok("save", path=ck, iteration=1)
        self.assertEqual(s["path"], ck)
        self.assertGreater(s["bytes"], 0)
        self.assertEqual(d.ok("load", path=ck)["iteration"], 1)
        d.ok("shutdown")
        self.assertEqual(d.close(), 0)
        self.assertIn("shutdown: exiting", d.log())

    def test_end_of_file_exits_zero(self):
        d = self.start()
        d.ok("hello", protocol=1)
        self.assertEqual(d.close(), 0)
        self.assertIn("the GPU worker is gone", d.log())

    def test_frames_without_an_answerable_id_stop_the_trainer(self):
        for name, frame, want in (
                ("not JSON", b"{nope\n", "not a JSON object"),
                ("an array", b"[1]\n", "not an object"),
                ("no id", b'{"op":"hello","protocol":1}\n', "no positive integer id"),
                ("id zero", b'{"id":0,"op":"hello","protocol":1}\n', "no positive integer id"),
                ("bool id", b'{"id":true,"op":"hello","protocol":1}\n', "no positive integer id"),
                ("NaN", b'{"id":1,"op":"hello","protocol":NaN}\n', "NaN is not JSON"),
                ("duplicate key", b'{"id":1,"op":"hello","protocol":1,"protocol":1}\n', "appears twice"),
                ("not UTF-8", b'{"id":1,"op":"\xff"}\n', "not a JSON object")):
            with self.subTest(name):
                d = self.start()
                d.send_raw(frame)
                self.assertEqual(d.replies.readline(), b"")  # no reply, the pipe closes
                self.assertNotEqual(d.close(), 0)
                self.assertIn(want, d.log())

    def test_frame_size_limit(self):
        # A frame of exactly MAX_FRAME_BYTES is read (and answered: the pad
        # is an unknown key); one byte more stops the trainer.
        d = self.start()
        head = b'{"id":1,"op":"hello","protocol":1,"pad":"'
        tail = b'"}'
        frame = head + b"x" * (rt.MAX_FRAME_BYTES - len(head) - len(tail)) + tail
        self.assertEqual(len(frame), rt.MAX_FRAME_BYTES)
        threading.Thread(target=d.send_raw, args=(frame + b"\n",), daemon=True).start()
        rep = d.reply()
        self.assertEqual((rep["id"], rep["ok"]), (1, False))
        self.assertIn("unknown field 'pad'", rep["error"])
        frame = b'{"id":2,"op":"hello","protocol":1,"pad":"' + b"x" * rt.MAX_FRAME_BYTES + b'"}\n'
        threading.Thread(target=d.send_raw, args=(frame,), daemon=True).start()
        self.assertEqual(d.replies.readline(), b"")
        self.assertNotEqual(d.close(), 0)
        self.assertIn("longer than 16 MiB", d.log())

    def test_frame_cut_short_by_end_of_file(self):
        d = self.start()
        d.send_raw(b'{"id":1,"op":"hel')
        self.assertEqual(d.close(), 0)
        self.assertIn("end of file inside a request frame", d.log())


class RequestRulesTest(unittest.TestCase):
    def test_strict_fields(self):
        cases = [
            ({"op": "hello"}, "hello request: field 'protocol' missing"),
            ({"op": "hello", "protocol": 1, "extra": 2}, "hello request: unknown field 'extra'"),
            ({"op": "hello", "protocol": "1"}, "hello request: field 'protocol': want an integer, got a string"),
            ({"op": "hello", "protocol": True}, "hello request: field 'protocol': want an integer, got a bool"),
            ({"op": "hello", "protocol": 1.0}, "hello request: field 'protocol': want an integer, got a number"),
            ({"op": "hello", "protocol": 2}, "protocol 2: this trainer speaks protocol 1"),
            ({"op": "launch"}, "request field \"op\": unknown op 'launch' (want one of hello, load, publish, release, save, shutdown, train)"),
            ({"protocol": 1}, "request field \"op\": want a string"),
            ({"op": "train", "iteration": 1, "rollouts": "/x", "args": []}, "train request: field 'args': want an object, got an array"),
            ({"op": "train", "iteration": 1, "args": {}}, "train request: field 'rollouts' missing"),
            ({"op": "publish", "version": "v", "dtype": "int8"}, "publish request: field 'dtype': 'int8', want one of keep, bfloat16, float16"),
            ({"op": "publish", "version": "", "dtype": "keep"}, "publish request: field 'version' is empty"),
            ({"op": "publish", "version": "v", "dtype": "keep", "ipc_refs": "true"}, "publish request: field 'ipc_refs': want a bool, got a string"),
            ({"op": "publish", "version": "v", "dtype": "keep", "ipc_refs": 1}, "publish request: field 'ipc_refs': want a bool, got a number"),
            ({"op": "publish", "version": "v", "dtype": "keep", "ipc_refs": None}, "publish request: field 'ipc_refs': want a bool, got null"),
            ({"op": "save", "path": "/x"}, "save request: field 'iteration' missing"),
            ({"op": "shutdown", "now": True}, "shutdown request: unknown field 'now'"),
            ({"op": "load", "path": "relative/ckpt"}, "field 'path': not an absolute path"),
        ]
        for req, want in cases:
            with self.subTest(req=req):
                c = Call()
                rep = c(**req) if "op" in req else c.s.handle(dict(req, id=1))
                self.assertEqual(rep["ok"], False, rep)
                self.assertEqual(rep["error"], want)
                self.assertEqual(set(rep), {"id", "ok", "error"})

    def test_ids_must_increase(self):
        c = Call()
        self.assertTrue(c.s.handle({"id": 5, "op": "hello", "protocol": 1})["ok"])
        rep = c.s.handle({"id": 5, "op": "hello", "protocol": 1})
        self.assertEqual(rep, {"id": 5, "ok": False, "error": "request id 5: not above the previous id 5"})
        self.assertTrue(c.s.handle({"id": 6, "op": "hello", "protocol": 1})["ok"])

    def test_train_args_default_to_empty(self):
        tmp = tempfile.mkdtemp()
        ro = write_rollouts(tmp, "r.jsonl", [{"text": "x"}])
        c = Call()
        self.assertTrue(c("train", iteration=1, rollouts=ro)["ok"])


class SessionTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="rlflow-trainer-test-")
        self.ro = write_rollouts(self.tmp, "r.jsonl", [{"text": "a"}, {}, {"text": "c"}])

    def test_train_order(self):
        c = Call()
        self.assertEqual(c("train", iteration=2, rollouts=self.ro)["error"],
                         "train iteration 2: the trainer is at iteration 0, so the next is 1")
        self.assertEqual(c("train", iteration=0, rollouts=self.ro)["error"],
                         "train iteration 0: the trainer is at iteration 0, so the next is 1")
        self.assertTrue(c("train", iteration=1, rollouts=self.ro)["ok"])
        self.assertFalse(c("train", iteration=1, rollouts=self.ro)["ok"])  # never twice
        self.assertEqual(c("hello", protocol=1)["iteration"], 1)
        self.assertEqual(c.backend.weights, [7, 3])

    def test_rollouts_errors_name_the_line_not_its_content(self):
        bad = os.path.join(self.tmp, "bad.jsonl")
        with open(bad, "w") as f:
            f.write('{"text": "ok"}\n\n[1, "secret"]\n')
        c = Call()
        err = c("train", iteration=1, rollouts=bad)["error"]
        self.assertEqual(err, "rollouts %s line 3: a JSON an array, not an object" % bad)
        with open(bad, "w") as f:
            f.write('{"text": "ok"}\n{secret\n')
        self.assertEqual(c("train", iteration=1, rollouts=bad)["error"], "rollouts %s line 2: not JSON (JSONDecodeError)" % bad)
        self.assertIn("cannot open", c("train", iteration=1, rollouts=os.path.join(self.tmp, "none.jsonl"))["error"])
        self.assertEqual(c("train", iteration=1, rollouts="r.jsonl")["error"], "field 'rollouts': not an absolute path")
        self.assertEqual(c.backend.weights, [7])  # nothing trained
        self.assertTrue(c("train", iteration=1, rollouts=self.ro)["ok"])  # and nothing tainted

    def test_a_refused_request_leaves_the_trainer_usable(self):
        c = Call()
        rep = c("train", iteration=1, rollouts=self.ro, args={"fail": "request"})
        self.assertEqual(rep["error"], "bad args: ['fail']")
        self.assertTrue(c("train", iteration=1, rollouts=self.ro)["ok"])

    def test_a_failed_train_taints_until_load(self):
        c = Call()
        self.assertTrue(c("train", iteration=1, rollouts=self.ro)["ok"])
        ck = os.path.join(self.tmp, "ckpt-1")
        self.assertTrue(c("save", path=ck, iteration=1)["ok"])
        rep = c("train", iteration=2, rollouts=self.ro, args={"fail": "runtime"})
        self.assertEqual(rep["error"], "RuntimeError: boom at 3")
        self.assertEqual(c("hello", protocol=1)["iteration"], 1)
        for op, fields in (("train", {"iteration": 2, "rollouts": self.ro}), ("publish", {"version": "v", "dtype": "keep"}),
                           ("save", {"path": os.path.join(self.tmp, "ckpt-x"), "iteration": 1})):
            with self.subTest(op):
                err = c(op, **fields)["error"]
                self.assertEqual(err, "%s refused: the trainer's state is unknown after the failed train of iteration 2 "
                                      "(RuntimeError); load a checkpoint (or restart the trainer) first" % op)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "ckpt-x")))
        self.assertEqual(c("load", path=ck)["iteration"], 1)
        self.assertEqual(c.backend.weights, [7, 3])
        self.assertTrue(c("train", iteration=2, rollouts=self.ro)["ok"])

    def test_bad_metrics_fail_the_train_and_taint(self):
        for fail, want in (("nan", "ValueError: train_step's metric 'loss' is nan"),
                           ("bool", "ValueError: train_step's metric 'done' is bool, want a number")):
            with self.subTest(fail):
                c = Call()
                self.assertEqual(c("train", iteration=1, rollouts=self.ro, args={"fail": fail})["error"], want)
                self.assertIn("state is unknown", c("train", iteration=1, rollouts=self.ro)["error"])

    def test_publish_until_release(self):
        c = Call()
        self.assertEqual(c("release", version="v0")["error"], "release 'v0': no version is published")
        p = c("publish", version="v1", dtype="keep")
        self.assertTrue(p["ok"])
        self.assertEqual(p["version"], "v1")
        self.assertEqual(c("publish", version="v2", dtype="keep")["error"],
                         "publish 'v2' refused: version 'v1' is published and not released")
        self.assertTrue(c("train", iteration=1, rollouts=self.ro)["ok"])  # training goes on meanwhile
        self.assertEqual(c("release", version="v2")["error"], "release 'v2': the published version is 'v1'")
        self.assertEqual(c("release", version="v1"), {"id": c.next_id, "ok": True})
        self.assertTrue(c("publish", version="v2", dtype="float16")["ok"])
        self.assertEqual(c.backend.publishes, ["keep", "float16"])

    def test_publish_ipc_refs_only_when_asked(self):
        c = Call()
        for asked in (None, False):
            with self.subTest(asked=asked):
                p = c("publish", version="v", dtype="keep", **({} if asked is None else {"ipc_refs": asked}))
                self.assertTrue(p["ok"], p)
                self.assertNotIn("ipc_refs", p)
                self.assertTrue(c("release", version="v")["ok"])
        p = c("publish", version="v", dtype="keep", ipc_refs=True)
        self.assertTrue(p["ok"], p)
        self.assertEqual(p["ipc_refs"], FAKE_REFS_2)
        self.assertTrue(c("release", version="v")["ok"])

    def test_a_backend_that_breaks_the_ipc_refs_rule_fails_the_publish(self):
        for name, asked, mangle, want in (
                ("one short", True, lambda out: out["ipc_refs"].pop(), "gave 1 ipc_refs for 2 tensors"),
                ("none", True, lambda out: out.pop("ipc_refs"), "gave no ipc_refs for 2 tensors"),
                ("unasked", False, lambda out: out.update(ipc_refs=fake_refs(2)), "ipc_refs that were not asked for")):
            with self.subTest(name):
                c = Call()
                c.backend.mangle_publish = mangle
                rep = c("publish", version="v", dtype="keep", ipc_refs=asked)
                self.assertFalse(rep["ok"])
                self.assertIn(want, rep["error"])
                self.assertEqual(c("release", version="v")["error"], "release 'v': no version is published")
                c.backend.mangle_publish = None
                self.assertTrue(c("publish", version="v", dtype="keep", ipc_refs=asked)["ok"], "not tainted")

    def test_save_writes_a_complete_directory_atomically(self):
        c = Call()
        self.assertTrue(c("train", iteration=1, rollouts=self.ro)["ok"])
        ck = os.path.join(self.tmp, "ckpt-1")
        rep = c("save", path=ck + "/", iteration=1)
        self.assertTrue(rep["ok"], rep)
        self.assertEqual(rep["path"], ck)
        self.assertEqual(sorted(os.listdir(ck)), [rt.META_FILE, rt.MODEL_FILE, rt.STATE_FILE])
        self.assertEqual(rep["bytes"], sum(os.path.getsize(os.path.join(ck, n)) for n in os.listdir(ck)))
        with open(os.path.join(ck, rt.META_FILE)) as f:
            meta = json.load(f)
        self.assertEqual((meta["format"], meta["version"], meta["iteration"]), (rt.CHECKPOINT_FORMAT, 1, 1))
        with open(os.path.join(ck, rt.MODEL_FILE), "rb") as f:
            self.assertEqual(meta["files"][rt.MODEL_FILE]["sha256"], hashlib.sha256(f.read()).hexdigest())
        self.assertEqual([n for n in os.listdir(self.tmp) if ".tmp-" in n], [])
        self.assertEqual(c("save", path=ck, iteration=1)["error"], "save: %s exists already" % ck)
        self.assertEqual(c("save", path=os.path.join(self.tmp, "c2"), iteration=2)["error"],
                         "save at iteration 2: the trainer is at iteration 1")
        self.assertEqual(c("save", path=os.path.join(self.tmp, "no", "c"), iteration=1)["error"],
                         "save: the parent directory %s does not exist" % os.path.join(self.tmp, "no"))

    def test_a_failed_save_leaves_nothing(self):
        c = Call()
        c.backend.weights.append(-99)  # FakeBackend: write_checkpoint fails
        ck = os.path.join(self.tmp, "ckpt-0")
        self.assertEqual(c("save", path=ck, iteration=0)["error"], "OSError: disk full (test)")
        self.assertEqual(os.listdir(self.tmp), ["r.jsonl"])
        c.backend.weights.pop()
        self.assertTrue(c("save", path=ck, iteration=0)["ok"])  # not tainted

    def test_load_checks_the_files_before_touching_the_model(self):
        c = Call()
        self.assertTrue(c("train", iteration=1, rollouts=self.ro)["ok"])
        ck = os.path.join(self.tmp, "ckpt-1")
        self.assertTrue(c("save", path=ck, iteration=1)["ok"])
        self.assertTrue(c("train", iteration=2, rollouts=self.ro)["ok"])
        with open(os.path.join(ck, rt.MODEL_FILE), "a") as f:
            f.write(" ")
        self.assertEqual(c("load", path=ck)["error"],
                         "load %s: %s is not the file save wrote (size or SHA-256 differ)" % (ck, rt.MODEL_FILE))
        self.assertEqual(c.backend.weights, [7, 3, 3])
        self.assertTrue(c("train", iteration=3, rollouts=self.ro)["ok"])  # not tainted
        for meta, want in (("{", "is not JSON"), ('{"format": "other"}', "is not an rlflow trainer checkpoint's"),
                           ('{"format": "%s", "version": 9}' % rt.CHECKPOINT_FORMAT, "checkpoint format version 9")):
            with self.subTest(meta):
                with open(os.path.join(ck, rt.META_FILE), "w") as f:
                    f.write(meta)
                self.assertIn(want, c("load", path=ck)["error"])
        self.assertIn("cannot read meta.json", c("load", path=os.path.join(self.tmp, "none"))["error"])

    def test_load_sets_the_iteration(self):
        c = Call()
        ck = os.path.join(self.tmp, "ckpt-0")
        self.assertTrue(c("save", path=ck, iteration=0)["ok"])
        for i in (1, 2):
            self.assertTrue(c("train", iteration=i, rollouts=self.ro)["ok"])
        rep = c("load", path=ck)
        self.assertEqual(rep["iteration"], 0)
        self.assertEqual(c.backend.weights, [7])
        self.assertTrue(c("train", iteration=1, rollouts=self.ro)["ok"])


class HelpersTest(unittest.TestCase):
    def test_plan_layout(self):
        cases = [
            ([], [], 0),
            ([("bfloat16", [2, 3]), ("bfloat16", [4])], [(0, 12), (12, 8)], 20),
            # float32 after 2 bytes starts at 4; a 0-dim int64 at the next 8
            ([("bfloat16", [1]), ("float32", [3]), ("int64", [])], [(0, 2), (4, 12), (16, 8)], 24),
            ([("bool", [3]), ("float16", [0]), ("float64", [1])], [(0, 3), (4, 0), (8, 8)], 16),
        ]
        for entries, want, total in cases:
            with self.subTest(entries):
                self.assertEqual(rt.plan_layout(entries), (want, total))

    def test_safetensors_header(self):
        entries = [("a", "bfloat16", [2], 4), ("b.c", "float32", [], 4)]
        raw = rt.encode_safetensors_header(entries, {"format": "pt"})
        n = int.from_bytes(raw[:8], "little")
        self.assertEqual(n % 8, 0)
        self.assertEqual(len(raw), 8 + n)
        self.assertEqual(json.loads(raw[8:]), {"__metadata__": {"format": "pt"},
                                               "a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
                                               "b.c": {"dtype": "F32", "shape": [], "data_offsets": [4, 8]}})
        got, meta = rt.decode_safetensors_header(io.BytesIO(raw + b"\0" * 8))
        self.assertEqual(got, [("a", "bfloat16", [2], 8 + n, 12 + n), ("b.c", "float32", [], 12 + n, 16 + n)])
        self.assertEqual(meta, {"format": "pt"})

    def test_gpu_uuid_text(self):
        u = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
        for raw, want in ((u, u), ("GPU-" + u.upper(), u), (bytes.fromhex(u.replace("-", "")), u),
                          ("GPU-123", None), (None, None), (b"short", None)):
            with self.subTest(raw):
                self.assertEqual(rt.gpu_uuid_text(raw), want)

    def test_expandable_segments_on(self):
        for env, want in (({}, False), ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
                          ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"}, True),
                          ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
                          ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True)):
            with self.subTest(env):
                self.assertEqual(rt.expandable_segments_on(env), want)

    def test_check_share_handle(self):
        rt.check_share_handle(b"\x02c" + b"\1" * 64)
        rt.check_share_handle(b"\1" * 64)
        for h, want in ((b"\x02e" + b"\1" * 40, "expandable segment"), (b"\x02x" + b"\1" * 64, "unknown kind"),
                        (b"\x02c" + b"\1" * 10, "unknown kind")):
            with self.subTest(h[:2]):
                with self.assertRaises(rt.RequestError) as cm:
                    rt.check_share_handle(h)
                self.assertIn(want, str(cm.exception))

    def test_ipc_ref_entry(self):
        ev = bytes(range(64))
        self.assertEqual(rt.ipc_ref_entry((0, b"\x02c" + b"h" * 64, 4096, 512, b"/torch_1_2_0", 7, ev, True)),
                         {"ref_counter_handle": "L3RvcmNoXzFfMl8w", "ref_counter_offset": 7,
                          "event_handle": base64.b64encode(ev).decode(), "event_sync_required": True})
        self.assertEqual(rt.ipc_ref_entry((0, b"h", 1, 0, b"/t", 0, None, False))["event_handle"], None)

    def test_share_refs_one_call_per_tensor_checked_against_the_reply(self):
        handle = b"\x02c" + b"h" * 64

        class Storage:
            """A TEST DOUBLE of an UntypedStorage's _share_cuda_(): slot
            n on the n-th call; override replaces fields of one call."""
            def __init__(self, override=None):
                self.calls, self.override = 0, override or {}

            def _share_cuda_(self):
                share = [1, handle, 4096, 512, b"/torch_9_9_0", self.calls, b"e" * 64, True]
                for k, v in self.override.get(self.calls, {}).items():
                    share[k] = v
                self.calls += 1
                return tuple(share)

        st = Storage()
        refs = rt.share_refs(st, 3, 1, handle, 4096, 512)
        self.assertEqual(st.calls, 3)
        self.assertEqual([r["ref_counter_offset"] for r in refs], [0, 1, 2])
        for override, want in (({1: {1: b"\x02c" + b"x" * 64}}, "tensor 1 gave another handle than the reply's"),
                               ({0: {0: 2}}, "tensor 0 gave another device than the reply's"),
                               ({2: {2: 8192, 3: 0}}, "tensor 2 gave another size and offset than the reply's")):
            with self.subTest(want):
                with self.assertRaises(rt.RequestError) as cm:
                    rt.share_refs(Storage(override), 3, 1, handle, 4096, 512)
                self.assertEqual(str(cm.exception), "publish: torch changed the export under us: the _share_cuda_() call for " + want)

    def test_trainer_fds(self):
        self.assertEqual(rt.trainer_fds({"RLFLOW_TRAINER_FDS": "3,4"}), (3, 4))
        for v in (None, "", "3", "3,x", "3,4,5"):
            with self.subTest(v):
                with self.assertRaises(SystemExit) as cm:
                    rt.trainer_fds({} if v is None else {"RLFLOW_TRAINER_FDS": v})
                self.assertIn("RLFLOW_TRAINER_FDS", str(cm.exception))

    def test_serve_without_the_pipes_says_so_before_importing_torch(self):
        env = dict(os.environ)
        env.pop("RLFLOW_TRAINER_FDS", None)
        code = "import sys; sys.path.insert(0, %r); import rlflow_trainer as r; r.serve(None, None, None)" % HERE
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 1)
        self.assertIn("RLFLOW_TRAINER_FDS is not set", p.stderr)

    def test_encode_frame(self):
        self.assertEqual(rt.encode_frame({"id": 1, "ok": True, "s": "é"}), b'{"id":1,"ok":true,"s":"\\u00e9"}\n')
        with self.assertRaises(ValueError):
            rt.encode_frame({"x": float("inf")})

    def test_error_text(self):
        self.assertEqual(rt.error_text(KeyError("text")), "KeyError: 'text'")
        self.assertEqual(rt.error_text(RuntimeError()), "RuntimeError")
        self.assertEqual(rt.error_text(rt.RequestError("plain")), "plain")
        self.assertEqual(len(rt.error_text(ValueError("x" * 10000))), 4000)


# -- torch -------------------------------------------------------------------------


def tiny_model(dev, seed):
    """A small model with what a state dict can hold: float32 and bfloat16
    parameters, a 0-dim int64 buffer, dropout (the device's RNG)."""
    rt.seed_everything(seed)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(32, 16)
            self.proj = torch.nn.Linear(16, 16)
            self.drop = torch.nn.Dropout(0.25)
            self.out = torch.nn.Linear(16, 32, bias=False)
            self.scale = torch.nn.Parameter(torch.randn(16).to(torch.bfloat16))
            self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

        def forward(self, x):
            # The lookup as a one-hot product: every op here has a
            # deterministic CUDA kernel (use_deterministic_algorithms).
            h = one_hot(x, 32) @ self.embed.weight
            h = self.drop(torch.tanh(self.proj(h))) * self.scale.float()
            return self.out(h)

    return Tiny().to(dev)


def one_hot(ids, n):
    return (ids.unsqueeze(-1) == torch.arange(n, device=ids.device)).float()


def tiny_train_step(model, opt, batch, args):
    """Uses every global RNG (python, numpy when present, torch CPU and the
    device's through dropout) so that a wrong restore shows."""
    import random
    dev = next(model.parameters()).device
    rows = list(batch)
    random.shuffle(rows)
    toks = torch.tensor([[b % 32 for b in (r.get("text") or "?").encode()][:8] + [0] * (8 - min(8, len((r.get("text") or "?").encode())))
                         for r in rows], device=dev)
    noise = torch.rand(1).item()
    try:
        import numpy
        noise += float(numpy.random.rand())
    except ImportError:
        pass
    model.train()
    logits = model(toks[:, :-1])
    nll = -(logits.log_softmax(-1) * one_hot(toks[:, 1:], 32)).sum(-1).mean()
    loss = nll * (1 + 0.1 * noise)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    with torch.no_grad():
        model.steps += 1
    return {"loss": loss.detach(), "noise": noise}


def state_digest(model, opt):
    """SHA-256 of every tensor of the model's and the optimizer's state."""
    h = hashlib.sha256()

    def add(name, t):
        h.update(name.encode())
        h.update(rt._tensor_bytes(t.detach().cpu().contiguous()))
    for k, t in model.state_dict().items():
        add(k, t)
    for pid, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            if torch.is_tensor(v):
                add("%s.%s" % (pid, k), v)
    return h.hexdigest()


def tensor_sha(t):
    return hashlib.sha256(rt._tensor_bytes(t.detach().reshape(-1).contiguous().cpu())).hexdigest()


@unittest.skipIf(torch is None, NO_TORCH)
class TorchRoundTripTest(unittest.TestCase):
    """save then load restores training bit for bit."""

    def round_trip(self, dev):
        import random
        tmp = tempfile.mkdtemp(prefix="rlflow-trainer-torch-")
        ros = [write_rollouts(tmp, "r%d.jsonl" % i, [{"text": "rollout %d sample %d" % (i, j)} for j in range(6)]) for i in range(1, 5)]

        def session(seed):
            model = tiny_model(dev, seed)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            return Call(rt.TorchBackend(model, opt, tiny_train_step, dev)), model, opt

        c, model, opt = session(0)
        rt.seed_everything(5)
        for i in (1, 2):
            self.assertTrue(c("train", iteration=i, rollouts=ros[i - 1])["ok"])
        ck = os.path.join(tmp, "ckpt-2")
        rep = c("save", path=ck, iteration=2)
        self.assertTrue(rep["ok"], rep)
        for i in (3, 4):
            self.assertTrue(c("train", iteration=i, rollouts=ros[i - 1])["ok"])
        want = state_digest(model, opt)

        def replay(perturb_after_load):
            random.random()
            torch.rand(3)
            c, model, opt = session(123)  # another initialisation: load must overwrite it all
            self.assertEqual(c("load", path=ck)["iteration"], 2)
            if perturb_after_load:
                random.random()
                torch.rand(3, device=dev)
            for i in (3, 4):
                self.assertTrue(c("train", iteration=i, rollouts=ros[i - 1])["ok"])
            return state_digest(model, opt)

        self.assertEqual(replay(False), want)
        # The test can fail: training depends on the RNG state load restores.
        self.assertNotEqual(replay(True), want)

    def test_round_trip_cpu(self):
        self.round_trip(torch.device("cpu"))

    @unittest.skipIf(not HAVE_CUDA, NO_CUDA)
    def test_round_trip_cuda_deterministic(self):
        rt.enable_determinism(torch)
        self.round_trip(torch.device("cuda", 0))

    def test_hand_written_safetensors(self):
        tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor(7, dtype=torch.int64),
                   "c": torch.randn(5).to(torch.bfloat16), "d": torch.zeros(0, 4), "e": torch.tensor([True, False])}
        path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        entries = [(k, rt.dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size()) for k, t in tensors.items()]
        with open(path, "wb") as f:  # the fallback writer's bytes
            f.write(rt.encode_safetensors_header(entries, {"format": "pt"}))
            for t in tensors.values():
                f.write(rt._tensor_bytes(t))
        readers = [("fallback", lambda: self._fallback_load(path))]
        try:
            from safetensors.torch import load_file
            readers.append(("safetensors", lambda: load_file(path)))
        except ImportError:
            pass
        for name, read in readers:
            with self.subTest(name):
                got = read()
                self.assertEqual(sorted(got), sorted(tensors))
                for k, t in tensors.items():
                    self.assertEqual(got[k].dtype, t.dtype)
                    self.assertEqual(got[k].shape, t.shape)
                    self.assertTrue(torch.equal(got[k], t), k)

    def test_pack_into_lays_out_every_kind_of_tensor(self):
        # What publish does on the device, on the CPU: views of the target
        # dtype and shape at the planned offsets, float32 cast to bfloat16.
        src = [("w", torch.randn(3, 5), torch.bfloat16),                  # cast
               ("wt", torch.randn(4, 6).t(), torch.float32),               # not contiguous
               ("h", torch.randn(7).to(torch.float16), torch.float16),
               ("n", torch.tensor(3, dtype=torch.int64), torch.int64),      # 0-dim, after 2-byte items
               ("e", torch.zeros(0, 3), torch.float32),                     # empty
               ("b", torch.tensor([True, False, True]), torch.bool),
               ("d", torch.randn(2, dtype=torch.float64), torch.float64)]   # 8-byte aligned after 3 bools
        layout, total = rt.plan_layout([(rt.dtype_name(tdt), list(t.shape)) for _, t, tdt in src])
        buf = torch.full((total,), 0xAB, dtype=torch.uint8)
        rt.pack_into(buf, src, layout)
        raw = rt._tensor_bytes(buf)
        for (name, t, tdt), (off, n) in zip(src, layout):
            with self.subTest(name):
                self.assertEqual(off % rt.SNAPSHOT_ITEMSIZE[rt.dtype_name(tdt)], 0)
                want = rt._tensor_bytes(t.to(tdt).contiguous().reshape(-1))
                self.assertEqual(raw[off:off + n], want)

    def _fallback_load(self, path):
        import builtins
        real = builtins.__import__

        def no_safetensors(name, *a, **k):
            if name.startswith("safetensors"):
                raise ImportError("hidden by the test")
            return real(name, *a, **k)
        builtins.__import__ = no_safetensors
        try:
            return rt.load_safetensors(torch, path)
        finally:
            builtins.__import__ = real


# -- CUDA: publish -------------------------------------------------------------


READER = r'''
import ctypes, hashlib, json, sys
import torch
torch.cuda.init()
path = None
for line in open("/proc/self/maps"):
    if "libcudart.so" in line:
        path = line.split()[-1]
        break
cudart = ctypes.CDLL(path or "libcudart.so")
class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]
cudart.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), Handle, ctypes.c_uint]
cudart.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
cudart.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
cudart.cudaGetErrorString.restype = ctypes.c_char_p
def check(r, what):
    if r != 0:
        raise SystemExit("%s: %s" % (what, cudart.cudaGetErrorString(r).decode()))
rep = json.load(sys.stdin)
import base64
h = base64.b64decode(rep["handle"])
h = h[2:] if len(h) == 66 else h
check(cudart.cudaSetDevice(rep["device"]), "cudaSetDevice")
ptr = ctypes.c_void_p()
r = cudart.cudaIpcOpenMemHandle(ctypes.byref(ptr), Handle(h), 1)
closer = lambda: check(cudart.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")
if r != 0:
    # Through torch's own importer, with the same handle and offsets.
    sys.stderr.write("reader: cudaIpcOpenMemHandle through %s: %s; opening through torch\n"
                     % (path, cudart.cudaGetErrorString(r).decode()))
    ts = rep["torch_share"]
    dec = lambda v: None if v is None else base64.b64decode(v)
    st = torch.UntypedStorage._new_shared_cuda(ts["device"], dec(ts["handle"]), ts["size"], ts["offset"],
                                               dec(ts["ref_counter_handle"]), ts["ref_counter_offset"],
                                               dec(ts["event_handle"]), ts["event_sync_required"])
    if st.nbytes() != rep["storage_bytes"]:
        raise SystemExit("torch's storage holds %d bytes, the reply says %d" % (st.nbytes(), rep["storage_bytes"]))
    ptr = ctypes.c_void_p(st.data_ptr() - rep["storage_offset"])
    closer = lambda: None
base = ptr.value + rep["storage_offset"]
out = {}
for t in rep["tensors"]:
    buf = ctypes.create_string_buffer(max(1, t["bytes"]))
    if t["bytes"]:
        check(cudart.cudaMemcpy(buf, ctypes.c_void_p(base + t["offset"]), t["bytes"], 2), "cudaMemcpy")
    out[t["name"]] = hashlib.sha256(buf.raw[:t["bytes"]]).hexdigest()
closer()
print(json.dumps(out))
'''


def read_snapshot(reply):
    """SHA-256 per tensor of a publish reply's snapshot, read by another
    process through the reply's handle and offsets alone."""
    p = subprocess.run([sys.executable, "-c", READER], input=json.dumps(reply), capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise AssertionError("snapshot reader failed (%d): %s" % (p.returncode, p.stderr[-3000:]))
    return json.loads(p.stdout)


def expected_snapshot(model, dtype):
    cast = None if dtype == "keep" else getattr(torch, dtype)
    out = {}
    for k, t in model.state_dict().items():
        out[k] = tensor_sha(t.to(cast) if cast is not None and t.dtype == torch.float32 else t)
    return out


@unittest.skipIf(not HAVE_CUDA, NO_CUDA)
class CUDAPublishTest(unittest.TestCase):
    def test_publish_read_back_by_another_process(self):
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        model = tiny_model(dev, 1)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        backend = rt.TorchBackend(model, opt, tiny_train_step, dev)
        c = Call(backend)
        tmp = tempfile.mkdtemp()
        ro = write_rollouts(tmp, "r.jsonl", [{"text": "sample %d" % j} for j in range(4)])

        p1 = c("publish", version="v1", dtype="bfloat16")
        self.assertTrue(p1["ok"], p1)
        want1 = expected_snapshot(model, "bfloat16")
        self.assertEqual([t["name"] for t in p1["tensors"]], list(model.state_dict()))
        dtypes = {t["name"]: t["dtype"] for t in p1["tensors"]}
        self.assertEqual((dtypes["proj.weight"], dtypes["scale"], dtypes["steps"]), ("bfloat16", "bfloat16", "int64"))
        for t in p1["tensors"]:
            self.assertEqual(t["offset"] % rt.SNAPSHOT_ITEMSIZE[t["dtype"]], 0)
            self.assertLessEqual(t["offset"] + t["bytes"], p1["storage_bytes"])
        self.assertEqual(p1["device"], 0)
        if p1["gpu_uuid"] is not None:
            self.assertRegex(p1["gpu_uuid"], r"^[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$")
        self.assertGreater(p1["snapshot_seconds"], 0)
        self.assertEqual(read_snapshot(p1), want1)

        # Untouched until release, while training goes on.
        self.assertTrue(c("train", iteration=1, rollouts=ro)["ok"])
        self.assertNotEqual(expected_snapshot(model, "bfloat16"), want1)
        self.assertFalse(c("publish", version="v2", dtype="bfloat16")["ok"])
        self.assertEqual(read_snapshot(p1), want1)
        self.assertTrue(c("release", version="v1")["ok"])

        # The same buffer (the same handle) for the same layout.
        p2 = c("publish", version="v2", dtype="bfloat16")
        self.assertTrue(p2["ok"], p2)
        self.assertEqual((p2["handle"], p2["storage_offset"]), (p1["handle"], p1["storage_offset"]))
        self.assertEqual(read_snapshot(p2), expected_snapshot(model, "bfloat16"))
        self.assertTrue(c("release", version="v2")["ok"])

        # keep: float32 stays float32, the layout grows: a new buffer.
        p3 = c("publish", version="v3", dtype="keep")
        self.assertTrue(p3["ok"], p3)
        self.assertEqual({t["name"]: t["dtype"] for t in p3["tensors"]}["proj.weight"], "float32")
        self.assertGreater(p3["storage_bytes"], p1["storage_bytes"])
        self.assertEqual(read_snapshot(p3), expected_snapshot(model, "keep"))
        self.assertEqual(len(backend.exported), 2)  # the first is still referenced


# Rebuilds every tensor of a publish reply with ipc_refs in another process
# as vLLM's ipc backend does: torch's rebuild_cuda_tensor on the 15
# arguments of reduce_tensor for a CUDA tensor, from the reply's fields
# alone. Prints the SHA-256 per tensor after freeing what it rebuilt (so the
# first tensor's ref-counter slot is released too).
REBUILDER = r'''
import base64, ctypes, gc, hashlib, json, sys
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
rep = json.load(sys.stdin)
dec = lambda v: None if v is None else base64.b64decode(v)
torch.cuda.set_device(rep["device"])
handle = dec(rep["handle"])
if len(rep["ipc_refs"]) != len(rep["tensors"]):
    raise SystemExit("%d ipc_refs for %d tensors" % (len(rep["ipc_refs"]), len(rep["tensors"])))
out, rebuilt = {}, []
for t, ref in zip(rep["tensors"], rep["ipc_refs"]):
    dtype = getattr(torch, t["dtype"])
    item = torch.empty((), dtype=dtype).element_size()
    if t["offset"] % item:
        raise SystemExit("%s: byte offset %d is not a multiple of %d" % (t["name"], t["offset"], item))
    stride, n = [], 1
    for d in reversed(t["shape"]):  # C-contiguous, in elements (torch counts a 0 dim as 1)
        stride.insert(0, n)
        n *= max(d, 1)
    args = (torch.Tensor, torch.Size(t["shape"]), tuple(stride), t["offset"] // item,
            torch.storage.TypedStorage, dtype, rep["device"], handle, rep["storage_bytes"], rep["storage_offset"],
            False, dec(ref["ref_counter_handle"]), ref["ref_counter_offset"], dec(ref["event_handle"]),
            ref["event_sync_required"])
    x = rebuild_cuda_tensor(*args)
    if x.dtype != dtype or list(x.shape) != t["shape"] or x.device != torch.device("cuda", rep["device"]):
        raise SystemExit("%s: rebuilt as %s %s on %s" % (t["name"], x.dtype, list(x.shape), x.device))
    c = x.detach().reshape(-1).contiguous().cpu()
    raw = ctypes.string_at(c.data_ptr(), c.numel() * c.element_size()) if c.numel() else b""
    out[t["name"]] = hashlib.sha256(raw).hexdigest()
    rebuilt.append(x)
x = c = None
del rebuilt
gc.collect()
torch.cuda.synchronize()
print(json.dumps(out))
'''


def rebuild_snapshot(reply):
    """SHA-256 per tensor of a publish reply with ipc_refs, every tensor
    rebuilt by another process with rebuild_cuda_tensor (REBUILDER)."""
    p = subprocess.run([sys.executable, "-c", REBUILDER], input=json.dumps(reply), capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise AssertionError("the rebuilder failed (%d): %s" % (p.returncode, p.stderr[-3000:]))
    return json.loads(p.stdout)


# torch's ref-counter file (/dev/shm/<handle>) is a RefcountedMapAllocator
# mapping: its own 64-byte header, then one int64 counter per slot.
REF_COUNTER_HEADER_BYTES = 64


def ref_counter(handle_b64, offset):
    """The value of an ipc_refs entry's ref-counter slot, read from its file."""
    name = base64.b64decode(handle_b64).decode()
    with open(os.path.join("/dev/shm", name.lstrip("/")), "rb") as f:
        f.seek(REF_COUNTER_HEADER_BYTES + 8 * offset)
        return int.from_bytes(f.read(8), "little", signed=True)


@unittest.skipIf(not HAVE_CUDA, NO_CUDA)
class CUDAIPCRefsTest(unittest.TestCase):
    """publish with ipc_refs: what vLLM's ipc backend rebuilds each tensor
    from (PROTOCOL.md "publish", ipc_refs)."""

    def session(self):
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        model = tiny_model(dev, 1)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return Call(rt.TorchBackend(model, opt, tiny_train_step, dev)), model

    def test_every_tensor_rebuilt_by_rebuild_cuda_tensor_in_another_process(self):
        c, model = self.session()
        tmp = tempfile.mkdtemp()
        ro = write_rollouts(tmp, "r.jsonl", [{"text": "sample %d" % j} for j in range(4)])
        p0 = c("publish", version="v0", dtype="bfloat16")
        self.assertTrue(p0["ok"], p0)
        self.assertNotIn("ipc_refs", p0)
        self.assertTrue(c("release", version="v0")["ok"])

        seen = set()  # every slot of every publish
        for version, dtype in (("v1", "bfloat16"), ("v2", "keep"), ("v3", "keep")):
            with self.subTest(version=version, dtype=dtype):
                self.assertTrue(c("train", iteration=int(version[1:]), rollouts=ro)["ok"])
                p = c("publish", version=version, dtype=dtype, ipc_refs=True)
                self.assertTrue(p["ok"], p)
                self.assertEqual(len(p["ipc_refs"]), len(p["tensors"]))
                for r in p["ipc_refs"]:
                    self.assertGreater(len(base64.b64decode(r["ref_counter_handle"])), 0)
                    if r["event_handle"] is not None:
                        self.assertEqual(len(base64.b64decode(r["event_handle"])), 64)
                    self.assertIsInstance(r["event_sync_required"], bool)
                slots = {(r["ref_counter_handle"], r["ref_counter_offset"]) for r in p["ipc_refs"]}
                self.assertEqual(len(slots), len(p["tensors"]), "a slot of its own per tensor")
                self.assertFalse(slots & seen, "and new ones per publish")
                seen |= slots
                self.assertEqual(rebuild_snapshot(p), expected_snapshot(model, dtype))
                self.assertTrue(c("release", version=version)["ok"])

    def test_each_slot_is_released_once_by_the_receiver(self):
        c, model = self.session()
        p = c("publish", version="v1", dtype="keep", ipc_refs=True)
        self.assertTrue(p["ok"], p)
        slots = [(r["ref_counter_handle"], r["ref_counter_offset"]) for r in p["ipc_refs"]]
        self.assertGreater(len(slots), 1)
        self.assertEqual([ref_counter(*s) for s in slots], [1] * len(slots), "torch sets a new slot to 1")
        self.assertEqual(rebuild_snapshot(p), expected_snapshot(model, "keep"))
        # The receiver opened the storage for the first tensor (released
        # when it freed it) and found it cached for the others (released at
        # once): one release per slot. Slots shared by N tensors would read
        # 1 - N here.
        self.assertEqual([ref_counter(*s) for s in slots], [0] * len(slots))
        self.assertTrue(c("release", version="v1")["ok"])


def child_torch():
    """--child-torch: a trainer of the tiny model through serve()."""
    dev = rt.trainer_device()
    model = tiny_model(dev, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    print("stdout is the trainer's own", flush=True)
    rt.serve(model, opt, tiny_train_step, seed=1, device=dev)
    return 0


@unittest.skipIf(not HAVE_CUDA, NO_CUDA)
class CUDAServeTest(unittest.TestCase):
    def trainer(self, **env):
        e = dict(os.environ, RLFLOW_TRAINER_DEVICE="0", CUBLAS_WORKSPACE_CONFIG=":4096:8", **env)
        d = Driver([sys.executable, os.path.abspath(__file__), "--child-torch"], env=e)
        self.addCleanup(d.close)
        return d

    def test_serve_end_to_end(self):
        tmp = tempfile.mkdtemp()
        ro = write_rollouts(tmp, "r.jsonl", [{"text": "sample %d" % j} for j in range(4)])
        d = self.trainer()
        h = d.ok("hello", protocol=1)
        self.assertEqual((h["device"], h["framework"], h["iteration"]), (0, "torch " + torch.__version__, 0))
        t = d.ok("train", iteration=1, rollouts=ro, args={})
        self.assertEqual(sorted(t["metrics"]), ["loss", "noise"])
        p = d.ok("publish", version="v1", dtype="bfloat16")
        got = read_snapshot(p)
        self.assertEqual(sorted(got), sorted(t["name"] for t in p["tensors"]))
        d.ok("release", version="v1")
        ck = os.path.join(tmp, "ckpt-1")
        d.ok("save", path=ck, iteration=1)
        d.ok("train", iteration=2, rollouts=ro, args={})
        d.ok("load", path=ck)
        p = d.ok("publish", version="v2", dtype="bfloat16")
        self.assertEqual(read_snapshot(p), got)  # the loaded weights are the saved ones
        d.ok("release", version="v2")
        d.ok("shutdown")
        self.assertEqual(d.close(), 0)

    def test_expandable_segments_refused(self):
        d = self.trainer(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        d.ok("hello", protocol=1)
        rep = d.call("publish", version="v1", dtype="keep")
        self.assertFalse(rep["ok"])
        self.assertIn("expandable segments", rep["error"])
        self.assertIn("warning: expandable segments are on", d.log())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child-fake":
        sys.exit(child_fake())
    if len(sys.argv) > 1 and sys.argv[1] == "--child-torch":
        sys.exit(child_torch())
    unittest.main()
