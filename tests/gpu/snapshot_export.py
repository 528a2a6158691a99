#!/usr/bin/env python3
"""A resident trainer's snapshot, exported with CUDA IPC, for the NCCL engine's
GPU test (transfer/ncclengine TestGPUSnapshotBroadcast). A TEST DOUBLE of the
publish side of trainer/PROTOCOL.md only: no model, no optimizer, no protocol
pipes (trainer/python speaks the protocol).

It builds tensors with torch on --device (int64, float32, bfloat16 of awkward
sizes, a zero-size one and a uint8 one, largest item size first so that the
layout has no padding and every packed chunk is one range), copies them into
one snapshot buffer laid out as PROTOCOL.md "publish" says (back to back in
order, each at the next multiple of its item size), synchronises, and prints
the publish reply the GPU worker would get, with the SHA-256 of every tensor
as the snapshot holds it.

Protocol: diagnostics on stderr. On stdout: "SKIP <reason>" then exit 0 when
torch or CUDA is missing; otherwise "READY {reply}" where reply is the publish
reply's fields (version, ipc "cuda", handle = standard base64 of
storage._share_cuda_()[1], storage_bytes, storage_offset, device, gpu_uuid,
tensors, snapshot_seconds) plus pid, torch and sha256 (name -> hex). Then
commands on stdin, one a line:
  publish <seed>  -> new bytes into the same buffer (the handle stays):
                     "PUBLISHED {reply}" with version "v<seed>"
  exit            -> "RESULT {json}" (intact: the buffer still holds the last
                     publish's bytes after the importer's reads), exit 0
EOF on stdin (the importer died) exits 3 without a RESULT.
"""

import argparse
import base64
import hashlib
import json
import os
import sys
import time


def log(*a):
    print("snapshot_export:", *a, file=sys.stderr, flush=True)


def emit(word, obj=None):
    print(word if obj is None else word + " " + json.dumps(obj, separators=(",", ":")), flush=True)


def specs(layers):
    """(name, dtype, shape) in state-dict order: int64, float32, bfloat16, uint8."""
    out = [("model.step", "int64", [1]),
           ("final_norm.bias", "float32", [1023]),
           ("lm_head.bias", "float32", [32001])]
    out.append(("embed.weight", "bfloat16", [8000, 1024]))
    for i in range(layers):
        p = "layers.%d." % i
        out += [(p + "attn.qkv", "bfloat16", [3 * 1024, 1024]),
                (p + "attn.scale", "bfloat16", [3, 5, 7]),
                (p + "mlp.up", "bfloat16", [2816, 1024]),
                (p + "mlp.down", "bfloat16", [1024, 2816]),
                (p + "norm", "bfloat16", [1024]),
                (p + "odd", "bfloat16", [4097])]
    out += [("empty", "bfloat16", [0, 4]), ("mask", "uint8", [17])]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "no torch here"
        emit("SKIP torch cannot be imported by %s: %s" % (sys.executable, e))
        return 0
    if not torch.cuda.is_available():
        emit("SKIP torch %s sees no CUDA device" % torch.__version__)
        return 0
    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)

    layout, end = [], 0
    for name, dtype, shape in specs(args.layers):
        dt = getattr(torch, dtype)
        item = torch.empty(0, dtype=dt).element_size()
        numel = 1
        for d in shape:
            numel *= d
        off = (end + item - 1) // item * item
        layout.append({"name": name, "dtype": dtype, "shape": shape, "offset": off, "bytes": numel * item})
        end = off + numel * item
    # The snapshot buffer, allocated once: every publish writes into it, so
    # its IPC handle stays the same (PROTOCOL.md).
    snap = torch.empty(end, dtype=torch.uint8, device=dev)
    share = snap.untyped_storage()._share_cuda_()
    if len(share) < 4 or not isinstance(share[1], bytes):
        emit("RESULT", {"verdict": "FAIL", "error": "unexpected _share_cuda_() layout: %d elements" % len(share)})
        return 2
    try:
        uuid = str(torch.cuda.get_device_properties(dev).uuid).lower().removeprefix("gpu-")
    except Exception:  # noqa: BLE001 - older torch: no uuid, the worker skips the check
        uuid = ""
    digests = {}

    def publish(seed):
        g = torch.Generator(device=dev)
        g.manual_seed(seed)
        tensors = []
        for e in layout:
            dt = getattr(torch, e["dtype"])
            if dt.is_floating_point:
                t = torch.randn(e["shape"], generator=g, device=dev, dtype=dt)
            else:
                t = torch.randint(0, 255, e["shape"], generator=g, device=dev, dtype=dt)
            tensors.append(t)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for e, t in zip(layout, tensors):
            if e["bytes"]:
                snap[e["offset"]:e["offset"] + e["bytes"]].copy_(t.reshape(-1).view(torch.uint8))
        torch.cuda.synchronize()  # the reply comes once the copies completed
        secs = time.perf_counter() - start
        host = snap.cpu().numpy()
        digests.clear()
        for e in layout:
            digests[e["name"]] = hashlib.sha256(host[e["offset"]:e["offset"] + e["bytes"]].tobytes()).hexdigest()
        return {"version": "v%d" % seed, "ipc": "cuda", "handle": base64.b64encode(share[1]).decode(),
                "storage_bytes": share[2], "storage_offset": share[3], "device": args.device, "gpu_uuid": uuid,
                "tensors": layout, "snapshot_seconds": secs, "pid": os.getpid(), "torch": torch.__version__,
                "sha256": dict(digests)}

    reply = publish(args.seed)
    log("snapshot of %d tensors, %d bytes (storage %d bytes at block offset %d), handle %d bytes, on device %d"
        % (len(layout), end, share[2], share[3], len(share[1]), args.device))
    emit("READY", reply)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "publish" and len(cmd) == 2:
            emit("PUBLISHED", publish(int(cmd[1])))
        elif cmd[0] == "exit":
            host = snap.cpu().numpy()
            intact = all(hashlib.sha256(host[e["offset"]:e["offset"] + e["bytes"]].tobytes()).hexdigest() == digests[e["name"]]
                         for e in layout)
            emit("RESULT", {"verdict": "PASS" if intact else "FAIL", "intact": intact})
            return 0 if intact else 1
        else:
            log("unknown command %r" % line.strip())
    log("stdin closed before exit: the importer is gone")
    return 3


if __name__ == "__main__":
    sys.exit(main())
