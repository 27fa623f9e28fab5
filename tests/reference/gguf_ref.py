"""An independent reference for qkvserve's forward pass: a small GGUF reader (numpy) and the decoder
written out in PyTorch (torch 1.13 has no fused SDPA), computing in float64.

It shares no code with the engine: it reads the same GGUF file and follows llama.cpp's conventions
(tensor names, RoPE pairing per architecture, partial rotary) plus the project's documented keys for the
attention output gate (Qwen3-Next layout) and sinks (gpt-oss).
"""
import struct

import numpy as np
import torch

GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class Gguf:
    def __init__(self, path):
        self.buf = open(path, "rb").read()
        self.pos = 0
        magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", self.buf, 0)
        assert magic == 0x46554747, "not a GGUF file"
        assert version == 3
        self.pos = 24
        self.kv = {}
        for _ in range(n_kv):
            key = self._str()
            (t,) = self._unpack("<I")
            self.kv[key] = self._value(t)
        self.tensors = {}
        for _ in range(n_tensors):
            name = self._str()
            (nd,) = self._unpack("<I")
            ne = list(self._unpack("<" + "Q" * nd))
            ttype, off = self._unpack("<IQ")
            self.tensors[name] = (ne, ttype, off)
        align = self.kv.get("general.alignment", 32)
        self.data = (self.pos + align - 1) // align * align

    def _unpack(self, fmt):
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def _str(self):
        (n,) = self._unpack("<Q")
        s = self.buf[self.pos:self.pos + n].decode("utf-8", "surrogateescape")
        self.pos += n
        return s

    def _value(self, t):
        if t == 8:
            return self._str()
        if t == 9:
            et, n = self._unpack("<IQ")
            return [self._value(et) for _ in range(n)]
        return self._unpack(GGUF_SCALAR[t])[0]

    def tensor(self, name):
        """The tensor as float64 numpy, shaped in PyTorch order (reversed ggml ne)."""
        ne, ttype, off = self.tensors[name]
        n = int(np.prod(ne))
        start = self.data + off
        if ttype == 0:
            a = np.frombuffer(self.buf, dtype="<f4", count=n, offset=start).astype(np.float64)
        elif ttype == 1:
            a = np.frombuffer(self.buf, dtype="<f2", count=n, offset=start).astype(np.float64)
        elif ttype == 30:
            u = np.frombuffer(self.buf, dtype="<u2", count=n, offset=start).astype(np.uint32) << 16
            a = u.view(np.float32).astype(np.float64)
        elif ttype == 8:
            blocks = np.frombuffer(self.buf, dtype=np.uint8, count=n // 32 * 34, offset=start).reshape(-1, 34)
            d = blocks[:, :2].copy().view("<f2").astype(np.float64)
            q = blocks[:, 2:].copy().view(np.int8).astype(np.float64)
            a = (d * q).reshape(-1)
        else:
            raise ValueError(f"unsupported ggml type {ttype}")
        return a.reshape(list(reversed(ne)))

    def has(self, name):
        return name in self.tensors


def bf16_round(x):
    """Round a float64 tensor to bf16 precision (round to nearest even) and back."""
    f = x.to(torch.float32).numpy().view(np.uint32).astype(np.uint64)
    f = ((f + 0x7FFF + ((f >> 16) & 1)) >> 16) << 16
    return torch.from_numpy(f.astype(np.uint32).view(np.float32).astype(np.float64))


def int8_kv_round(x):
    """qkvserve's int8 KV cache applied to x [T, heads, hd] (float64): per token and head, scale =
    bf16(max|x| / 127), q = clamp(round_half_even(x / scale), -127, 127), value = q × scale."""
    amax = x.abs().amax(-1, keepdim=True)
    s = bf16_round(amax / 127.0)
    q = torch.where(s > 0, torch.round(x / torch.where(s > 0, s, torch.ones_like(s))), torch.zeros_like(x))
    return q.clamp(-127, 127) * s


class Reference:
    def __init__(self, path, round_weights_bf16=False, kv_int8=False):
        self.kv_int8 = kv_int8
        g = Gguf(path)
        self.g = g
        arch = g.kv["general.architecture"]
        p = arch + "."
        self.arch = arch
        self.hidden = g.kv[p + "embedding_length"]
        self.n_layers = g.kv[p + "block_count"]
        self.n_heads = g.kv[p + "attention.head_count"]
        self.n_kv = g.kv.get(p + "attention.head_count_kv", self.n_heads)
        self.hd = g.kv.get(p + "attention.key_length", self.hidden // self.n_heads)
        self.rot = g.kv.get(p + "rope.dimension_count", self.hd)
        self.theta = g.kv.get(p + "rope.freq_base", 10000.0)
        self.eps = g.kv.get(p + "attention.layer_norm_rms_epsilon", 1e-6)
        self.gate = bool(g.kv.get("qkvserve.attention.output_gate", False))
        self.interleaved = arch == "llama"

        def T(name):
            t = torch.from_numpy(g.tensor(name))
            return bf16_round(t) if round_weights_bf16 and t.dim() == 2 else t

        self.T = T
        self.emb = T("token_embd.weight")
        self.out = T("output.weight") if g.has("output.weight") else self.emb
        self.final_norm = T("output_norm.weight")

    def rms(self, x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * w

    def rope(self, x, pos):
        """x: [T, heads, hd]; rotates the first `rot` dims of each head."""
        r = self.rot
        if r == 0:
            return x
        i = torch.arange(r // 2, dtype=torch.float64)
        freq = self.theta ** (-2.0 * i / r)
        ang = pos[:, None].to(torch.float64) * freq[None, :]  # [T, r/2]
        c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        y = x.clone()
        if self.interleaved:
            x0, x1 = x[..., 0:r:2], x[..., 1:r:2]
            y[..., 0:r:2] = x0 * c - x1 * s
            y[..., 1:r:2] = x0 * s + x1 * c
        else:
            h = r // 2
            x0, x1 = x[..., :h], x[..., h:r]
            y[..., :h] = x0 * c - x1 * s
            y[..., h:r] = x0 * s + x1 * c
        return y

    def logits(self, tokens):
        """Teacher-forced logits [T, vocab] for a token list (positions 0..T-1), float64."""
        T = self.T
        ids = torch.tensor(tokens, dtype=torch.long)
        n = len(tokens)
        pos = torch.arange(n)
        x = self.emb[ids]
        H, hd, nh, nkv = self.hidden, self.hd, self.n_heads, self.n_kv
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)  # True = future
        for l in range(self.n_layers):
            p = f"blk.{l}."
            h = self.rms(x, T(p + "attn_norm.weight"))
            q = h @ T(p + "attn_q.weight").T
            k = h @ T(p + "attn_k.weight").T
            v = h @ T(p + "attn_v.weight").T
            if self.g.has(p + "attn_q.bias"):
                q = q + T(p + "attn_q.bias")
                k = k + T(p + "attn_k.bias")
                v = v + T(p + "attn_v.bias")
            if self.gate:  # per head [query, gate]
                qg = q.view(n, nh, 2 * hd)
                q, gate = qg[..., :hd], qg[..., hd:].reshape(n, nh * hd)
            q = q.reshape(n, nh, hd)
            k = k.reshape(n, nkv, hd)
            v = v.reshape(n, nkv, hd)
            if self.g.has(p + "attn_q_norm.weight"):
                q = self.rms(q, T(p + "attn_q_norm.weight"))
                k = self.rms(k, T(p + "attn_k_norm.weight"))
            q = self.rope(q, pos)
            k = self.rope(k, pos)  # V is never rotated
            if self.kv_int8:  # as the cache stores them
                k, v = int8_kv_round(k), int8_kv_round(v)
            rep = nh // nkv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
            scores = scores.masked_fill(mask[None], float("-inf"))
            if self.g.has(p + "attn_sinks.weight"):
                sink = T(p + "attn_sinks.weight").view(nh, 1, 1).expand(nh, n, 1)
                full = torch.cat([scores, sink], dim=-1)
                w = torch.softmax(full, dim=-1)[..., :n]
            else:
                w = torch.softmax(scores, dim=-1)
            a = torch.einsum("hqk,khd->qhd", w, v).reshape(n, nh * hd)
            if self.gate:
                a = a * torch.sigmoid(gate)
            x = x + a @ T(p + "attn_output.weight").T
            h = self.rms(x, T(p + "ffn_norm.weight"))
            g_ = h @ T(p + "ffn_gate.weight").T
            u = h @ T(p + "ffn_up.weight").T
            x = x + (torch.nn.functional.silu(g_) * u) @ T(p + "ffn_down.weight").T
        x = self.rms(x, self.final_norm)
        return x @ self.out.T
