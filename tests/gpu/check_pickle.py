#!/usr/bin/env python3
"""Cross-check rlflow's pickled ncclUniqueId (nccl/ncclid) against CPython's pickle.

The script builds a throwaway module tree at
vllm/distributed/device_communicators/pynccl_wrapper.py defining the same
ctypes class vLLM defines, so no vLLM (and no torch) is needed.

  check_pickle.py loads PICKLE_HEX ID_HEX
      pickle.loads(PICKLE_HEX) must yield an ncclUniqueId holding ID_HEX.
  check_pickle.py dumps ID_HEX [PROTOCOL]
      prints pickle.dumps(ncclUniqueId(ID_HEX), protocol=PROTOCOL or 4) as hex.
  check_pickle.py selftest
      round trip of a fixed id through dumps/loads with protocols 4 and 5.

A hex argument of the form @PATH is read from that file. The environment
variable CHECK_PICKLE_MODULE names another module path for the class (vLLM's
newer layout keeps it at vllm.backends.distributed.device_communicators.
pynccl_wrapper). Prints PASS/FAIL lines; exit status 0 only when everything
passed.
"""

import ctypes
import os
import pickle
import sys
import tempfile

MODULE = os.environ.get("CHECK_PICKLE_MODULE", "vllm.distributed.device_communicators.pynccl_wrapper")
SHIM = '''import ctypes


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]
'''


def install_shim():
    if "vllm" in sys.modules:
        raise SystemExit("FAIL: a vllm module is already imported; run in a clean interpreter")
    root = tempfile.mkdtemp(prefix="rlflow-pickle-")
    pkg = root
    for part in MODULE.split(".")[:-1]:
        pkg = os.path.join(pkg, part)
        os.makedirs(pkg)
        open(os.path.join(pkg, "__init__.py"), "w").close()
    with open(os.path.join(pkg, MODULE.split(".")[-1] + ".py"), "w") as f:
        f.write(SHIM)
    sys.path.insert(0, root)
    import importlib

    mod = importlib.import_module(MODULE)
    if not mod.__file__.startswith(root):
        raise SystemExit("FAIL: imported %s from %s, not the shim" % (MODULE, mod.__file__))
    return mod.ncclUniqueId


def arg_hex(s):
    if s.startswith("@"):
        with open(s[1:]) as f:
            s = f.read()
    return bytes.fromhex(s.strip())


def make_id(cls, raw):
    if len(raw) != 128:
        raise SystemExit("FAIL: id is %d bytes, want 128" % len(raw))
    x = cls()
    ctypes.memmove(ctypes.addressof(x), raw, 128)
    return x


def id_bytes(x):
    return ctypes.string_at(ctypes.addressof(x), 128)


def do_loads(cls, blob, want):
    obj = pickle.loads(blob)
    if type(obj) is not cls:
        print("FAIL: loads: got %r, want %s.%s" % (type(obj), MODULE, cls.__name__))
        return False
    got = id_bytes(obj)
    if got != want:
        print("FAIL: loads: id bytes differ:\n got  %s\n want %s" % (got.hex(), want.hex()))
        return False
    print("PASS: loads: %d-byte pickle (protocol %d) -> ncclUniqueId with the expected 128 bytes" % (len(blob), blob[1]))
    return True


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    cls = install_shim()
    cmd = argv[1]
    if cmd == "loads" and len(argv) == 4:
        return 0 if do_loads(cls, arg_hex(argv[2]), arg_hex(argv[3])) else 1
    if cmd == "dumps" and len(argv) in (3, 4):
        proto = int(argv[3]) if len(argv) == 4 else 4
        print(pickle.dumps(make_id(cls, arg_hex(argv[2])), protocol=proto).hex())
        return 0
    if cmd == "selftest" and len(argv) == 2:
        raw = bytes((i * 37 + 5) % 256 for i in range(128))
        ok = True
        for proto in (4, 5):
            blob = pickle.dumps(make_id(cls, raw), protocol=proto)
            want_len = 247 - 52 + len(MODULE)
            if len(blob) != want_len:
                print("FAIL: protocol %d pickle is %d bytes, want %d" % (proto, len(blob), want_len))
                ok = False
            ok = do_loads(cls, blob, raw) and ok
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
