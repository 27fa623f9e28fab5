#!/usr/bin/env python3
"""Reference check: qkvserve's logits against the independent PyTorch reference (gguf_ref.py).

For each configuration below it writes a random model with `qkv-model random`, runs `qkv-run --logits`
(teacher-forced logits of every prompt position) once in one prefill and once in small chunks, and
compares with the reference computed in float64:
  * f32 weights + f32 KV: max |Δlogit| <= 1e-4;
  * bf16 weights + bf16 KV (the default): max |Δlogit| <= 1% of the largest |logit|, and the same
    argmax at every position where the reference's top-two gap exceeds that tolerance (for mixtures of
    experts the argmax only: rounding can route a token to another expert where two scores are close).
  * f32 weights + int8 KV (--kv-dtype int8): the reference applies the same quantization to K and V
    (gguf_ref.int8_kv_round), and max |Δlogit| <= KV_I8_REL of the largest |logit| with the same argmax
    where the gap is clear; logits in chunks of 7 are identical to one prefill. The distance to the
    unquantized reference is printed too (what int8 KV costs).
  * weights kept quantized (every block type, through llama-quantize's presets): the reference runs on the
    file's dequantized twin (`qkv-model quantize --type F32`, whose values equal gguf-py's dequantization,
    tests/reference/check_dequant.py), and max |Δlogit| <= QUANT_REL of the largest |logit| (the
    activations are quantized to 8 bits per 32 values), with the same argmax where the gap is clear.
Usage: check_reference.py BIN_DIR [--only NAME]
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_ref import Reference  # noqa: E402

F32_TOL = 1e-4
# bf16 weights and activations carry 8 significant bits, so bf16 logits are compared relative to the
# logits' scale: max |Δlogit| <= BF16_REL × max |reference logit|. Measured worst case: docs/correctness.md.
BF16_REL = 0.01

# int8 KV against a reference that quantizes K/V the same way: our K/V are computed in f32 and the
# reference's in float64, so an element close to a rounding boundary can land one step (scale) away.
# Measured worst case: docs/correctness.md.
KV_I8_REL = 0.005

# Measured worst case over the presets below: docs/correctness.md.
QUANT_REL = 0.02
QUANT_PRESETS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL",
                 "IQ4_XS"]

BASE = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 256,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5}

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def llama3_divisors(cfg):
    """Meta's Llama 3.1 rope scaling as per-pair frequency divisors (what the converter writes)."""
    rs, hd = cfg["rope_scaling"], cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    orig, lo, hi, factor = rs["original_max_position_embeddings"], rs["low_freq_factor"], rs["high_freq_factor"], rs["factor"]
    out = []
    for i in range(hd // 2):
        wavelen = 2 * math.pi * cfg["rope_theta"] ** (2 * i / hd)
        if wavelen < orig / hi:
            out.append(1.0)
        elif wavelen > orig / lo:
            out.append(factor)
        else:
            smooth = (orig / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out)


MLA = {"kv_lora_rank": 64, "q_lora_rank": 48, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 24}

DS_MOE = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "n_shared_experts": 1,
          "first_k_dense_replace": 1}
HYBRID = {"head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "full_attention_interval": 2,
          "linear_conv_kernel_dim": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "linear_key_head_dim": 16, "linear_value_head_dim": 24, "partial_rotary_factor": 0.25}
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "head_dim": 32}

