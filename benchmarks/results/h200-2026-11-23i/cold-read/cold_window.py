"""The cold-read harness of ``../../h200-2026-11-23h/cold-read/cold_window.py`` (every mode and
knob of it, run by it), with one knob more:

    python benchmarks/results/h200-2026-11-23i/cold-read/cold_window.py DIR OUT.json ROUNDS [MODES]

ckptmgr RA=N: a reap of the product's read queue waits for N of the reads in flight (all of
   them at most; window._REAP_AT_LEAST). RA=1 is the queue before: each reap returns as soon
   as one read is in.
"""
import importlib.util
import os
import sys

_H = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "h200-2026-11-23h", "cold-read",
                  "cold_window.py")
_spec = importlib.util.spec_from_file_location("cold_window_23h", _H)
h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(h)
h.g.base.__file__ = os.path.abspath(__file__)  # the runs start this script's children


def child(mode, step_dir):
    opts = dict(kv.split("=") for kv in mode.split()[1:] if "=" in kv)
    if mode.startswith("ckptmgr") and "RA" in opts:
        import ckptmgr.restore.loaders.window as wn
        wn._REAP_AT_LEAST = int(opts["RA"])
    return h.child(mode, step_dir)


def main():
    if sys.argv[1] == "child":
        import json
        print("RESULT " + json.dumps(child(sys.argv[2], sys.argv[3])))
        return
    print(h.g.sysinfo(), flush=True)
    h.g.base.main()


if __name__ == "__main__":
    main()
