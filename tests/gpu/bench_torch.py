#!/usr/bin/env python3
"""The PyTorch baseline for rlflow's broadcast benchmarks.

Both ranks of a torch.distributed NCCL group (init_process_group over
tcp://), so that the Go trainer can be compared with what a Python trainer
does today:

  e2e  trainer: safetensors.torch.load_file to cuda, then the same wire
       sequence as the Go trainer (spec section 6: packed uint8 chunks built
       with torch.cat, or one broadcast per tensor) through dist.broadcast;
       the receiver mirrors it (and verifies with --verify).
  raw  R broadcasts of one N-byte uint8 buffer (filled with i % 251): the
       pure broadcast throughput of torch.distributed on this path.

Timing starts after the process group and its warm-up all-reduce are up
(rendezvous excluded, as on the Go side) and ends after the last broadcast
completed on the stream. Prints "RESULT {json}" on stdout; exit 0 on success.

Placement is per process, as the Go tests decide it (internal/testutil/gputest.Place):
each rank gets --rank and --device. Single placement puts every rank on one
GPU and needs a distinct NCCL_HOSTID per process (docs/gpu-testing.md);
spread placement puts rank r on GPU r with no NCCL_HOSTID and
NCCL_NVLS_ENABLE=0 (P2P/NVLink), set in the environment by the caller.
With more than two ranks every receiver gets the same broadcasts (and
checks them with --verify).
"""

import argparse
import datetime
import glob
import json
import os
import sys
import threading
import time

# The wire plan (spec section 6) and dtype sizes are the receiver's: both
# sides of a measurement lay chunks out by the same lines.
from receiver import ITEMSIZE, numel, plan_chunks  # noqa: E402


def log(*args):
    print("bench_torch:", *args, file=sys.stderr, flush=True)


def emit(**fields):
    print("RESULT", json.dumps(fields, sort_keys=True), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["trainer", "receiver"], required=True)
    ap.add_argument("--mode", choices=["e2e", "raw"], default="e2e")
    ap.add_argument("--init", required=True, help="tcp://host:port of the process group rendezvous")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rank", type=int, help="default: 0 for the trainer, 1 for a receiver")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--meta", help="JSON as for receiver.py (e2e)")
    ap.add_argument("--raw-bytes", type=int, default=1 << 30)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--deadline", type=float, default=900.0)
    args = ap.parse_args()
    rank = args.rank if args.rank is not None else (0 if args.role == "trainer" else 1)

    def watchdog():
        log("watchdog: deadline passed")
        emit(verdict="FAIL", role=args.role, error="watchdog deadline passed")
        os._exit(4)
    wd = threading.Timer(args.deadline, watchdog)
    wd.daemon = True
    wd.start()

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(args.device)
    dev = torch.device("cuda", args.device)
    dist.init_process_group("nccl", init_method=args.init, world_size=args.world_size, rank=rank,
                            timeout=datetime.timedelta(seconds=300), device_id=dev)
    warm = torch.zeros(1, device=dev)
    dist.all_reduce(warm)
    torch.cuda.synchronize(dev)
    log("rank %d/%d ready, NCCL %s" % (rank, args.world_size, ".".join(map(str, torch.cuda.nccl.version()))))

    if args.mode == "raw":
        n = args.raw_bytes
        if rank == 0:
            buf = (torch.arange(n, device=dev, dtype=torch.int64) % 251).to(torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=dev)
        dist.broadcast(buf, src=0)  # one untimed round: connections are set up lazily
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(args.repeat):
            dist.broadcast(buf, src=0)
        torch.cuda.synchronize(dev)
        secs = time.perf_counter() - t0
        ok = True
        if rank != 0 and args.verify:
            want = (torch.arange(n, device=dev, dtype=torch.int64) % 251).to(torch.uint8)
            ok = bool(torch.equal(buf, want))
        total = n * args.repeat
        emit(verdict="PASS" if ok else "FAIL", role=args.role, mode="raw", bytes=total,
             broadcasts=args.repeat, seconds=secs, gbps=total / secs / 1e9)
        dist.destroy_process_group()
        return 0 if ok else 1

    with open(args.meta) as f:
        meta = json.load(f)
    names, dtypes, shapes = meta["names"], meta["dtype_names"], meta["shapes"]
    packed = bool(meta.get("packed", False))
    threshold = int(meta.get("packed_buffer_size_bytes", 1 << 30))
    sizes = [numel(s) * ITEMSIZE[d] for s, d in zip(shapes, dtypes)]
    chunks = plan_chunks(sizes, packed, threshold)
    total = sum(sizes)
    tdt = {d: getattr(torch, d) for d in ITEMSIZE}

    if rank == 0:
        from safetensors.torch import load_file
        path = meta["checkpoint"]
        files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
        t0 = time.perf_counter()
        sd = {}
        for f in files:
            sd.update(load_file(f, device="cuda:%d" % args.device))
        torch.cuda.synchronize(dev)
        t_loaded = time.perf_counter()
        for chunk in chunks:
            if packed:
                buf = torch.cat([sd[names[i]].to(tdt[dtypes[i]]).contiguous().reshape(-1).view(torch.uint8) for i in chunk])
                dist.broadcast(buf, src=0)
            else:
                t = sd[names[chunk[0]]].to(tdt[dtypes[chunk[0]]]).contiguous()
                dist.broadcast(t, src=0)
        torch.cuda.synchronize(dev)
        t_end = time.perf_counter()
        emit(verdict="PASS", role="trainer", mode="packed" if packed else "non-packed", bytes=total,
             tensors=len(names), broadcasts=len(chunks), seconds=t_end - t0,
             load_seconds=t_loaded - t0, broadcast_seconds=t_end - t_loaded,
             gbps=total / (t_end - t0) / 1e9)
        dist.destroy_process_group()
        return 0

    received = {}
    t0 = time.perf_counter()
    for chunk in chunks:
        if packed:
            nbytes = sum(sizes[i] for i in chunk)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            dist.broadcast(buf, src=0)
            off = 0
            for i in chunk:
                received[names[i]] = buf[off:off + sizes[i]]
                off += sizes[i]
        else:
            i = chunk[0]
            t = torch.empty([int(d) for d in shapes[i]], dtype=tdt[dtypes[i]], device=dev)
            dist.broadcast(t, src=0)
            received[names[i]] = t.reshape(-1).view(torch.uint8)
    torch.cuda.synchronize(dev)
    secs = time.perf_counter() - t0
    bad = []
    if args.verify:
        from safetensors.torch import load_file
        path = meta["checkpoint"]
        files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
        want = {}
        for f in files:
            want.update(load_file(f, device="cuda:%d" % args.device))
        for i, name in enumerate(names):
            w = want[name].to(tdt[dtypes[i]]).contiguous().reshape(-1).view(torch.uint8)
            if not torch.equal(w, received[name]):
                bad.append(name)
    emit(verdict="PASS" if not bad else "FAIL", role="receiver", mode="packed" if packed else "non-packed",
         bytes=total, broadcasts=len(chunks), seconds=secs, gbps=total / secs / 1e9, mismatches=bad[:20],
         verified=args.verify)
    dist.destroy_process_group()
    return 0 if not bad else 1


if __name__ == "__main__":
    try:
        code = main()
    except Exception as e:
        import traceback
        traceback.print_exc()
        emit(verdict="FAIL", error="%s: %s" % (type(e).__name__, e))
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
