#!/usr/bin/env python3
"""The engine's dequantization of every quantized ggml type against llama.cpp's own numpy code.

For each type: random blocks (every bit pattern of the quants, finite f16 scales) written as a GGUF with
gguf-py's writer, and a random model quantized by `qkv-model random --dtype TYPE`; `qkv-model dequant`
must give, bit for bit, what gguf-py's `quants.dequantize` gives.

gguf-py is not part of this repository: it is read at test time from the llama.cpp source that npm's
node-llama-cpp@3.21.1 ships (llama/gitRelease.bundle, cloned), e.g.
  /usr/bin/python3 tests/reference/check_dequant.py --bin build/bin --gguf-py /tmp/lc/llama.cpp/gguf-py
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

TYPES = {  # name: (block values, block bytes, offsets of f16 fields)
    "q4_0": (32, 18, [0]), "q4_1": (32, 20, [0, 2]), "q5_0": (32, 22, [0]), "q5_1": (32, 24, [0, 2]),
    "q8_0": (32, 34, [0]), "q2_k": (256, 84, [80, 82]), "q3_k": (256, 110, [108]),
    "q4_k": (256, 144, [0, 2]), "q5_k": (256, 176, [0, 2]), "q6_k": (256, 210, [208]),
    "iq4_nl": (32, 18, [0]), "iq4_xs": (256, 136, [0]),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--gguf-py", required=True)
    a = ap.parse_args()
    sys.path.insert(0, a.gguf_py)
    import gguf
    from gguf import quants

    qkv_model = os.path.join(a.bin, "qkv-model")
    rng = np.random.default_rng(7)
    fails = 0
    with tempfile.TemporaryDirectory() as tmp:
        cfg = os.path.join(tmp, "c.json")
        with open(cfg, "w") as f:
            json.dump({"hidden_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "intermediate_size": 512, "vocab_size": 300, "max_position_embeddings": 64,
                       "rms_norm_eps": 1e-6}, f)
        for name, (bs, bb, hfields) in TYPES.items():
            qtype = getattr(gguf.GGMLQuantizationType, name.upper())
            # 1. random bytes
            rows, cols = 8, 512
            nblk = rows * cols // bs
            raw = rng.integers(0, 256, size=(nblk, bb), dtype=np.uint8)
            for off in hfields:
                h = (rng.standard_normal(nblk) * 0.05).astype(np.float16)
                raw[:, off:off + 2] = h.view(np.uint8).reshape(nblk, 2)
            raw = raw.reshape(rows, cols // bs * bb)
            path = os.path.join(tmp, name + ".gguf")
            w = gguf.GGUFWriter(path, "llama")
            w.add_tensor("t", raw, raw_dtype=qtype)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            checks = [(path, "t", raw, qtype)]
            # 2. our encoder, through a random model
            mpath = os.path.join(tmp, name + "_model.gguf")
            subprocess.run([qkv_model, "random", "--config", cfg, "--out", mpath, "--dtype", name, "--seed", "3"],
                           check=True, stdout=subprocess.DEVNULL)
            r = gguf.GGUFReader(mpath)
            for t in r.tensors:
                if t.name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
                    checks.append((mpath, t.name, np.array(t.data), t.tensor_type))
            for p, tname, data, ttype in checks:
                ref = quants.dequantize(data, ttype).astype(np.float32).ravel()
                out = os.path.join(tmp, "out.f32")
                subprocess.run([qkv_model, "dequant", p, "--tensor", tname, "--out", out], check=True,
                               stdout=subprocess.DEVNULL)
                ours = np.fromfile(out, dtype=np.float32)
                same = ours.shape == ref.shape and np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
                if not same:
                    fails += 1
                    bad = np.nonzero(ours.view(np.uint32) != ref.view(np.uint32))[0] if ours.shape == ref.shape else []
                    print(f"FAIL {ttype.name} {os.path.basename(p)}:{tname}: {len(bad)} of {ref.size} values differ"
                          + (f", first at {bad[0]}: ours {ours[bad[0]]!r} gguf-py {ref[bad[0]]!r}" if len(bad) else ""))
                else:
                    print(f"ok   {ttype.name} {os.path.basename(p)}:{tname}: {ref.size} values bit-identical")
    print("dequant:", "all bit-identical" if fails == 0 else f"{fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
