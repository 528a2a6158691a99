#!/usr/bin/env python3
"""CUDA IPC exporter for rlflow's feasibility probe of issue 18 (nccl/cudaipc).

It plays a resident PyTorch trainer that hands its parameters to the GPU
worker without a file: it allocates tensors with torch on --device, gets the
IPC handle of each tensor's storage exactly as torch.multiprocessing does
(storage._share_cuda_(), the call reductions.reduce_tensor makes), and prints
them for the Go importer (nccl/cudaipc's TestGPUTorchExportGoImport), which
opens every handle, reads the bytes in place and compares their SHA-256.

Tensors (all filled by torch.randn from --seed, on the device):

* bf16_2048x1024 (4 MiB) and f32_786433 (3 MiB + 4 bytes): two requests
  between 1 and 10 MB, which torch's caching allocator carves out of one
  20 MiB cudaMalloc block: the same handle with different storage offsets.
* f32_1000 (4000 bytes): from the allocator's 2 MiB small-request pool.
* bf16_view_at_offset: a 1024x1024 view starting at element 12345 of a
  5,000,000-element bf16 storage: storage offset 0 in its block (likely),
  view offset 24690 bytes into the storage.
* snapshot (--snapshot-mib MiB of bf16): the source of the snapshot copy
  figure.
* scratch_f32 (4 MiB of zeros): the importer writes it, this process checks
  the bytes it then sees (check-scratch).

What torch.UntypedStorage._share_cuda_() returns (torch 2.x; checked at run
time, the probe stops on any other shape): an 8-tuple
  0 device               int, the CUDA device index
  1 handle               bytes: torch's shareable handle of the cudaMalloc
                         block that holds the storage: version byte (2 up to
                         torch 2.12, 3 from 2.13), type byte 'c' (cudaMalloc
                         block) then the 64-byte cudaIpcMemHandle_t of the
                         block's base; type 'e' (expandable segments) is a
                         different payload; a bare 64-byte handle is the
                         format before the framing
  2 storage_size_bytes   int, the storage's size (not the block's)
  3 storage_offset_bytes int, where the storage starts in the block
  4 ref_counter_handle   bytes, name of the shared-memory file of torch's
                         cross-process reference counts
  5 ref_counter_offset   int, this storage's slot in that file
  6 event_handle         bytes, a cudaIpcEventHandle_t (64 bytes) to wait on
                         before reading when event_sync_required
  7 event_sync_required  bool
A tensor's bytes start at base(handle) + storage_offset_bytes +
tensor.storage_offset() * element_size.

Protocol: diagnostics on stderr. On stdout: "SKIP <reason>" then exit 0 when
torch or CUDA is missing; otherwise "READY {json}" (torch and CUDA versions,
the tuple's observed layout, one entry per tensor with the base64 handle,
offsets, sizes and SHA-256), then it waits for commands on stdin, one a line:
  check-scratch <sha256 hex>  -> "SCRATCH {json}" (match, sha256 seen)
  exit                        -> "RESULT {json}", exit 0
EOF on stdin (the importer died) exits 3 without a RESULT.
"""

import argparse
import base64
import hashlib
import json
import os
import sys

