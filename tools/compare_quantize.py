#!/usr/bin/env python3
"""`qkv-model quantize` against llama.cpp's `llama-quantize`, tensor by tensor (not part of CI).

Both quantize the same source file with the same preset; for every tensor this prints the type each chose
(they must agree) and the RMSE of each against the source values, and fails when ours exceeds 1.01 × theirs.
Dequantization uses llama.cpp's own gguf-py. Build llama-quantize from the llama.cpp source that npm's
node-llama-cpp@3.21.1 ships (llama/gitRelease.bundle, cloned; cmake --build build --target llama-quantize).
Usage: compare_quantize.py --bin build/bin --llama-quantize PATH --gguf-py PATH SOURCE.gguf PRESET [PRESET ...]
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--llama-quantize", required=True)
    ap.add_argument("--gguf-py", required=True)
    ap.add_argument("source")
    ap.add_argument("presets", nargs="+")
    a = ap.parse_args()
    sys.path.insert(0, a.gguf_py)
    import gguf
    from gguf import quants

    def tensors(path):
        r = gguf.GGUFReader(path)
        return {t.name: (t.tensor_type, np.array(t.data)) for t in r.tensors}

    def values(ttype, data):
        if ttype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return data.astype(np.float64).ravel()
        return quants.dequantize(data, ttype).astype(np.float64).ravel()

    src = {k: values(*v) for k, v in tensors(a.source).items()}
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for preset in a.presets:
            theirs_p, ours_p = os.path.join(tmp, "theirs.gguf"), os.path.join(tmp, "ours.gguf")
            subprocess.run([a.llama_quantize, a.source, theirs_p, preset, "2"], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            subprocess.run([os.path.join(a.bin, "qkv-model"), "quantize", a.source, ours_p, "--type", preset,
                            "--quiet"], check=True, stdout=subprocess.DEVNULL)
            theirs, ours = tensors(theirs_p), tensors(ours_p)
            worst = 0.0
            for name in src:
                tt, td = theirs[name]
                ot, od = ours[name]
                if tt == gguf.GGMLQuantizationType.F32 and ot == gguf.GGMLQuantizationType.F32:
                    continue
                e_t = float(np.sqrt(np.mean((values(tt, td) - src[name]) ** 2)))
                e_o = float(np.sqrt(np.mean((values(ot, od) - src[name]) ** 2)))
                ratio = e_o / e_t if e_t > 0 else (1.0 if e_o == 0 else float("inf"))
                worst = max(worst, ratio)
                ok = tt == ot and ratio <= 1.01
                bad += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {preset:7s} {name:28s} llama.cpp {tt.name:6s} rmse {e_t:.4e}  "
                      f"ours {ot.name:6s} rmse {e_o:.4e}  ratio {ratio:.4f}")
            print(f"== {preset}: worst ratio {worst:.4f}")
    print("compare_quantize:", "all within 1.01x and same types" if bad == 0 else f"{bad} tensors failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