CONFIGS = [
    ("mha", "llama", {"num_key_value_heads": 8}, "f32"),
    ("gqa4", "llama", {"num_key_value_heads": 2}, "f32"),
    ("mqa", "llama", {"num_key_value_heads": 1}, "f32"),
    ("head_dim_ne", "llama", {"head_dim": 32}, "f32"),
    ("partial_rotary", "llama", {"partial_rotary_factor": 0.25}, "f32"),
    ("partial_rotary_qwen", "qwen3", {"partial_rotary_factor": 0.25}, "f32"),
    ("output_gate", "qwen3", {"attn_output_gate": True}, "f32"),
    ("sinks", "llama", {"attention_sinks": True}, "f32"),
    ("qk_norm", "llama", {"qk_norm": True}, "f32"),
    ("tied", "llama", {"tie_word_embeddings": True}, "f32"),
    ("llama", "llama", {}, "f32"),
    ("qwen2", "qwen2", {}, "f32"),
    ("qwen3", "qwen3", {"head_dim": 32}, "f32"),
    ("all_features", "qwen3", {"attn_output_gate": True, "attention_sinks": True, "attention_bias": True,
                               "partial_rotary_factor": 0.5, "tie_word_embeddings": True, "num_key_value_heads": 4}, "f32"),
    ("file_f16", "qwen2", {}, "f16"),
    ("file_bf16", "llama", {}, "bf16"),
    ("file_q8_0", "qwen3", {}, "q8_0"),
    ("yarn_qwen2", "qwen2", {"rope_scaling": {"type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 32}}, "f32"),
    ("linear_llama", "llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "f32"),
    # Llama 3.1's scaling (rope_freqs.weight): with an original context of 64 and head_dim 16 the 8 pairs
    # take all three branches (kept, smoothed, divided by the factor); in a bf16 file too.
    ("llama3_rope", "llama", {"rope_scaling": LLAMA3_ROPE}, "f32"),
    ("llama3_rope_bf16_file", "llama", {"rope_scaling": LLAMA3_ROPE, "num_key_value_heads": 4}, "bf16"),
    # MLA (deepseek2): with and without the low-rank query path (none needs 26 or 27 layers, llama.cpp's
    # rule), other rope/nope/v splits, YaRN with and without mscale_all_dim, the legacy attn_kv_b.
    ("mla", "deepseek2", dict(MLA), "f32"),
    ("mla_no_q_lora", "deepseek2", dict(MLA, q_lora_rank=None, num_hidden_layers=26, hidden_size=64,
                                        intermediate_size=96), "f32"),
    ("mla_splits", "deepseek2", dict(MLA, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=32,
                                     v_head_dim=48, num_attention_heads=3), "f32"),
    ("mla_yarn", "deepseek2", dict(MLA, rope_scaling={"type": "yarn", "factor": 8.0, "mscale": 0.707,
                                                      "mscale_all_dim": 0.707,
                                                      "original_max_position_embeddings": 32}), "f32"),
    ("mla_yarn_no_mscale", "deepseek2", dict(MLA, rope_scaling={"type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 32}), "f32"),
    ("mla_legacy_kv_b", "deepseek2", dict(MLA, legacy_kv_b=True), "f32"),
    ("mla_bf16_file", "deepseek2", dict(MLA, tie_word_embeddings=True), "bf16"),
    # Mixture of experts (qwen3moe): 8 experts, top 2; 16 experts, top 4; a bf16 file.
    ("moe", "qwen3moe", dict(MOE), "f32"),
    ("moe_16x4", "qwen3moe", dict(MOE, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32), "f32"),
    ("moe_bf16_file", "qwen3moe", dict(MOE), "bf16"),
    # deepseek2 with routed and shared experts after a leading dense block: softmax gating; sigmoid gating
    # with the selection bias, groups, normalization and scaling (DeepSeek-V3's routing).
    ("moe_ds2_softmax", "deepseek2", dict(MLA, **DS_MOE), "f32"),
    ("moe_ds3_sigmoid_groups", "deepseek2", dict(MLA, **DS_MOE, scoring_func="sigmoid", topk_method="noaux_tc",
                                                 n_group=4, topk_group=2, norm_topk_prob=True,
                                                 routed_scaling_factor=2.5, num_hidden_layers=3), "f32"),
    ("moe_ds2_no_shared", "deepseek2", dict(MLA, **dict(DS_MOE, n_shared_experts=0, first_k_dense_replace=0)), "f32"),
    # qwen35 hybrids (Gated DeltaNet + gated attention): interval 2 and 4, layer_types, other linear head
    # counts and widths (value heads a multiple of key heads, d_k != d_v), partial rotary; a bf16 file. 48
    # tokens span three of the layer's 16-token chunks, so commits and open chunks are both compared.
    ("hybrid_i2", "qwen35", dict(HYBRID), "f32"),
    ("hybrid_i4", "qwen35", dict(HYBRID, num_hidden_layers=4, full_attention_interval=4, linear_num_key_heads=1,
                                 linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=16,
                                 partial_rotary_factor=0.5), "f32"),
    ("hybrid_types", "qwen35", dict(HYBRID, num_hidden_layers=3, full_attention_interval=None,
                                    layer_types=["full_attention", "linear_attention", "linear_attention"],
                                    linear_num_key_heads=3, linear_num_value_heads=3, linear_conv_kernel_dim=2,
                                    partial_rotary_factor=1.0), "f32"),
    ("hybrid_bf16_file", "qwen35", dict(HYBRID), "bf16"),
]


def run_logits(bindir, model, tokens, wdt, kdt, chunk, out):
    cmd = [os.path.join(bindir, "qkv-run"), "--model", model, "--tokens", ",".join(map(str, tokens)),
           "-n", "0", "--threads", "1", "--weights-dtype", wdt, "--kv-dtype", kdt, "--logits", out,
           "--max-batch-tokens", str(chunk)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return np.fromfile(out, dtype="<f4").reshape(len(tokens), -1).astype(np.float64)


def argmax_agrees(ours, ref, rel):
    """The same argmax at every position whose top-two reference gap exceeds rel × the logit scale."""
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > rel * float(np.abs(ref).max())
    return bool((ours.argmax(1) == ref.argmax(1))[clear].all())


def relative_check(ours, ref, rel):
    """max |Δ| relative to the reference's logit scale, and whether the argmax agrees at every position whose
    top-two gap exceeds the tolerance: (d, scale, ok, text)."""
    d = float(np.abs(ours - ref).max())
    scale = float(np.abs(ref).max())
    tol = rel * scale
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > tol
    agree = (ours.argmax(1) == ref.argmax(1))[clear]
    text = (f"max|d|={d:.4f} ({100 * d / scale:.2f}% of {scale:.1f}) argmax {int(agree.sum())}/{int(clear.sum())} "
            f"clear positions")
    return d, scale, d <= tol and bool(agree.all()), text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir")
    ap.add_argument("--only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(7)
    failures = 0
    worst_bf16 = 0.0
    worst_i8 = worst_i8_cost = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name, arch, over, fdt in CONFIGS:
            if args.only and not name.startswith(args.only):
                continue
            cfg = dict(BASE, **over)
            cpath, mpath, lpath = (os.path.join(tmp, name + s) for s in (".json", ".gguf", ".bin"))
            with open(cpath, "w") as f:
                json.dump(cfg, f)
            subprocess.run([os.path.join(args.bindir, "qkv-model"), "random", "--config", cpath, "--out", mpath,
                            "--arch", arch, "--dtype", fdt, "--seed", str(len(name))], check=True, stdout=subprocess.DEVNULL)
            tokens = rng.integers(0, cfg["vocab_size"], size=48).tolist()
            ref = Reference(mpath).logits(tokens).numpy()
            msgs = []
            ok = True
            if cfg.get("rope_scaling", {}).get("rope_type") == "llama3":
                ff = Reference(mpath).freq_factors
                want = llama3_divisors(cfg)
                good = ff is not None and ff.shape == want.shape and np.allclose(ff.numpy(), want, rtol=1e-6)
                kinds = "" if ff is None else f" ({int((want == 1).sum())} kept, {int((want == cfg['rope_scaling']['factor']).sum())} divided)"
                msgs.append(f"rope_freqs {'as Llama 3.1' if good else 'WRONG'}{kinds}")
                ok &= good
            for chunk in (512, 7):
                ours = run_logits(args.bindir, mpath, tokens, "f32", "f32", chunk, lpath)
                d = float(np.abs(ours - ref).max())
                msgs.append(f"f32/chunk{chunk} max|d|={d:.2e}")
                ok &= d <= F32_TOL
            ref_bf = Reference(mpath, round_weights_bf16=True).logits(tokens).numpy()
            ours = run_logits(args.bindir, mpath, tokens, "bf16", "bf16", 512, lpath)
            # Rounding noise adds up layer by layer: the tolerance grows with the square root of the depth
            # past the 2 layers of the base configs (26 layers: 3.6%).
            bf16_rel = BF16_REL * math.sqrt(max(1.0, cfg["num_hidden_layers"] / 2))
            d, scale, good, text = relative_check(ours, ref_bf, bf16_rel)
            if name.startswith("moe"):
                # bf16 rounding can move a token to another expert where two router scores are close, which
                # moves its logits by far more than rounding does: bounded by the argmax agreement only.
                good = argmax_agrees(ours, ref_bf, bf16_rel)
                text += " (MoE: deviation not bounded)"
            else:
                worst_bf16 = max(worst_bf16, d / scale / bf16_rel * BF16_REL)
            msgs.append("bf16 " + text)
            ok &= good
            ref_i8 = Reference(mpath, kv_int8=True).logits(tokens).numpy()
            ours = run_logits(args.bindir, mpath, tokens, "f32", "int8", 512, lpath)
            chunked = run_logits(args.bindir, mpath, tokens, "f32", "int8", 7, lpath)
            d, scale, good, text = relative_check(ours, ref_i8, KV_I8_REL)
            worst_i8 = max(worst_i8, d / scale)
            cost = float(np.abs(ours - ref).max()) / float(np.abs(ref).max())
            worst_i8_cost = max(worst_i8_cost, cost)
            same = bool(np.array_equal(ours, chunked))
            msgs.append(f"int8kv {text}, vs unquantized {100 * cost:.2f}%, chunks {'same' if same else 'DIFFER'}")
            ok &= good and same
            print(f"{'ok  ' if ok else 'FAIL'} {name:20s} {arch:6s} {fdt:5s} " + "; ".join(msgs), flush=True)
            failures += not ok
        # Quantized weights: 256-wide rows so that the K-quant types apply (with their fallbacks elsewhere).
        worst_q = 0.0
        qcfg = dict(BASE, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)
        cpath = os.path.join(tmp, "q.json")
        with open(cpath, "w") as f:
            json.dump(qcfg, f)
        tokens = rng.integers(0, qcfg["vocab_size"], size=48).tolist()
        for i, preset in enumerate(QUANT_PRESETS):
            if args.only and not preset.startswith(args.only):
                continue
            arch = ("llama", "qwen2", "qwen3")[i % 3]
            mpath, twin, lpath = (os.path.join(tmp, preset + s) for s in (".gguf", "_f32.gguf", ".bin"))
            qm = os.path.join(args.bindir, "qkv-model")
            subprocess.run([qm, "random", "--config", cpath, "--out", mpath, "--arch", arch, "--dtype", preset,
                            "--seed", str(i)], check=True, stdout=subprocess.DEVNULL)
            subprocess.run([qm, "quantize", mpath, twin, "--type", "F32", "--quiet"], check=True,
                           stdout=subprocess.DEVNULL)
            ref = Reference(twin).logits(tokens).numpy()
            ours = run_logits(args.bindir, mpath, tokens, "auto", "f32", 512, lpath)
            chunked = run_logits(args.bindir, mpath, tokens, "auto", "f32", 7, lpath)
            d, scale, good, text = relative_check(ours, ref, QUANT_REL)
            worst_q = max(worst_q, d / scale)
            same = bool(np.array_equal(ours, chunked))
            ok = good and same
            print(f"{'ok  ' if ok else 'FAIL'} {preset:20s} {arch:6s} quantized {text}; chunks of 7 "
                  f"{'identical' if same else 'DIFFER'}", flush=True)
            failures += not ok
    print(f"worst bf16 deviation {100 * worst_bf16:.2f}% of the logit scale per sqrt(layers / 2) "
          f"(tolerance {100 * BF16_REL:.0f}%)")
    print(f"worst int8-KV deviation {100 * worst_i8:.2f}% of the logit scale (tolerance {100 * KV_I8_REL:.1f}%); "
          f"int8 KV vs the unquantized reference: worst {100 * worst_i8_cost:.2f}%")
    print(f"worst quantized deviation {100 * worst_q:.2f}% of the logit scale (tolerance {100 * QUANT_REL:.0f}%)")
    total = len(CONFIGS) + len(QUANT_PRESETS)
    print(f"{total - failures if not args.only else 1 - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
