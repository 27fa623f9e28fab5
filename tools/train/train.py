#!/usr/bin/env python3
"""Trains qkvserve's bundled default model: a small qwen3-architecture decoder on the King James Bible.

Deterministic (fixed seeds, a fixed number of threads: --threads, default 2). Steps:
  1. corpus: `bible -f Gen1:1-Rev22:21` (Debian's bible-kjv), verse references stripped, one verse a line;
     held-out split: every chapter whose running index is 19 mod 20 (5%); the rest trains.
  2. tokenizer: byte-level BPE learned here from the training split, GPT-2 pre-tokenizer, 4,096 tokens
     (256 bytes, 3,839 merges, "<|endoftext|>").
  3. model: qwen3 as llama.cpp defines it (GQA, RoPE on halves, RMSNorm, q/k RMSNorm, SwiGLU, tied
     embeddings), trained with AdamW on windows of 256 tokens, then (the last --long-frac of the steps) of
     the full 1,024-token context, at the same number of tokens per step.
  4. export: GGUF with the tokenizer embedded (2-D weights bf16, norms f32).
  5. evaluation, from the weights read back from the GGUF (tests/reference/gguf_ref.py, float64):
     per-token log-probabilities of the held-out evaluation windows and greedy continuations, written for
     the CI test that compares qkvserve against them.
Usage: /usr/bin/python3 tools/train/train.py --out models/  [--steps N] [--threads N]
"""
import argparse
import collections
import json
import math
import os
import struct
import subprocess
import sys
import time

import numpy as np
import regex
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
VOCAB = 4096
EOT = "<|endoftext|>"
CFG = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=768, ctx=1024, theta=10000.0, eps=1e-6)
SHORT_CTX = 256  # most steps train on 256-token windows (cheap attention); the last ones on the full context


# ----------------------------------------------------------------------------- corpus
def load_corpus():
    out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True).stdout
    train, test = [], []
    chapter, last = -1, None
    for line in out.splitlines():
        m = regex.match(r"^(\S+?)(\d+):(\d+) (.*)$", line)
        if not m:
            continue
        key = (m.group(1), m.group(2))
        if key != last:
            chapter += 1
            last = key
        (test if chapter % 20 == 19 else train).append(m.group(4))
    return "\n".join(train) + "\n", "\n".join(test) + "\n"


# ----------------------------------------------------------------------------- tokenizer
def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


B2U = bytes_to_unicode()


def train_bpe(text, vocab_size):
    """Byte-level BPE: merges chosen by pair frequency over pre-tokens (ties: the lexicographically
    smallest pair), updated incrementally."""
    words = collections.Counter(regex.findall(GPT2_PATTERN, text))
    seqs = [[B2U[b] for b in w.encode("utf-8")] for w in words]
    freqs = list(words.values())
    pairs = collections.Counter()
    where = collections.defaultdict(set)
    for i, s in enumerate(seqs):
        for a, b in zip(s, s[1:]):
            pairs[(a, b)] += freqs[i]
            where[(a, b)].add(i)
    merges = []
    n_merges = vocab_size - 256 - 1
    while len(merges) < n_merges and pairs:
        best = max(pairs.items(), key=lambda kv: (kv[1], tuple(-ord(ch) for ch in kv[0][0] + "\0" + kv[0][1])))[0]
        if pairs[best] <= 0:
            break
        merges.append(best)
        a, b = best
        ab = a + b
        for i in list(where[best]):
            s = seqs[i]
            f = freqs[i]
            for x, y in zip(s, s[1:]):  # remove old pairs of this word
                pairs[(x, y)] -= f
                if pairs[(x, y)] <= 0:
                    del pairs[(x, y)]
                where[(x, y)].discard(i)
            j, t = 0, []
            while j < len(s):
                if j + 1 < len(s) and s[j] == a and s[j + 1] == b:
                    t.append(ab)
                    j += 2
                else:
                    t.append(s[j])
                    j += 1
            seqs[i] = t
            for x, y in zip(t, t[1:]):
                pairs[(x, y)] += f
                where[(x, y)].add(i)
    tokens = [B2U[b] for b in range(256)] + [a + b for a, b in merges] + [EOT]
    return tokens, [f"{a} {b}" for a, b in merges]


