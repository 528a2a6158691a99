#!/usr/bin/env python3
"""The resident trainer of benchmark cases (b) and (c) (issue 18): the model
of bench_seed.py (its build_model: a stack of bf16 Linear(hidden, hidden)
layers of about --model-bytes, named layers.<i>.weight / layers.<i>.bias,
so cases (a), (b) and (c) move the same bytes and the same tensors) and
Adam, served to rlflow's GPU worker through trainer/python/rlflow_trainer
(trainer/PROTOCOL.md). transfer/ncclengine's TestGPUResidentBench and
TestGPUResidentSIGKILL drive it through trainer.Manager.

    python3 tests/gpu/bench_trainer.py --model-bytes 1GiB [--hidden 4096] [--seed 0]
    python3 tests/gpu/bench_trainer.py --probe       # "READY torch ..." or "SKIP <reason>" on stdout
    python3 tests/gpu/bench_trainer.py --self-test   # the args rules, no torch

One train request is one optimizer step on random data, as bench_seed.py's
rounds do: x = randn(batch, hidden) from torch's CUDA generator (saved in
every checkpoint, so replays draw the same x), loss = mean(model(x)^2)
scaled by the mean "reward" of the rollouts (1 when none has one), backward,
Adam step, synchronize. Deterministic (rlflow_trainer's determinism mode).

args (the train step's with.args), all optional; an unknown key is refused:

* "step": false skips the optimizer step (and draws nothing): the request
  only does what the keys below ask, on the weights as they are.
* "export": an absolute directory (created): after the step, the state dict
  is written as <dir>/model.safetensors (under a temporary name, fsynced,
  renamed, the directory fsynced): the checkpoint path of case (b).
* "digest": an absolute file path: after the step (and the export), the
  SHA-256 of every state-dict tensor's bytes as a JSON object name -> hex,
  written atomically: what a receiver's GET /received must show.
* "sleep" (seconds) and "mark" (an absolute file path): after the step, the
  mark file is created, then the trainer sleeps: a test SIGKILLs it there,
  with the model updated and the reply not sent.

Metrics: opt_done_unix (time.time() once the optimizer step returned and
the device finished it; what the benchmark times from, since step_done_unix
comes after the export), train_seconds, loss (0 without a step),
write_seconds and export_bytes (export), digest_seconds (digest).
Nothing is printed on stdout but --probe's and --self-test's line.
"""

import os

# cuBLAS reads it when its first handle is made: before torch is imported.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import rlflow_trainer  # noqa: E402
except ImportError:
    sys.path.insert(0, os.path.join(HERE, "..", "..", "trainer", "python"))
    import rlflow_trainer  # noqa: E402
from bench_seed import build_model, parse_size  # noqa: E402  (the same model as case (a))

ARGS = {"step": bool, "export": str, "digest": str, "sleep": (int, float), "mark": str}


def log(msg):
    print("bench_trainer %s: %s" % (time.strftime("%H:%M:%S"), msg), file=sys.stderr, flush=True)


def check_args(args):
    """The args as a dict with defaults, or RequestError naming the key (raised
    before anything touches the model: the trainer stays usable)."""
    for k in sorted(args):
        if k not in ARGS:
            raise rlflow_trainer.RequestError("args: unknown key %r (known: %s)" % (k[:64], ", ".join(sorted(ARGS))))
        v, typ = args[k], ARGS[k]
        if isinstance(v, bool) and typ is not bool or not isinstance(v, typ):
            raise rlflow_trainer.RequestError("args: %r has the wrong type" % k)
    for k in ("export", "digest", "mark"):
        if k in args and not os.path.isabs(args[k]):
            raise rlflow_trainer.RequestError("args: %r must be an absolute path" % k)
    sleep = args.get("sleep", 0)
    if not 0 <= sleep <= 3600:
        raise rlflow_trainer.RequestError("args: sleep must be in 0..3600 seconds")
    if sleep and "mark" not in args:
        raise rlflow_trainer.RequestError("args: sleep needs mark (the file the test waits for)")
    out = dict(args)
    out.setdefault("step", True)
    return out


def reward_scale(batch):
    """The mean "reward" of the rollouts that have a number there, else 1."""
    vals = [float(r["reward"]) for r in batch if isinstance(r.get("reward"), (int, float)) and not isinstance(r.get("reward"), bool)]
    return sum(vals) / len(vals) if vals else 1.0


def fsync_path(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path, data):
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path) or ".", directory=True)


def export(torch, model, d):
    """The state dict as d/model.safetensors, durable; returns bytes written."""
    os.makedirs(d, exist_ok=True)
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in model.state_dict().items()}
    path = os.path.join(d, rlflow_trainer.MODEL_FILE)
    tmp = "%s.tmp-%d" % (path, os.getpid())
    rlflow_trainer.save_safetensors(torch, tensors, tmp)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(d, directory=True)
    return os.path.getsize(path)


