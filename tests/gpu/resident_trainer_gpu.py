#!/usr/bin/env python3
"""The example resident trainer (pipelines/examples/resident/trainer.py)
driven as rlflow's GPU worker drives it (trainer/PROTOCOL.md): the issue-18
promise that a trainer killed mid-run, restarted from its last checkpoint
and replayed from the journaled rollouts, ends byte-identical to a run that
was never disturbed.

    python3 tests/gpu/resident_trainer_gpu.py [--iterations 6] [--checkpoint-every 2] [--kill-at 5]

Run A trains iterations 1..N undisturbed, saving ckpt-<i> every K, then
publishes (bfloat16) and saves the final state. Run B trains up to kill-at,
is SIGKILLed while training kill-at, and a new trainer process does what the
worker's restart does: hello, load of the newest checkpoint, a train for
every iteration after it with the same rollouts and args, then the same
publish and save. PASS when the replayed iterations' metrics equal run A's,
the final model.safetensors files are the same bytes, and the published
snapshots (read by another process through the CUDA IPC handle of the
publish reply alone) hold the same bytes.

Device: RLFLOW_TRAINER_DEVICE (default 0) when CUDA is there; without CUDA
it runs on the CPU and skips publish (saying so). Without torch it prints
SKIP and exits 0. Prints "RESULT {json}" on stdout; exit 0 on PASS.
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import tempfile
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "trainer", "python"))

TRAINER = os.path.join(ROOT, "pipelines", "examples", "resident", "trainer.py")


def log(*a):
    print("resident_trainer_gpu:", *a, file=sys.stderr, flush=True)


def emit(**fields):
    print("RESULT", json.dumps(fields, sort_keys=True), flush=True)


def make_rollouts(d, iteration, n=24):
    """A made-up generate output: prompts, completions, some scored."""
    path = os.path.join(d, "rollouts-%d.jsonl" % iteration)
    with open(path, "w") as f:
        for j in range(n):
            row = {"prompt_id": "p%d" % (j % 6), "prompt": "Question %d: say something nice. " % (j % 6), "sample": j,
                   "text": ("a fine answer number %d " % (iteration * 100 + j)) * (1 + j % 4) + ("!!" if j % 3 else "ok"),
                   "finish_reason": "stop", "prompt_tokens": 9, "completion_tokens": 12, "server": "http://x"}
            if j % 5 == 0:
                row["score"] = (j % 7) / 7.0
            f.write(json.dumps(row) + "\n")
    return path


def sha_file(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument("--kill-at", type=int, default=5, help="iteration whose train is killed in run B")
    ap.add_argument("--config", default=os.path.join(ROOT, "pipelines", "examples", "resident", "model.json"))
    args = ap.parse_args()
    if not 1 < args.kill_at <= args.iterations:
        raise SystemExit("--kill-at must be in 2..--iterations")
    try:
        import torch
    except ImportError as e:
        print("SKIP torch cannot be imported by %s: %s" % (sys.executable, e), flush=True)
        return 0
    from test_rlflow_trainer import Driver, read_snapshot

    cuda = torch.cuda.is_available()
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "trainer", "python"))
    if cuda:
        env.setdefault("RLFLOW_TRAINER_DEVICE", "0")
    else:
        env.pop("RLFLOW_TRAINER_DEVICE", None)
        log("no CUDA: running on the CPU, publish skipped")
    work = tempfile.mkdtemp(prefix="rlflow-resident-")
    rollouts = {i: make_rollouts(work, i) for i in range(1, args.iterations + 1)}
    train_args = {i: ({"lr": 3e-4} if i == 1 else {}) | {"micro_batch": 8} for i in rollouts}

    def start():
        d = Driver([sys.executable, TRAINER, "--config", args.config], env=env, timeout=300)
        h = d.ok("hello", protocol=1)
        log("trainer pid %d: %s on device %d, iteration %d" % (h["pid"], h["framework"], h["device"], h["iteration"]))
        return d

    def finish(d, ckdir, tag):
        out = {}
        if cuda:
            p = d.ok("publish", version=tag, dtype="bfloat16")
            out["snapshot"] = read_snapshot(p)
            out["snapshot_seconds"] = p["snapshot_seconds"]
            out["snapshot_bytes"] = p["storage_bytes"]
            d.ok("release", version=tag)
        final = os.path.join(ckdir, "final")
        s = d.ok("save", path=final, iteration=args.iterations)
        out["model_sha256"] = sha_file(os.path.join(final, "model.safetensors"))
        out["save_seconds"] = s["seconds"]
        d.ok("shutdown")
        code = d.close()
        if code != 0:
            raise RuntimeError("the trainer exited %d after shutdown:\n%s" % (code, d.log()[-3000:]))
        return out

    # Run A: undisturbed.
    a_dir = os.path.join(work, "a")
    os.mkdir(a_dir)
    d = start()
    metrics_a, train_seconds = {}, []
    for i in range(1, args.iterations + 1):
        t = d.ok("train", iteration=i, rollouts=rollouts[i], args=train_args[i])
        metrics_a[i] = t["metrics"]
        train_seconds.append(t["seconds"])
        if i % args.checkpoint_every == 0:
            d.ok("save", path=os.path.join(a_dir, "ckpt-%d" % i), iteration=i)
    a = finish(d, a_dir, "run-a")
    log("run A: final model %s" % a["model_sha256"][:16])

    # Run B: killed while training kill-at, restarted, replayed.
    b_dir = os.path.join(work, "b")
    os.mkdir(b_dir)
    d = start()
    latest = 0
    for i in range(1, args.kill_at):
        d.ok("train", iteration=i, rollouts=rollouts[i], args=train_args[i])
        if i % args.checkpoint_every == 0:
            d.ok("save", path=os.path.join(b_dir, "ckpt-%d" % i), iteration=i)
            latest = i
    d.next_id += 1
    d.send_raw((json.dumps({"id": d.next_id, "op": "train", "iteration": args.kill_at, "rollouts": rollouts[args.kill_at],
                            "args": train_args[args.kill_at]}) + "\n").encode())
    time.sleep(0.05)
    os.kill(d.proc.pid, signal.SIGKILL)
    code = d.close()
    log("run B: trainer killed while training iteration %d (exit %s); restarting from ckpt-%d" % (args.kill_at, code, latest))
    d = start()
    metrics_b = {}
    t0 = time.perf_counter()
    if latest:
        r = d.ok("load", path=os.path.join(b_dir, "ckpt-%d" % latest))
        if r["iteration"] != latest:
            raise RuntimeError("load answered iteration %d, want %d" % (r["iteration"], latest))
    for i in range(latest + 1, args.iterations + 1):
        metrics_b[i] = d.ok("train", iteration=i, rollouts=rollouts[i], args=train_args[i])["metrics"]
    replay_seconds = time.perf_counter() - t0
    b = finish(d, b_dir, "run-b")
    log("run B: final model %s" % b["model_sha256"][:16])

    problems = []
    for i, m in metrics_b.items():
        if m != metrics_a[i]:
            problems.append("iteration %d: replayed metrics %s differ from the undisturbed run's %s" % (i, m, metrics_a[i]))
    if a["model_sha256"] != b["model_sha256"]:
        problems.append("the final model.safetensors differ")
    if cuda and a["snapshot"] != b["snapshot"]:
        bad = sorted(k for k in a["snapshot"] if a["snapshot"][k] != b["snapshot"].get(k))
        problems.append("the published snapshots differ in %d tensors (first %s)" % (len(bad), bad[:3]))
    emit(verdict="FAIL" if problems else "PASS", problems=problems, device="cuda" if cuda else "cpu",
         torch=torch.__version__, iterations=args.iterations, checkpoint_every=args.checkpoint_every,
         killed_at=args.kill_at, restored_from=latest, replayed=sorted(metrics_b), replay_seconds=replay_seconds,
         train_seconds=train_seconds, snapshot_seconds=a.get("snapshot_seconds"), snapshot_bytes=a.get("snapshot_bytes"),
         save_seconds=a["save_seconds"], model_sha256=a["model_sha256"], published=cuda)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
