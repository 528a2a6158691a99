#!/usr/bin/env python3
"""Benchmark case (a), the seed's pattern: the trainer process broadcasts its
own parameters to vLLM-like receivers (receiver.py --http), as vLLM's
rlhf_http.py trainer does, for comparison with rlflow's resident trainer
(the GPU worker broadcasting from the trainer's published snapshot).

A Python NCCL rank 0 that owns a model of --model-bytes (a stack of bf16
Linear layers, names layers.<i>.weight / layers.<i>.bias) and an Adam
optimizer:

1. rendezvous with every --servers URL: GET /get_world_size (rank offsets
   1, 1+w1, ...; world 1 + sum), the API generation (GET /version: 0.30+ is
   E, else D; --api to force C, D or E), the TCPStore master at
   --master-address:--master-port holding pickle.dumps(ncclUniqueId) under
   broadcast_from/0/0 (the class from receiver.py's shim at vLLM's legacy
   module path, which D and E both load), or for E with --rendezvous
   unique_id the id in init_info.nccl_unique_id_b64; POST
   /init_weight_transfer_engine to every server (in threads) while this
   process does ncclCommInitRank(world, id, 0) and the warm-up all-reduce;
2. --repeat rounds of: forward/backward/Adam step on random data,
   torch.cuda.synchronize(); t0 = time.time(); POST /start_weight_update;
   POST /update_weights (threads; update_info from the state dict) while
   broadcasting the parameters straight from their storage on the current
   stream (non-packed: one ncclBroadcast per tensor in its dtype; packed:
   receiver.plan_chunks' chunks, each torch.cat into a uint8 buffer and
   broadcast, on --num-buffers streams in turn as vLLM's
   packed_broadcast_producer does); wait for the broadcasts and every
   update_weights reply; POST /finish_weight_update; t1 = time.time().
3. GET /received from every server and compare its SHA-256 per tensor with
   the final weights' (byte-exactness).

Prints "RESULT {json}" (verdict PASS/FAIL, per-round seconds t1-t0, bytes,
tensors, packed, the SHA-256 per tensor of the final weights, the receivers'
verdicts); diagnostics on stderr; exit 0 PASS, 1 FAIL, 2 error, 4 watchdog.

NCCL: the library of --nccl-lib (default RECEIVER_NCCL_LIB, else
libnccl.so.2, which is torch's own once torch is imported); give the
receivers the same one. Two ranks on one GPU need a distinct NCCL_HOSTID
per process (docs/gpu-testing.md); set it in the environment.

Reuses receiver.py's Nccl ctypes wrapper, plan_chunks, NCCL_DTYPES and
install_shim, so both ends of the wire follow the same lines. --self-test
(no torch, no GPU) checks the sizes and the init_info/update_info of each
generation against receiver.py's strict keys and rendezvous rule.
"""

import argparse
import base64
import ctypes
import datetime
import hashlib
import json
import os
import pickle
import socket
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from receiver import ITEMSIZE, NCCL_DTYPES, NCCL_FLOAT32, NCCL_UINT8, Nccl, install_shim, numel, plan_chunks  # noqa: E402

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def log(*a):
    print("bench_seed:", *a, file=sys.stderr, flush=True)


def emit(**fields):
    print("RESULT", json.dumps(fields, sort_keys=True), flush=True)


def parse_size(s):
    """Bytes from "4GiB", "1GB", "1e9" or "1073741824"."""
    t = s.strip().upper().replace(" ", "")
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
    if unit not in SIZE_UNITS or not num:
        raise argparse.ArgumentTypeError("size %r: want a number with B, KB, MB, GB, KiB, MiB or GiB" % s)
    return int(float(num) * SIZE_UNITS[unit])


