"""The cold-read harness of ``../../h200-2026-11-23g/cold-read/cold_window.py`` (every mode of
it, run by it), with the product's block-slot landing knobs:

    python benchmarks/results/h200-2026-11-23h/cold-read/cold_window.py DIR OUT.json ROUNDS [MODES]

ckptmgr [LB=N] [SL=N] [VF=N] [BA=N] [NOWORK=1] [opts]: the product with N ring buffers of block
   slots for the reads to land in (window.LANDING_BUFFERS of f377d33; 16 MiB = 32 slots each), or
   N block slots (window.LANDING_SLOTS, later commits), N verifier threads (ring.VERIFIERS), N
   landed blocks per verifier task (window._BATCH); NOWORK=1: the landed blocks neither
   checksummed nor copied (the loop's floor); and -23f's options.
ckptmgr PKG=DIR: the product as imported from DIR (for the commit before, extracted there with
   ``git archive COMMIT ckptmgr | tar -x -C DIR``).
"""
import importlib.util
import os
import sys

_G = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "h200-2026-11-23g", "cold-read",
                  "cold_window.py")
_spec = importlib.util.spec_from_file_location("cold_window_23g", _G)
g = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(g)
g.base.__file__ = os.path.abspath(__file__)  # the runs start this script's children


def child(mode, step_dir):
    opts = dict(kv.split("=") for kv in mode.split()[1:] if "=" in kv)
    if mode.startswith("ckptmgr"):
        import ckptmgr.restore.loaders.ring as rg
        import ckptmgr.restore.loaders.window as wn
        if "LB" in opts:
            rg.LANDING_BUFFERS = int(opts["LB"])
        if "VF" in opts:
            rg.VERIFIERS = int(opts["VF"])
        if "SL" in opts:
            wn.LANDING_SLOTS = int(opts["SL"])
        if "BA" in opts:
            wn._BATCH = int(opts["BA"])
        if opts.get("NOWORK") == "1":
            wn.crc32c_value = lambda data: 0
            wn._verify = lambda *a: None
            rg._copier = lambda *a: (lambda blocks, key: None)
        print(f"PKG {os.path.dirname(os.path.dirname(rg.__file__))}", file=sys.stderr)
    return g.child(mode, step_dir)


def main():
    if sys.argv[1] == "child":
        import json
        print("RESULT " + json.dumps(child(sys.argv[2], sys.argv[3])))
        return
    print(g.sysinfo(), flush=True)
    g.base.main()


if __name__ == "__main__":
    main()
