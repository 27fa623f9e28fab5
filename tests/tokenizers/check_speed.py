#!/usr/bin/env python3
"""Tokenization is O(n log n) for every tokenizer: 1 MB of letters, of digits, of spaces, of CJK text and of
special-token text each encode through `qkv-model tokenize` (one core) with the real GPT-2, Qwen3, Llama 3 and
Llama 2 vocabularies. Prints the seconds of each; the target is under 1 s. It fails only past 10 s, which a
quadratic merge (hours on 1 MB) cannot meet and a noisy machine can. Usage: check_speed.py BIN_DIR"""
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_vectors import PACKAGES, fetch  # noqa: E402

MB = 1 << 20


def inputs():
    rng = random.Random(1)
    letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(MB))
    digits = "".join(rng.choice("0123456789") for _ in range(MB))
    cjk = "".join(chr(rng.randrange(0x4E00, 0x9FA5)) for _ in range(MB // 3))
    specials = "<|endoftext|>a" * (MB // 14)
    return {"letters": letters, "digits": digits, "spaces": " " * MB, "cjk": cjk, "specials": specials}


def main():
    bin_dir = sys.argv[1]
    worst = 0.0
    with tempfile.TemporaryDirectory() as d:
        files = {}
        for kind, text in inputs().items():
            files[kind] = os.path.join(d, kind + ".jsonl")
            with open(files[kind], "w") as f:
                f.write(json.dumps(text) + "\n")
        for name, spec in PACKAGES.items():
            tok = fetch(name, spec)
            for kind, path in files.items():
                args = [os.path.join(bin_dir, "qkv-model"), "tokenize", "--tokenizer", tok]
                if kind == "specials":
                    args.append("--parse-special")
                with open(path) as f:
                    t0 = time.monotonic()
                    r = subprocess.run(args, stdin=f, capture_output=True, text=True, timeout=600)
                    dt = time.monotonic() - t0
                if r.returncode != 0:
                    print(f"FAIL {name} {kind}: {r.stderr.strip()}")
                    return 1
                n = len(json.loads(r.stdout))
                print(f"{name:7s} {kind:9s} {dt:6.2f} s  {n:8d} tokens  (includes loading the vocabulary)")
                worst = max(worst, dt)
    print(f"slowest: {worst:.2f} s (target < 1 s; fails past 10 s)")
    ok = worst < 10
    print(f"tokenizer_speed: {1 if ok else 0} passed, {0 if ok else 1} failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