def http(method, url, body=None, timeout=600.0):
    """(status, decoded JSON body or text) of one request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            code, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        code, raw = e.code, e.read()
    try:
        return code, json.loads(raw) if raw else None
    except ValueError:
        return code, raw.decode("utf-8", "replace")


class Calls:
    """HTTP calls running in threads (the ones that block until the NCCL
    work is done on the receivers' side), watched while NCCL runs here."""

    def __init__(self):
        self.results, self.threads = {}, []

    def start(self, key, method, url, body, timeout):
        def run():
            try:
                self.results[key] = http(method, url, body, timeout)
            except Exception as e:  # connection refused, timeout
                self.results[key] = (None, "%s: %s" % (type(e).__name__, e))
        th = threading.Thread(target=run, name=key, daemon=True)
        th.start()
        self.threads.append(th)

    def failed(self):
        """The first call that finished with a status other than 200."""
        for key, (code, body) in list(self.results.items()):
            if code != 200:
                return "%s answered %s: %s" % (key, code, str(body)[:500])
        return None

    def join(self):
        for th in self.threads:
            th.join()
        bad = self.failed()
        if bad:
            raise RuntimeError(bad)


def free_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def generation(url, forced):
    if forced != "auto":
        return forced
    code, body = http("GET", url + "/version", timeout=30)
    if code == 200 and isinstance(body, dict):
        parts = str(body.get("version", "0")).split(".")
        try:
            if (int(parts[0]), int(parts[1])) >= (0, 30):
                return "E"
        except (ValueError, IndexError):
            pass
    return "D"


def init_info_for(gen, rendezvous, rank_offset, world, master, uid_bytes, packed_keys):
    """init_weight_transfer_engine's init_info for a server of API
    generation gen: the rank offset and world size, master (address,
    port) of the TCPStore or (E) the id's bytes, and (D, E) the packed
    settings."""
    info = {"rank_offset": rank_offset, "world_size": world}
    if rendezvous == "tcpstore":
        info.update(master_address=master[0], master_port=master[1])
    else:
        info["nccl_unique_id_b64"] = base64.b64encode(uid_bytes).decode()
    if gen in ("D", "E"):
        info.update(packed_keys)
    return info


def update_info_for(gen, names, dtype_names, shapes, packed_keys):
    """update_weights' update_info: the tensor table, and (C) the packed
    settings, which D and E take at init instead."""
    info = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
    if gen == "C":
        info.update(packed_keys)
    return info


def self_test():
    """No torch, no GPU: sizes, and the payloads against receiver.py's
    strict keys and rendezvous rule per generation."""
    import receiver
    assert parse_size("4GiB") == 4 << 30 and parse_size("1e9") == 10**9 and parse_size("512MiB") == 512 << 20
    packed = {"packed": True, "packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2}
    uid = bytes(range(128))
    allowed_init = {"C": receiver.INIT_KEYS, "D": receiver.INIT_KEYS | receiver.PACKED_KEYS,
                    "E": receiver.INIT_KEYS | receiver.PACKED_KEYS | {receiver.UNIQUE_ID_KEY}}
    allowed_update = {"C": receiver.UPDATE_KEYS | receiver.PACKED_KEYS, "D": receiver.UPDATE_KEYS, "E": receiver.UPDATE_KEYS}
    for gen in "CDE":
        for rdv in (("tcpstore", "unique_id") if gen == "E" else ("tcpstore",)):
            info = init_info_for(gen, rdv, 2, 3, ("127.0.0.1", 29500), uid, packed)
            assert set(info) <= allowed_init[gen], (gen, rdv, info)
            if gen == "E":
                how, got = receiver.unique_id_source(info)
                assert how == rdv and (got == uid if rdv == "unique_id" else got == ("127.0.0.1", 29500)), (how, got)
            src = info if gen != "C" else update_info_for(gen, [], [], [], packed)
            assert src.get("packed") is True and src.get("packed_buffer_size_bytes") == 1 << 30, (gen, src)
        up = update_info_for(gen, ["a"], ["bfloat16"], [[2]], packed)
        assert set(up) <= allowed_update[gen] and set(up) >= receiver.UPDATE_KEYS, (gen, up)
    print("bench_seed self-test PASS")


def build_model(torch, total_bytes, hidden, dev):
    """A stack of bf16 Linear(hidden, hidden) layers of about total_bytes."""
    per_layer = (hidden * hidden + hidden) * 2
    n = max(1, round(total_bytes / per_layer))

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, device=dev, dtype=torch.bfloat16) for _ in range(n))

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x
    return Stack()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", help="comma-separated base URLs of receiver.py --http servers")
    ap.add_argument("--self-test", action="store_true", help="check sizes and payloads against receiver.py (no torch, no GPU)")
    ap.add_argument("--api", default="auto", choices=["auto", "C", "D", "E"], help="the servers' API generation (auto: GET /version)")
    ap.add_argument("--rendezvous", default="tcpstore", choices=["tcpstore", "unique_id"],
                    help="how the servers get the NCCL id: the pickled id in this process's TCPStore, or (E only) init_info.nccl_unique_id_b64")
    ap.add_argument("--master-address", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, default=0, help="TCPStore port (0: a free one)")
    ap.add_argument("--model-bytes", type=parse_size, default=parse_size("1GiB"))
    ap.add_argument("--hidden", type=int, default=4096, help="Linear layers are hidden x hidden")
    ap.add_argument("--batch", type=int, default=8, help="rows of the random training batch")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--packed", action="store_true")
    ap.add_argument("--buffer-bytes", type=parse_size, default=parse_size("1GiB"), help="packed_buffer_size_bytes")
    ap.add_argument("--num-buffers", type=int, default=2, help="packed_num_buffers (streams in turn)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nccl-lib", default=os.environ.get("RECEIVER_NCCL_LIB", "libnccl.so.2"))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one init or update may take")
    ap.add_argument("--deadline", type=float, default=1800.0, help="watchdog: exit 4 after this many seconds")
    ap.add_argument("--no-verify", action="store_true", help="skip GET /received")
    args = ap.parse_args()
    if args.self_test:
        self_test()
        return 0
    if not args.servers:
        ap.error("--servers is required")

    def watchdog():
        log("watchdog: %.0fs deadline passed" % args.deadline)
        emit(verdict="FAIL", error="watchdog deadline passed")
        os._exit(4)
    wd = threading.Timer(args.deadline, watchdog)
    wd.daemon = True
    wd.start()

    import torch
    import torch.distributed as dist

    servers = [s.strip().rstrip("/") for s in args.servers.split(",") if s.strip()]
    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    torch.manual_seed(args.seed)

    model = build_model(torch, args.model_bytes, args.hidden, dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    items = list(model.state_dict().items())  # views of the parameters' own storage
    names = [k for k, _ in items]
    dtype_names = [str(t.dtype).rsplit(".", 1)[-1] for _, t in items]
    shapes = [list(t.shape) for _, t in items]
    sizes = [numel(s) * ITEMSIZE[d] for s, d in zip(shapes, dtype_names)]
    total = sum(sizes)
    chunks = plan_chunks(sizes, args.packed, args.buffer_bytes)
    for _, t in items:
        if not t.is_contiguous():
            raise RuntimeError("a parameter is not contiguous: cannot broadcast from its storage")
    log("model: %d tensors, %d bytes (%s), %d broadcasts per update" % (
        len(items), total, "packed T=%d x%d" % (args.buffer_bytes, args.num_buffers) if args.packed else "non-packed", len(chunks)))

    # -- rendezvous --
    gens = {s: generation(s, args.api) for s in servers}
    sizes_ws = {}
    for s in servers:
        code, body = http("GET", s + "/get_world_size", timeout=30)
        if code != 200 or not isinstance(body, dict) or not isinstance(body.get("world_size"), int):
            raise RuntimeError("%s/get_world_size answered %s: %s" % (s, code, body))
        sizes_ws[s] = body["world_size"]
    world = 1 + sum(sizes_ws.values())
    if args.rendezvous == "unique_id" and any(g != "E" for g in gens.values()):
        raise RuntimeError("--rendezvous unique_id needs every server at API generation E: %s" % gens)
    shim = install_shim(backends=False)  # the legacy module: C, D and E load its pickle
    nccl = Nccl(args.nccl_lib, shim.ncclUniqueId)
    nccl.lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(shim.ncclUniqueId)]
    uid = shim.ncclUniqueId()
    nccl.check(nccl.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    log("NCCL %d from %s; world size %d; servers %s" % (nccl.version(), args.nccl_lib, world,
                                                        ", ".join("%s (%s, %d)" % (s, gens[s], sizes_ws[s]) for s in servers)))
    store = None
    port = None
    if args.rendezvous == "tcpstore":
        port = args.master_port or free_port(args.master_address)
        store = dist.TCPStore(args.master_address, port, world_size=world, is_master=True,
                              timeout=datetime.timedelta(seconds=300), wait_for_workers=False, use_libuv=False)
        store.set("broadcast_from/0/0", pickle.dumps(uid, protocol=4))
    packed_keys = {"packed": args.packed, "packed_buffer_size_bytes": args.buffer_bytes, "packed_num_buffers": args.num_buffers}
    uid_bytes = ctypes.string_at(ctypes.addressof(uid), 128)
    calls = Calls()
    offset = 1
    t_init = time.perf_counter()
    for s in servers:
        info = init_info_for(gens[s], args.rendezvous, offset, world, (args.master_address, port), uid_bytes, packed_keys)
        calls.start("%s/init_weight_transfer_engine" % s, "POST", s + "/init_weight_transfer_engine", {"init_info": info}, args.timeout)
        offset += sizes_ws[s]

    comm_box = {}

    def init_comm():
        try:
            torch.cuda.set_device(dev)  # the CUDA device is per thread
            comm = nccl.init_rank(world, uid, 0)
            warm = torch.zeros(1, dtype=torch.float32, device=dev)
            stream = torch.cuda.current_stream(dev)
            nccl.all_reduce(ctypes.c_void_p(warm.data_ptr()), 1, NCCL_FLOAT32, comm, ctypes.c_void_p(stream.cuda_stream))
            stream.synchronize()
            comm_box["comm"] = comm
        except Exception as e:
            comm_box["error"] = "%s: %s" % (type(e).__name__, e)
    th = threading.Thread(target=init_comm, name="nccl-init", daemon=True)
    th.start()
    while th.is_alive():
        bad = calls.failed()
        if bad:
            raise RuntimeError("init: %s (ncclCommInitRank cannot complete)" % bad)
        th.join(0.05)
    if "error" in comm_box:
        raise RuntimeError("init: " + comm_box["error"])
    calls.join()
    comm = comm_box["comm"]
    log("communicator ready in %.2fs (rendezvous %s)" % (time.perf_counter() - t_init, args.rendezvous))

    streams = [torch.cuda.Stream(device=dev) for _ in range(max(1, args.num_buffers))]

    def broadcast(calls, deadline):
        """Every tensor or chunk, from the parameters' storage."""
        def poll():
            bad = calls.failed()
            if bad:
                raise RuntimeError("a receiver failed while we broadcast: %s" % bad)
        cur = torch.cuda.current_stream(dev)
        if not args.packed:
            sp = ctypes.c_void_p(cur.cuda_stream)
            for (name, t), d in zip(items, dtype_names):
                nccl.broadcast(ctypes.c_void_p(t.data_ptr()), t.numel(), NCCL_DTYPES[d], comm, sp)
            nccl.wait(cur, comm, deadline, poll)
            return
        bufs = [None] * len(streams)
        for k, chunk in enumerate(chunks):
            j = k % len(streams)
            s = streams[j]
            nccl.wait(s, comm, deadline, poll)  # this buffer's previous broadcast is done
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                bufs[j] = torch.cat([items[i][1].reshape(-1).view(torch.uint8) for i in chunk])
                nccl.broadcast(ctypes.c_void_p(bufs[j].data_ptr()), bufs[j].numel(), NCCL_UINT8, comm, ctypes.c_void_p(s.cuda_stream))
        for s in streams:
            nccl.wait(s, comm, deadline, poll)

    rounds = []
    for r in range(args.repeat):
        t_train = time.perf_counter()
        x = torch.randn(args.batch, args.hidden, device=dev, dtype=torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(dev)
        train_seconds = time.perf_counter() - t_train

        t0 = time.time()
        for s in servers:
            code, body = http("POST", s + "/start_weight_update", {}, timeout=60)
            if code != 200:
                raise RuntimeError("%s/start_weight_update answered %s: %s" % (s, code, body))
        t_start = time.time()
        calls = Calls()
        for s in servers:
            calls.start("%s/update_weights" % s, "POST", s + "/update_weights", {"update_info": update_info_for(gens[s], names, dtype_names, shapes, packed_keys)}, args.timeout)
        broadcast(calls, time.monotonic() + args.timeout)
        t_sent = time.time()
        calls.join()
        t_replied = time.time()
        for s in servers:
            code, body = http("POST", s + "/finish_weight_update", {"weight_version": "bench-seed-%d" % (r + 1)}, timeout=60)
            if code != 200:
                raise RuntimeError("%s/finish_weight_update answered %s: %s" % (s, code, body))
        t1 = time.time()
        rounds.append({"seconds": t1 - t0, "start_seconds": t_start - t0, "broadcast_seconds": t_sent - t_start,
                       "reply_wait_seconds": t_replied - t_sent, "finish_seconds": t1 - t_replied,
                       "train_seconds": train_seconds, "loss": float(loss)})
        log("round %d: %.3fs (broadcast %.3fs, %.2f GB/s)" % (r + 1, t1 - t0, t_sent - t_start, total / max(t_sent - t_start, 1e-9) / 1e9))

    digests = {name: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest() for name, t in items}
    receivers, problems = {}, []
    if not args.no_verify:
        for s in servers:
            code, body = http("GET", s + "/received", timeout=120)
            got = body.get("sha256", {}) if code == 200 and isinstance(body, dict) else {}
            bad = sorted(n for n in names if got.get(n) != digests[n])
            receivers[s] = {"match": not bad, "mismatches": bad[:10], "updates": body.get("updates") if isinstance(body, dict) else None,
                            "version": body.get("version") if isinstance(body, dict) else None}
            if bad:
                problems.append("%s: %d tensors differ (first %s)" % (s, len(bad), bad[:3]))
    secs = [x["seconds"] for x in rounds]
    emit(verdict="FAIL" if problems else "PASS", problems=problems, case="seed", servers=servers,
         api={s: gens[s] for s in servers}, rendezvous=args.rendezvous, world_size=world, nccl=nccl.version(),
         torch=torch.__version__, packed=args.packed, buffer_bytes=args.buffer_bytes if args.packed else None,
         num_buffers=args.num_buffers if args.packed else None, bytes=total, tensors=len(items), broadcasts=len(chunks),
         rounds=rounds, seconds=secs, seconds_median=statistics.median(secs) if secs else None,
         gbps_median=total / statistics.median(secs) / 1e9 if secs else None, verified=not args.no_verify,
         receivers=receivers, sha256=digests)
    del store
    return 1 if problems else 0


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
