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
        self.gate = bool(g.kv.get("qkvserve.attention.output_gate", False)) or arch == "qwen35"
        # qwen35 (llama.cpp's qwen35.cpp): Gated DeltaNet layers except every full_attention_interval-th
        # (or as attention.recurrent_layers says), with their own head counts and widths.
        self.recurrent = [False] * self.n_layers
        if arch == "qwen35":
            flags = g.kv.get(p + "attention.recurrent_layers")
            if flags is not None:
                self.recurrent = [bool(f) for f in flags][:self.n_layers]
            else:
                iv = g.kv.get(p + "full_attention_interval", 4)
                self.recurrent = [(i + 1) % iv != 0 for i in range(self.n_layers)]
            self.conv_k = g.kv[p + "ssm.conv_kernel"]
            self.lk = g.kv[p + "ssm.group_count"]
            self.lv = g.kv[p + "ssm.time_step_rank"]
            self.dk = g.kv[p + "ssm.state_size"]
            self.dv = g.kv[p + "ssm.inner_size"] // self.lv
        # llama.cpp's pairing: interleaved (2i, 2i+1) for llama and deepseek2, halves for qwen2/qwen3.
        self.interleaved = arch in ("llama", "deepseek2")
        # Rope scaling from the file: linear divides every frequency by the factor; YaRN (the YaRN paper,
        # as DeepSeek-V2's modelling code states it) mixes the interpolated and the original frequency of
        # each pair by a linear ramp between the correction dims of beta_fast = 32 and beta_slow = 1
        # rotations over the original context, and scales the softmax by mscale(factor, mscale_all_dim)^2.
        self.scaling = g.kv.get(p + "rope.scaling.type", "none")
        self.factor = g.kv.get(p + "rope.scaling.factor", 1.0) or 1.0
        self.orig_ctx = g.kv.get(p + "rope.scaling.original_context_length", g.kv.get(p + "context_length", 2048))
        # the converter writes 0.1 * mscale_all_dim (llama.cpp divides it back)
        self.mscale_all_dim = g.kv.get(p + "rope.scaling.yarn_log_multiplier", 0.0) / 0.1
        # Llama 3.1's rope scaling: the converter writes one divisor per rotated pair (rope_freqs.weight);
        # llama.cpp divides each pair's frequency by it (llama only).
        self.freq_factors = None
        if arch == "llama" and g.has("rope_freqs.weight"):
            self.freq_factors = torch.from_numpy(g.tensor("rope_freqs.weight")).to(torch.float64)
        if arch == "deepseek2":
            self.kv_lora = g.kv[p + "attention.kv_lora_rank"]
            self.q_lora = g.kv.get(p + "attention.q_lora_rank", 0)
            # older files (one attn_kv_b) give the per-head widths as key_length / value_length
            self.dk_mla = g.kv.get(p + "attention.key_length_mla", g.kv[p + "attention.key_length"])
            self.dv_mla = g.kv.get(p + "attention.value_length_mla", g.kv[p + "attention.value_length"])

        def T(name):
            # With bf16 weights every matrix (2-D, or 3-D stacked per head or expert) is rounded, except the
            # MoE router, which qkvserve keeps in f32 (its top-k decides which experts run).
            t = torch.from_numpy(g.tensor(name))
            rounded = (round_weights_bf16 and t.dim() >= 2 and not name.endswith("ffn_gate_inp.weight")
                       and not name.endswith("ssm_conv1d.weight"))  # the conv kernel stays f32
            return bf16_round(t) if rounded else t

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
        if self.freq_factors is not None:
            freq = freq / self.freq_factors
        mag = 1.0
        if self.scaling == "linear":
            freq = freq / self.factor
        elif self.scaling == "yarn" and self.factor > 1:
            def corr(rot):
                return r * np.log(self.orig_ctx / (rot * 2 * np.pi)) / (2 * np.log(self.theta))
            low, high = max(np.floor(corr(32.0)), 0.0), min(np.ceil(corr(1.0)), r - 1.0)
            keep = 1.0 - torch.clamp((i - low) / max(high - low, 0.001), 0.0, 1.0)  # 1: original frequency
            freq = freq / self.factor * (1.0 - keep) + freq * keep
            mag = self.rope_mag()
        ang = pos[:, None].to(torch.float64) * freq[None, :]  # [T, r/2]
        c, s = mag * torch.cos(ang)[:, None, :], mag * torch.sin(ang)[:, None, :]
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
            if self.arch == "deepseek2":
                x = x + self.mla(h, p, pos, mask)
                x = self.ffn(x, p)
                continue
            if self.recurrent[l]:
                x = x + self.gated_deltanet(h, p)
                x = self.ffn(x, p)
                continue
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
            x = self.ffn(x, p)
        x = self.rms(x, self.final_norm)
        return x @ self.out.T

    def rope_mag(self):
        """The factor on cos/sin under YaRN, as llama.cpp computes it: mscale(f, m) / mscale(f, mscale_all_dim)
        with m = mscale_all_dim for deepseek2 (1 for others) when the file gives a log multiplier, else
        mscale(f, 1) = 1 + 0.1 ln f."""
        def ms(m):
            return 1.0 + 0.1 * m * np.log(self.factor)
        if self.mscale_all_dim != 0:
            m = self.mscale_all_dim if self.arch == "deepseek2" and self.mscale_all_dim != 1 else 1.0
            return ms(m) / ms(self.mscale_all_dim)
        return ms(1.0)

    def gated_deltanet(self, h, p):
        """A Gated DeltaNet layer in its plain token-by-token recurrent form (the definition; no chunks):
        causal depthwise conv (kernel ssm_conv1d, zero history) + SiLU, q and k L2-normalized (x / max(|x|,
        eps)) with q scaled by 1/sqrt(d_k), beta = sigmoid(b), g = softplus(a + dt_bias) * ssm_a, and per value
        head h (key head h mod n_k): S = e^g S; S += k (beta (v - S^T k))^T; o = S^T q. Then RMSNorm per head
        (ssm_norm) times silu(z), and the output projection."""
        T = self.T
        n = h.shape[0]
        nk, nv, dk, dv, K = self.lk, self.lv, self.dk, self.dv, self.conv_k
        qkv = h @ T(p + "attn_qkv.weight").T
        z = (h @ T(p + "attn_gate.weight").T).view(n, nv, dv)
        b = h @ T(p + "ssm_beta.weight").T
        a = h @ T(p + "ssm_alpha.weight").T
        w = T(p + "ssm_conv1d.weight")  # [channels, K]
        ch = qkv.shape[1]
        padded = torch.cat([torch.zeros(K - 1, ch, dtype=torch.float64), qkv])
        conv = sum(padded[j:j + n] * w[:, j] for j in range(K))
        conv = torch.nn.functional.silu(conv)
        q = conv[:, :nk * dk].reshape(n, nk, dk)
        k = conv[:, nk * dk:2 * nk * dk].reshape(n, nk, dk)
        v = conv[:, 2 * nk * dk:].reshape(n, nv, dv)
        q = q / torch.clamp(q.norm(dim=-1, keepdim=True), min=self.eps) / np.sqrt(dk)
        k = k / torch.clamp(k.norm(dim=-1, keepdim=True), min=self.eps)
        beta = torch.sigmoid(b)
        g = torch.nn.functional.softplus(a + T(p + "ssm_dt.bias")) * T(p + "ssm_a")
        kh = torch.arange(nv) % nk  # llama.cpp's tiled broadcast of key heads over value heads
        S = torch.zeros(nv, dk, dv, dtype=torch.float64)
        o = torch.zeros(n, nv, dv, dtype=torch.float64)
        for t in range(n):
            S = S * torch.exp(g[t])[:, None, None]
            kt, qt = k[t, kh], q[t, kh]  # [nv, dk]
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, kt))
            S = S + kt[:, :, None] * u[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", S, qt)
        o = self.rms(o, T(p + "ssm_norm.weight")) * torch.nn.functional.silu(z)
        return o.reshape(n, nv * dv) @ T(p + "ssm_out.weight").T

    def ffn(self, x, p):
        T = self.T
        norm = p + ("post_attention_norm.weight" if self.arch == "qwen35" else "ffn_norm.weight")
        h = self.rms(x, T(norm))
        if self.g.has(p + "ffn_gate_inp.weight"):
            return x + self.moe(h, p)
        g_ = h @ T(p + "ffn_gate.weight").T
        u = h @ T(p + "ffn_up.weight").T
        return x + (torch.nn.functional.silu(g_) * u) @ T(p + "ffn_down.weight").T

    def moe(self, h, p):
        """Mixture of experts, a plain loop over each token's chosen experts (llama.cpp's build_moe_ffn
        semantics): softmax (or sigmoid) router probabilities; selection by probability plus the optional
        exp_probs_b bias, limited to the topk_group groups with the largest sum of their two best scores;
        top-k (ties: the lower index); weights from the unbiased probabilities, normalized to sum 1 where
        llama.cpp does (always for qwen3moe, per expert_weights_norm for deepseek2) and scaled; plus the
        shared experts (deepseek2) as one dense SwiGLU."""
        T = self.T
        a = self.arch + "."
        k = self.g.kv[a + "expert_used_count"]
        sigmoid = self.g.kv.get(a + "expert_gating_func", 1) == 2
        norm = self.arch == "qwen3moe" or bool(self.g.kv.get(a + "expert_weights_norm", False))
        scale = self.g.kv.get(a + "expert_weights_scale", 0.0)
        n_groups = self.g.kv.get(a + "expert_group_count", 0)
        n_used_groups = self.g.kv.get(a + "expert_group_used_count", 0)
        wr = T(p + "ffn_gate_inp.weight")
        bias = T(p + "exp_probs_b.bias") if self.g.has(p + "exp_probs_b.bias") else None
        gate, up, down = T(p + "ffn_gate_exps.weight"), T(p + "ffn_up_exps.weight"), T(p + "ffn_down_exps.weight")
        n_exp = wr.shape[0]
        out = torch.zeros_like(h)
        for t in range(h.shape[0]):
            logits = wr @ h[t]
            prob = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
            sel = prob + bias if bias is not None else prob.clone()
            if n_groups > 1:
                per = n_exp // n_groups
                gs = [sum(sorted(sel[g * per:(g + 1) * per].tolist(), reverse=True)[:2]) for g in range(n_groups)]
                keep = sorted(range(n_groups), key=lambda g: (-gs[g], g))[:n_used_groups]
                for g in range(n_groups):
                    if g not in keep:
                        sel[g * per:(g + 1) * per] = float("-inf")
            order = sorted(range(n_exp), key=lambda e: (-float(sel[e]), e))[:k]
            w = prob[order]
            if norm:
                w = w / max(float(w.sum()), 6.103515625e-5)
            if scale not in (0.0, 1.0):
                w = w * scale
            for wi, e in zip(w, order):
                y = (torch.nn.functional.silu(gate[e] @ h[t]) * (up[e] @ h[t])) @ down[e].T
                out[t] += wi * y
        if self.g.has(p + "ffn_gate_shexp.weight"):
            g_ = h @ T(p + "ffn_gate_shexp.weight").T
            u = h @ T(p + "ffn_up_shexp.weight").T
            out = out + (torch.nn.functional.silu(g_) * u) @ T(p + "ffn_down_shexp.weight").T
        return out

    def mla(self, h, p, pos, mask):
        """DeepSeek-V2 multi-head latent attention in its plain (non-absorbed) form: K and V of every head
        are expanded from the normalized latent, the rope part of K is one key shared by all heads."""
        T = self.T
        n, nh, R = h.shape[0], self.n_heads, self.kv_lora
        dk, dv, P = self.dk_mla, self.dv_mla, self.rot
        dn = dk - P
        if self.g.has(p + "attn_q_a.weight"):
            q = self.rms(h @ T(p + "attn_q_a.weight").T, T(p + "attn_q_a_norm.weight")) @ T(p + "attn_q_b.weight").T
        else:
            q = h @ T(p + "attn_q.weight").T
        q = q.reshape(n, nh, dk)
        q_nope, q_pe = q[..., :dn], self.rope(q[..., dn:], pos)
        kv = h @ T(p + "attn_kv_a_mqa.weight").T
        c = self.rms(kv[:, :R], T(p + "attn_kv_a_norm.weight"))
        k_pe = self.rope(kv[:, None, R:], pos)  # [n, 1, P]
        if self.kv_int8:  # the cache stores the latent and the rope key, each with its own scale
            c = int8_kv_round(c[:, None, :])[:, 0, :]
            k_pe = int8_kv_round(k_pe)
        if self.g.has(p + "attn_k_b.weight"):
            kb = T(p + "attn_k_b.weight")  # [nh, R, dn]
            vb = T(p + "attn_v_b.weight")  # [nh, dv, R]
            k_nope = torch.einsum("tr,hrd->thd", c, kb)
            v = torch.einsum("tr,hdr->thd", c, vb)
        else:  # older files: one kv_b [nh * (dn + dv), R]
            kvb = T(p + "attn_kv_b.weight").reshape(nh, dn + dv, R)
            k_nope = torch.einsum("tr,hdr->thd", c, kvb[:, :dn])
            v = torch.einsum("tr,hdr->thd", c, kvb[:, dn:])
        k = torch.cat([k_nope, k_pe.expand(n, nh, P)], dim=-1)
        qf = torch.cat([q_nope, q_pe], dim=-1)
        mscale = 1.0  # DeepSeek's softmax scale: (rope factor × mscale(f, mscale_all_dim))^2 / sqrt(dk)
        if self.scaling == "yarn" and self.factor > 1:
            mscale = self.rope_mag() * (1.0 + 0.1 * self.mscale_all_dim * np.log(self.factor))
        scores = torch.einsum("qhd,khd->hqk", qf, k) * (mscale * mscale / np.sqrt(dk))
        scores = scores.masked_fill(mask[None], float("-inf"))
        w = torch.softmax(scores, dim=-1)
        a = torch.einsum("hqk,khd->qhd", w, v).reshape(n, nh * dv)
        return a @ T(p + "attn_output.weight").T