SHARE_CUDA_FIELDS = (
    "device",
    "handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)


def log(*a):
    print("ipc_export:", *a, file=sys.stderr, flush=True)


def emit(word, obj=None):
    line = word if obj is None else word + " " + json.dumps(obj, separators=(",", ":"))
    print(line, flush=True)


def sha256_of(torch, t):
    """SHA-256 of the tensor's bytes in row-major order, as the importer reads them."""
    b = t.contiguous().view(-1).view(torch.uint8).cpu()
    return hashlib.sha256(b.numpy().data).hexdigest()


def describe_handle(h):
    if len(h) == 64:
        return {"framing": "raw 64-byte cudaIpcMemHandle_t"}
    if len(h) >= 2:
        return {"framing": "version %d, type %r" % (h[0], chr(h[1])), "version": h[0], "type": chr(h[1])}
    return {"framing": "unknown (%d bytes)" % len(h)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--snapshot-mib", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=18)
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
    g = torch.Generator(device=dev)
    g.manual_seed(args.seed)

    def randn(n, dtype):
        return torch.randn(n, generator=g, device=dev, dtype=dtype)

    keep = {}  # every tensor and storage stays referenced until exit
    tensors = {}
    tensors["bf16_2048x1024"] = randn(2048 * 1024, torch.bfloat16).view(2048, 1024)
    tensors["f32_786433"] = randn(786433, torch.float32)
    tensors["f32_1000"] = randn(1000, torch.float32)
    keep["view_base"] = randn(5_000_000, torch.bfloat16)
    tensors["bf16_view_at_offset"] = keep["view_base"][12345 : 12345 + 1024 * 1024].view(1024, 1024)
    snapshot_elems = args.snapshot_mib * (1 << 20) // 2
    tensors["snapshot"] = randn(snapshot_elems, torch.bfloat16)
    tensors["scratch_f32"] = torch.zeros(1 << 20, device=dev, dtype=torch.float32)
    # reduce_tensor (what torch.multiprocessing pickles, and what vLLM's ipc
    # backend receives) on a tensor of its own: recorded for the next step of
    # issue 18, not used by the importer.
    keep["reduce_doc"] = randn(16, torch.float32)
    torch.cuda.synchronize()

    layout = None
    entries = []
    for name, t in tensors.items():
        share = t.untyped_storage()._share_cuda_()
        types = [type(v).__name__ for v in share]
        if layout is None:
            layout = {"len": len(share), "types": types}
        if len(share) != len(SHARE_CUDA_FIELDS) or types[1] != "bytes":
            log("unexpected _share_cuda_() result: %d elements of types %s" % (len(share), types))
            emit("RESULT", {"verdict": "FAIL", "error": "unexpected _share_cuda_() layout", "layout": {"len": len(share), "types": types}})
            return 2
        f = dict(zip(SHARE_CUDA_FIELDS, share))
        entry = {
            "name": name,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "element_size": t.element_size(),
            "nbytes": t.numel() * t.element_size(),
            "device": f["device"],
            "handle": base64.b64encode(f["handle"]).decode(),
            "handle_len": len(f["handle"]),
            "handle_framing": describe_handle(f["handle"]),
            "storage_size_bytes": f["storage_size_bytes"],
            "storage_offset_bytes": f["storage_offset_bytes"],
            "view_offset_bytes": t.storage_offset() * t.element_size(),
            "event_sync_required": bool(f["event_sync_required"]),
            "ref_counter_offset": f["ref_counter_offset"],
            "sha256": sha256_of(torch, t),
        }
        entries.append(entry)
        log("%s: %s %s, %d bytes, handle %d bytes (%s), storage %d bytes at block offset %d, view offset %d"
            % (name, entry["dtype"], entry["shape"], entry["nbytes"], entry["handle_len"],
               entry["handle_framing"]["framing"], entry["storage_size_bytes"],
               entry["storage_offset_bytes"], entry["view_offset_bytes"]))

    from torch.multiprocessing.reductions import reduce_tensor

    try:
        rebuild, rargs = reduce_tensor(keep["reduce_doc"])
        reduce_doc = {"rebuild": rebuild.__name__, "len": len(rargs), "types": [type(v).__name__ for v in rargs]}
    except Exception as e:  # noqa: BLE001 - documentation only, the probe goes on
        reduce_doc = {"error": repr(e)}

    emit("READY", {
        "pid": os.getpid(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": args.device,
        "device_name": torch.cuda.get_device_name(dev),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "allocator_backend": torch.cuda.get_allocator_backend(),
        "share_cuda_layout": dict(layout, fields=list(SHARE_CUDA_FIELDS)),
        "reduce_tensor_layout": reduce_doc,
        "snapshot": "snapshot",
        "scratch": "scratch_f32",
        "tensors": entries,
    })

    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "check-scratch" and len(cmd) == 2:
            torch.cuda.synchronize()
            seen = sha256_of(torch, tensors["scratch_f32"])
            emit("SCRATCH", {"match": seen == cmd[1], "sha256": seen})
        elif cmd[0] == "exit":
            # The tensors must be intact after the importer's reads.
            intact = all(sha256_of(torch, tensors[e["name"]]) == e["sha256"] for e in entries if e["name"] != "scratch_f32")
            emit("RESULT", {"verdict": "PASS" if intact else "FAIL", "sources_intact": intact})
            return 0 if intact else 1
        else:
            log("unknown command %r" % line.strip())
    log("stdin closed before exit: the importer is gone")
    return 3


if __name__ == "__main__":
    sys.exit(main())