class Bpe:
    def __init__(self, tokens, merges):
        self.id = {t: i for i, t in enumerate(tokens)}
        self.rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        self.cache = {}

    def encode_word(self, w):
        if w in self.cache:
            return self.cache[w]
        s = [B2U[b] for b in w.encode("utf-8")]
        while len(s) > 1:
            ranks = [(self.rank.get((x, y), 1 << 30), k) for k, (x, y) in enumerate(zip(s, s[1:]))]
            r, k = min(ranks)
            if r == 1 << 30:
                break
            s = s[:k] + [s[k] + s[k + 1]] + s[k + 2:]
        ids = [self.id[t] for t in s]
        self.cache[w] = ids
        return ids

    def encode(self, text):
        out = []
        for w in regex.findall(GPT2_PATTERN, text):
            out += self.encode_word(w)
        return out


# ----------------------------------------------------------------------------- model
class Rms(torch.nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.w


class Block(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        H, hd = c["hidden"], c["head_dim"]
        self.c = c
        self.attn_norm, self.ffn_norm = Rms(H, c["eps"]), Rms(H, c["eps"])
        self.q = torch.nn.Linear(H, c["heads"] * hd, bias=False)
        self.k = torch.nn.Linear(H, c["kv_heads"] * hd, bias=False)
        self.v = torch.nn.Linear(H, c["kv_heads"] * hd, bias=False)
        self.o = torch.nn.Linear(c["heads"] * hd, H, bias=False)
        self.q_norm, self.k_norm = Rms(hd, c["eps"]), Rms(hd, c["eps"])
        self.gate = torch.nn.Linear(H, c["ffn"], bias=False)
        self.up = torch.nn.Linear(H, c["ffn"], bias=False)
        self.down = torch.nn.Linear(c["ffn"], H, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        c, hd = self.c, self.c["head_dim"]
        h = self.attn_norm(x)
        q = self.q_norm(self.q(h).view(B, T, c["heads"], hd))
        k = self.k_norm(self.k(h).view(B, T, c["kv_heads"], hd))
        v = self.v(h).view(B, T, c["kv_heads"], hd)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = c["heads"] // c["kv_heads"]
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd) + mask
        a = torch.einsum("bhqk,bkhd->bqhd", att.softmax(-1), v).reshape(B, T, -1)
        x = x + self.o(a)
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rope(x, cos, sin):  # halves, as llama.cpp's qwen3 (neox)
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1)


class Model(torch.nn.Module):
    def __init__(self, c, vocab):
        super().__init__()
        self.c = c
        self.emb = torch.nn.Embedding(vocab, c["hidden"])
        self.blocks = torch.nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.norm = Rms(c["hidden"], c["eps"])
        torch.nn.init.normal_(self.emb.weight, std=0.02)
        hd = c["head_dim"]
        inv = c["theta"] ** (-torch.arange(0, hd // 2, dtype=torch.float64) * 2 / hd)
        ang = torch.arange(c["ctx"], dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("cos", torch.cos(ang).float()[None, :, None, :], persistent=False)
        self.register_buffer("sin", torch.sin(ang).float()[None, :, None, :], persistent=False)
        self.register_buffer("mask", torch.full((c["ctx"], c["ctx"]), float("-inf")).triu(1), persistent=False)

    def forward(self, ids):
        T = ids.shape[1]
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x, self.cos[:, :T], self.sin[:, :T], self.mask[:T, :T])
        return self.norm(x) @ self.emb.weight.T


# ----------------------------------------------------------------------------- GGUF export
def write_gguf(path, model, tokens, merges):
    c = model.c
    kv = []

    def s(key, v): kv.append((key, 8, v))
    def u32(key, v): kv.append((key, 4, v))
    def f32(key, v): kv.append((key, 6, v))
    def b(key, v): kv.append((key, 7, v))
    a = "qwen3."
    s("general.architecture", "qwen3")
    s("general.name", "qkvserve KJV qwen3 4M")
    u32("general.alignment", 32)
    u32(a + "context_length", c["ctx"]); u32(a + "embedding_length", c["hidden"]); u32(a + "block_count", c["layers"])
    u32(a + "feed_forward_length", c["ffn"]); u32(a + "attention.head_count", c["heads"])
    u32(a + "attention.head_count_kv", c["kv_heads"]); u32(a + "attention.key_length", c["head_dim"])
    u32(a + "attention.value_length", c["head_dim"]); u32(a + "rope.dimension_count", c["head_dim"])
    u32(a + "vocab_size", len(tokens))
    f32(a + "rope.freq_base", c["theta"]); f32(a + "attention.layer_norm_rms_epsilon", c["eps"])
    s("tokenizer.ggml.model", "gpt2"); s("tokenizer.ggml.pre", "gpt-2")
    kv.append(("tokenizer.ggml.tokens", "strarr", tokens))
    kv.append(("tokenizer.ggml.token_type", "i32arr", [1] * (len(tokens) - 1) + [3]))
    kv.append(("tokenizer.ggml.merges", "strarr", merges))
    u32("tokenizer.ggml.bos_token_id", len(tokens) - 1); u32("tokenizer.ggml.eos_token_id", len(tokens) - 1)
    b("tokenizer.ggml.add_bos_token", False)
    kv.append(("qkvserve.chat.stop", "strarr", ["\n"]))  # one verse per line: a chat reply ends with its verse

    tensors = []
    def t(name, w, bf16):
        w = w.detach().float().contiguous().numpy()
        if bf16:
            u = w.view(np.uint32).astype(np.uint64)
            data = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)).tobytes()
            typ = 30
        else:
            data, typ = w.astype("<f4").tobytes(), 0
        tensors.append((name, list(reversed(w.shape)), typ, data))
    t("token_embd.weight", model.emb.weight, True)
    for i, bl in enumerate(model.blocks):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", bl.attn_norm.w, False); t(p + "ffn_norm.weight", bl.ffn_norm.w, False)
        t(p + "attn_q.weight", bl.q.weight, True); t(p + "attn_k.weight", bl.k.weight, True)
        t(p + "attn_v.weight", bl.v.weight, True); t(p + "attn_output.weight", bl.o.weight, True)
        t(p + "attn_q_norm.weight", bl.q_norm.w, False); t(p + "attn_k_norm.weight", bl.k_norm.w, False)
        t(p + "ffn_gate.weight", bl.gate.weight, True); t(p + "ffn_up.weight", bl.up.weight, True)
        t(p + "ffn_down.weight", bl.down.weight, True)
    t("output_norm.weight", model.norm.w, False)

    def pstr(x):
        e = x.encode("utf-8")
        return struct.pack("<Q", len(e)) + e
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)))
    for key, typ, v in kv:
        out += pstr(key)
        if typ == "strarr":
            out += struct.pack("<IIQ", 9, 8, len(v)) + b"".join(pstr(x) for x in v)
        elif typ == "i32arr":
            out += struct.pack("<IIQ", 9, 5, len(v)) + struct.pack(f"<{len(v)}i", *v)
        elif typ == 8:
            out += struct.pack("<I", 8) + pstr(v)
        elif typ == 4:
            out += struct.pack("<II", 4, v)
        elif typ == 6:
            out += struct.pack("<If", 6, v)
        elif typ == 7:
            out += struct.pack("<IB", 7, 1 if v else 0)
    off = 0
    for name, ne, typ, data in tensors:
        out += pstr(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", typ, off)
        off += (len(data) + 31) // 32 * 32
    out += b"\0" * ((-len(out)) % 32)
    for _, _, _, data in tensors:
        out += data + b"\0" * ((-len(data)) % 32)
    with open(path, "wb") as f:
        f.write(out)


# ----------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "models"))
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--long-frac", type=float, default=0.15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-windows", type=int, default=48)
    args = ap.parse_args()
    torch.manual_seed(1234)
    np.random.seed(1234)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    train_text, test_text = load_corpus()
    tokens, merges = train_bpe(train_text, VOCAB)
    bpe = Bpe(tokens, merges)
    train_ids = np.array(bpe.encode(train_text), dtype=np.int64)
    test_ids = bpe.encode(test_text)
    print(f"corpus: train {len(train_text)} bytes -> {len(train_ids)} tokens, test {len(test_text)} bytes -> "
          f"{len(test_ids)} tokens; tokenizer {time.time() - t0:.0f}s", flush=True)

    c = CFG
    model = Model(c, len(tokens))
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    long_from = args.steps - int(round(args.steps * args.long_frac))
    # Held-out loss during training (the first 8 evaluation windows of the full context; it chooses nothing).
    mon = torch.tensor([test_ids[w * (c["ctx"] - 1):(w + 1) * (c["ctx"] - 1)] for w in range(8)])

    def monitor():
        with torch.no_grad():
            logits = model(mon[:, :-1])
            return F.cross_entropy(logits.reshape(-1, len(tokens)), mon[:, 1:].reshape(-1)).item()

    curve = []
    rng = np.random.default_rng(1234)
    t1 = time.time()
    for step in range(args.steps):
        lr = 3e-3 * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        T = c["ctx"] if step >= long_from else SHORT_CTX
        starts = rng.integers(0, len(train_ids) - T - 1, size=args.batch_tokens // T)
        x = torch.from_numpy(np.stack([train_ids[s:s + T] for s in starts]))
        y = torch.from_numpy(np.stack([train_ids[s + 1:s + T + 1] for s in starts]))
        loss = F.cross_entropy(model(x).view(-1, len(tokens)), y.view(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 250 == 0 or step == args.steps - 1:
            h = monitor()
            curve.append({"step": step, "train_loss": loss.item(), "heldout_loss": h})
            print(f"step {step} ctx {T} loss {loss.item():.3f} held-out {h:.3f} lr {lr:.2e} ({time.time() - t1:.0f}s)",
                  flush=True)
    train_s = time.time() - t1

    os.makedirs(args.out, exist_ok=True)
    name = "kjv-qwen3-4m"
    gguf = os.path.join(args.out, name + ".gguf")
    write_gguf(gguf, model, tokens, merges)

    # Evaluation from the GGUF's own weights (float64 reference implementation).
    from gguf_ref import Reference
    ref = Reference(gguf)
    # Protocol: non-overlapping windows of L = context - 1 tokens from the start of the held-out text (a
    # served request needs room for at least one generated token), no BOS; in each window every token but
    # the first is scored given the window's tokens before it. Also reported over windows of 255 tokens, the
    # protocol of the first bundled model (context 256), for comparison.
    def score(L, W):
        ids = test_ids[:W * L]
        out = []
        for w in range(W):
            win = ids[w * L:(w + 1) * L]
            lsm = torch.log_softmax(ref.logits(win), -1)
            out.append(lsm[torch.arange(L - 1), torch.tensor(win[1:])].numpy())
        return ids, np.concatenate(out)

    W = args.eval_windows
    L = c["ctx"] - 1
    eval_ids, lps = score(L, W)
    total = float(lps.astype(np.float64).sum())
    ppl = math.exp(-total / len(lps))
    _, lps255 = score(255, W)
    ppl255 = math.exp(-float(lps255.astype(np.float64).sum()) / len(lps255))
    prompts = ["And God said,", "In the beginning", "Blessed are the"]
    greedy = []
    for p in prompts:
        ids = bpe.encode(p)
        out, gaps = [], []
        for _ in range(64):
            logits = ref.logits(ids + out)[-1]
            top2 = torch.topk(logits, 2).values
            gaps.append(float(top2[0] - top2[1]))
            out.append(int(torch.argmax(logits)))
        greedy.append({"prompt": p, "prompt_ids": ids, "greedy_ids": out, "min_top2_gap": min(gaps)})
    evald = os.path.join(args.out, name + ".eval")
    os.makedirs(evald, exist_ok=True)
    with open(os.path.join(evald, "heldout_ids.json"), "w") as f:
        json.dump(eval_ids, f)
    lps.astype("<f4").tofile(os.path.join(evald, "heldout_logprobs.f32"))
    with open(os.path.join(evald, "greedy.json"), "w") as f:
        json.dump(greedy, f, indent=1)
    summary = {"parameters": n_params, "steps": args.steps, "batch_tokens": args.batch_tokens,
               "short_context": SHORT_CTX, "long_from_step": long_from, "threads": args.threads,
               "context": c["ctx"], "eval_window": L,
               "train_tokens": int(len(train_ids)),
               "heldout_tokens": len(test_ids), "eval_windows": W, "eval_targets": int(len(lps)),
               "heldout_loss": -total / len(lps), "heldout_perplexity": ppl,
               "heldout_perplexity_255": ppl255, "eval_targets_255": int(len(lps255)), "train_seconds": train_s,
               "total_seconds": time.time() - t0, "curve": curve,
               "final_train_loss": float(loss.item()), "gguf_bytes": os.path.getsize(gguf)}
    with open(os.path.join(evald, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    print("greedy:", [(g["prompt"], bpe_decode(tokens, g["greedy_ids"]), g["min_top2_gap"]) for g in greedy])


def bpe_decode(tokens, ids):
    u2b = {v: k for k, v in B2U.items()}
    return bytes(u2b[ch] for i in ids for ch in tokens[i] if ch in u2b).decode("utf-8", "replace")


if __name__ == "__main__":
    main()
