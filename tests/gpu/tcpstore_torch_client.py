#!/usr/bin/env python3
"""Exercise rlflow's Go TCPStore server (nccl/tcpstore) with a real torch 2.x client.

Run by `go test ./nccl/tcpstore -run TestTorchClient -v` (or the compiled test
binary), which starts the server, passes its address, and plays rank 0:

  * waits until init/ reaches WORLD_SIZE-1 (the two clients below), then,
    once a client is blocked in WAIT on broadcast_from/0/0, publishes the
    pickled ncclUniqueId there (the vLLM rendezvous, deferred WAIT reply);
  * when py/ready is added, waits for this script to block in
    wait(["go/release"]) and then sets it (a deferred wait released by Go).

Everything else is checked here against torch's own client. Prints one
PASS/FAIL line per check and a final PASS or FAIL; exit status 0 on PASS.
"""

import argparse
import os
import pickle
import sys
import threading
import time
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

failures = []


def check(name, cond, detail=""):
    if cond:
        print("PASS: %s" % name, flush=True)
    else:
        print("FAIL: %s %s" % (name, detail), flush=True)
        failures.append(name)


def expect_raise(name, fn, min_s, max_s):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # torch raises DistStoreError / RuntimeError
        dt = time.monotonic() - t0
        check(name, min_s <= dt <= max_s, "raised after %.2fs (%s)" % (dt, type(e).__name__))
        return
    check(name, False, "did not raise")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--expect-id", required=True, help="hex of the 128 id bytes Go publishes")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    print("torch %s, python %s" % (torch.__version__, sys.version.split()[0]), flush=True)
    if int(torch.__version__.split(".")[0]) < 2:
        print("FAIL: torch %s < 2 speaks the old TCPStore protocol" % torch.__version__)
        return 1

    import check_pickle

    nccl_cls = check_pickle.install_shim()
    want_id = bytes.fromhex(args.expect_id)

    def store():
        # Exactly what vLLM's StatelessProcessGroup.create does on a worker.
        return dist.TCPStore(
            args.host, args.port, world_size=args.world_size, is_master=False,
            timeout=timedelta(seconds=60), use_libuv=False)

    rendezvous = {}

    def worker():
        try:
            s = store()
            t0 = time.monotonic()
            blob = s.get("broadcast_from/0/0")
            rendezvous["waited"] = time.monotonic() - t0
            obj = pickle.loads(blob)
            rendezvous["ok"] = type(obj) is nccl_cls and check_pickle.id_bytes(obj) == want_id
            rendezvous["len"] = len(blob)
            rendezvous["store"] = s  # stay connected, idle, like a worker
        except Exception:
            rendezvous["error"] = traceback.format_exc()

    th = threading.Thread(target=worker)
    th.start()

    main_store = store()
    s = main_store

    s.set("py/k", b"v1")
    check("set/get", s.get("py/k") == b"v1")
    s.set("py/k", "v2")  # str values are encoded
    check("set overwrites", s.get("py/k") == b"v2")
    s.set("py/k", b"v1")

    check("add creates", s.add("py/ctr", 5) == 5)
    check("add negative", s.add("py/ctr", -2) == 3)
    check("add stored as decimal", s.get("py/ctr") == b"3")

    check("check present", s.check(["py/k", "py/ctr"]) is True)
    check("check missing", s.check(["py/k", "py/none"]) is False)

    n0 = s.num_keys()
    s.set("py/del", b"x")
    check("num_keys counts a new key", s.num_keys() == n0 + 1)
    check("delete_key existing", s.delete_key("py/del") is True)
    check("delete_key missing", s.delete_key("py/del") is False)
    check("num_keys after delete", s.num_keys() == n0)

    check("compare_set missing, empty expected -> desired", s.compare_set("py/cs", "", "a") == b"a")
    check("compare_set mismatch -> current", s.compare_set("py/cs", "zzz", "b") == b"a")
    check("compare_set match -> desired", s.compare_set("py/cs", "a", "b") == b"b")
    check("compare_set missing, non-empty expected -> expected",
          s.compare_set("py/cs-missing", "exp", "x") == b"exp")
    check("compare_set missing did not create", s.check(["py/cs-missing"]) is False)

    s.append("py/ap", b"ab")
    s.append("py/ap", b"cd")
    check("append", s.get("py/ap") == b"abcd")

    if hasattr(s, "multi_set") and hasattr(s, "multi_get"):
        s.multi_set(["py/m1", "py/m2"], [b"x", b"yy"])
        check("multi_set/multi_get", s.multi_get(["py/m2", "py/m1"]) == [b"yy", b"x"])
    else:
        print("SKIP: this torch has no multi_get/multi_set", flush=True)

    s.wait(["py/k"])
    check("wait on present key", True)
    s.wait(["py/k", "py/ctr"], timedelta(seconds=5))
    check("wait on present keys with timeout", True)

    # Timeouts: the client sends CANCEL_WAIT and must stay in sync.
    expect_raise("wait timeout", lambda: s.wait(["py/never"], timedelta(seconds=1)), 0.9, 10)
    check("usable after wait timeout", s.get("py/k") == b"v1" and s.add("py/ctr", 1) == 4)
    s.set_timeout(timedelta(seconds=1))
    expect_raise("get timeout on a missing key", lambda: s.get("py/never2"), 0.9, 10)
    s.set_timeout(timedelta(seconds=60))
    check("usable after get timeout", s.check(["py/k"]) is True and s.get("py/ap") == b"abcd")

    # A deferred wait released later by the Go side.
    s.add("py/ready", 1)
    t0 = time.monotonic()
    s.wait(["go/release"], timedelta(seconds=60))
    dt = time.monotonic() - t0
    check("deferred wait released by Go (%.2fs)" % dt, s.get("go/release") == b"released" and dt > 0.1)

    th.join(120)
    if "error" in rendezvous:
        check("vLLM worker rendezvous", False, rendezvous["error"])
    else:
        check("vLLM worker rendezvous: get broadcast_from/0/0 (waited %.2fs), %s-byte pickle, id matches"
              % (rendezvous.get("waited", -1), rendezvous.get("len")), rendezvous.get("ok") is True)

    s.set("py/done", b"1")
    print("FAIL" if failures else "PASS", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