def digests(torch, model):
    """SHA-256 of every state-dict tensor's bytes (as receiver.py hashes what
    it received), hashed in threads: hashlib lets go of the GIL."""
    items = list(model.state_dict().items())

    def one(t):
        u8 = t.detach().contiguous().view(-1).view(torch.uint8).cpu()
        try:
            return hashlib.sha256(u8.numpy()).hexdigest()
        except (ImportError, RuntimeError):  # no numpy
            return hashlib.sha256(rlflow_trainer._tensor_bytes(u8)).hexdigest()
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as ex:
        sums = list(ex.map(lambda kv: one(kv[1]), items))
    return {name: s for (name, _), s in zip(items, sums)}


def make_train_step(torch, hidden, batch_rows):
    def train_step(model, opt, batch, args):
        args = check_args(args)
        metrics = {"loss": 0.0}
        dev = next(model.parameters()).device
        t0 = time.perf_counter()
        if args["step"]:
            x = torch.randn(batch_rows, hidden, device=dev, dtype=torch.bfloat16)
            loss = model(x).float().pow(2).mean() * reward_scale(batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            metrics["loss"] = float(loss)
        metrics["opt_done_unix"] = time.time()
        metrics["train_seconds"] = time.perf_counter() - t0
        if "export" in args:
            t1 = time.perf_counter()
            metrics["export_bytes"] = export(torch, model, args["export"])
            metrics["write_seconds"] = time.perf_counter() - t1
            log("exported %d bytes to %s in %.3fs" % (metrics["export_bytes"], args["export"], metrics["write_seconds"]))
        if "digest" in args:
            t1 = time.perf_counter()
            write_atomic(args["digest"], json.dumps(digests(torch, model), sort_keys=True).encode())
            metrics["digest_seconds"] = time.perf_counter() - t1
        if args.get("sleep"):
            with open(args["mark"], "w") as f:
                f.write("%d\n" % os.getpid())
            log("stepped; sleeping %.1fs (mark %s)" % (args["sleep"], args["mark"]))
            time.sleep(args["sleep"])
        return metrics
    return train_step


def probe():
    try:
        import torch
    except ImportError as e:
        print("SKIP torch cannot be imported by %s: %s" % (sys.executable, e), flush=True)
        return 0
    if not torch.cuda.is_available():
        print("SKIP torch %s sees no CUDA device" % torch.__version__, flush=True)
        return 0
    print("READY torch %s, %d CUDA devices, %s" % (torch.__version__, torch.cuda.device_count(), sys.executable), flush=True)
    return 0


def self_test():
    """No torch: the args rules and the reward scale."""
    E = rlflow_trainer.RequestError
    assert check_args({}) == {"step": True}
    assert check_args({"step": False, "digest": "/tmp/d.json"})["step"] is False
    assert check_args({"sleep": 2, "mark": "/tmp/m"})["sleep"] == 2
    for bad in ({"x": 1}, {"step": 1}, {"export": "rel/dir"}, {"sleep": True, "mark": "/m"}, {"sleep": 5},
                {"sleep": -1, "mark": "/m"}, {"digest": 3}):
        try:
            check_args(bad)
        except E:
            continue
        raise AssertionError("check_args(%r) did not refuse" % bad)
    assert reward_scale([]) == 1.0 and reward_scale([{"reward": 0.5}, {"reward": 1.5}, {"text": "x"}, {"reward": True}]) == 1.0
    assert parse_size("64MiB") == 64 << 20
    print("bench_trainer self-test PASS")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-bytes", type=parse_size, default=parse_size("1GiB"))
    ap.add_argument("--hidden", type=int, default=4096, help="Linear layers are hidden x hidden (bench_seed.py's default)")
    ap.add_argument("--batch", type=int, default=8, help="rows of the random training batch (bench_seed.py's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--probe", action="store_true", help="print READY or SKIP (torch with CUDA?) and exit")
    ap.add_argument("--self-test", action="store_true", help="check the args rules (no torch) and exit")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    if args.probe:
        return probe()
    import torch
    dev = rlflow_trainer.trainer_device()
    if dev.type == "cuda" and not torch.cuda.is_available():
        log("no CUDA in torch %s: training on the CPU (publish will refuse)" % torch.__version__)
        dev = torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    rlflow_trainer.seed_everything(args.seed)  # the same initial weights on every start
    model = build_model(torch, args.model_bytes, args.hidden, dev)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sd = model.state_dict()
    log("model on %s: %d tensors, %d bytes (bf16, hidden %d), seed %d" % (
        dev, len(sd), sum(t.numel() * t.element_size() for t in sd.values()), args.hidden, args.seed))
    rlflow_trainer.serve(model, opt, make_train_step(torch, args.hidden, args.batch), seed=args.seed, device=dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
