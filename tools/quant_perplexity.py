#!/usr/bin/env python3
"""Held-out perplexity of a model file with each llama-quantize preset and with an int8 KV cache, next to
bf16 weights and bf16 KV (for the model card).

Quantizes MODEL with `qkv-model quantize` for each preset, then scores the held-out windows committed beside
the model (MODEL.eval/: heldout_ids.json, summary.json's eval_window) with `qkv-run --logits` (teacher-forced
logits of every position), exactly as tests/integration/test_bundled_model.py scores it through the API.
Usage: quant_perplexity.py BIN_DIR MODEL.gguf [PRESET ...]   (default presets: Q8_0 Q6_K Q5_K_M Q4_K_M)
Each file is scored with KV bf16 and with --kv-dtype int8.
"""
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np


def perplexity(bindir, model, windows, wdt, tmp, kdt="bf16"):
    total, n = 0.0, 0
    out = os.path.join(tmp, "l.bin")
    for win in windows:
        subprocess.run([os.path.join(bindir, "qkv-run"), "--model", model, "--tokens", ",".join(map(str, win)), "-n",
                        "0", "--weights-dtype", wdt, "--kv-dtype", kdt, "--logits", out, "--threads", "2"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        lg = np.fromfile(out, dtype="<f4").reshape(len(win), -1).astype(np.float64)
        lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
        lp = lg[np.arange(len(win) - 1), win[1:]] - lse[:-1]
        total += lp.sum()
        n += len(win) - 1
    return math.exp(-total / n), n


def main():
    bindir, model = sys.argv[1], sys.argv[2]
    presets = sys.argv[3:] or ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M"]
    ev = model[:-len(".gguf")] + ".eval"
    with open(os.path.join(ev, "summary.json")) as f:
        L = json.load(f)["eval_window"]
    with open(os.path.join(ev, "heldout_ids.json")) as f:
        ids = json.load(f)
    windows = [ids[i:i + L] for i in range(0, len(ids), L) if len(ids[i:i + L]) > 1]
    with tempfile.TemporaryDirectory() as tmp:
        base, n = perplexity(bindir, model, windows, "bf16", tmp)
        print("| weights | file MB | perplexity, KV bf16 | vs bf16 | perplexity, KV int8 | int8 vs bf16 KV |")
        print("|---|---:|---:|---:|---:|---:|")

        def row(name, path, wdt, ppl):
            p8, _ = perplexity(bindir, path, windows, wdt, tmp, "int8")
            vs = "" if name == "bf16" else f"{100 * (ppl / base - 1):+.2f}%"
            print(f"| {name} | {os.path.getsize(path) / 1e6:.1f} | {ppl:.3f} | {vs} | {p8:.3f} | "
                  f"{100 * (p8 / ppl - 1):+.2f}% |", flush=True)

        row("bf16", model, "bf16", base)
        for p in presets:
            q = os.path.join(tmp, p + ".gguf")
            subprocess.run([os.path.join(bindir, "qkv-model"), "quantize", model, q, "--type", p, "--quiet"],
                           check=True, stdout=subprocess.DEVNULL)
            row(p, q, "auto", perplexity(bindir, q, windows, "auto", tmp)[0])
        print(f"({n} predicted tokens in {len(windows)} windows of {L})")


if __name__ == "__main__":
    main()
