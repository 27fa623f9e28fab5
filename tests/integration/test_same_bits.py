#!/usr/bin/env python3
"""Same bits through the server: a request's logprobs (and its prompt logprobs) are bit-identical alone and
among 15 concurrent requests of other lengths, and with the prompt sent in one step or spread over several
(a small --max-num-batched-tokens, or a small --max-logit-rows), for bf16 and f32 weights, quantized (Q4_K_M)
weights, and with an int8 KV cache, and on an MLA model. Run once per instruction-set level by tests/isa_level_test.sh, which also caps the engine's own kernels
(QKV_MAX_ISA): GetModelInfo must report the capped level."""
import concurrent.futures
import os
import struct
import subprocess
import unittest

from harness import BIN, TMP, Server, make_model, pb


def bits(resp):
    gen = [(lp.token_id, struct.pack("<f", lp.logprob)) for lp in resp.logprobs]
    prompt = [struct.pack("<f", p.logprob) for p in resp.prompt_logprobs if p.HasField("logprob")]
    return list(resp.token_ids), gen, prompt


def request(n_prompt, seed, max_tokens=8):
    ids = [(seed * 131 + i * 17) % 500 + 1 for i in range(n_prompt)]
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=max_tokens, temperature=0.0, logprobs=1,
                              prompt_logprobs=True, ignore_eos=True)


class SameBitsTest(unittest.TestCase):
    def check(self, *args, model=None):
        model = model or make_model("samebits", arch="qwen2", vocab=512, ctx=256, seed=11)
        s = Server("--threads", "2", *args, model=model)
        try:
            info = s.stub.GetModelInfo(pb.GetModelInfoRequest())
            levels = ["avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"]
            self.assertIn(info.kernel_isa, levels)
            cap = os.environ.get("QKV_MAX_ISA")
            if cap:  # at most the cap (the CPU may have less)
                self.assertLessEqual(levels.index(info.kernel_isa), levels.index(cap), info.kernel_isa)
            alone = bits(s.stub.Complete(request(45, 0)))
            self.assertEqual(len(alone[1]), 8)
            others = [request(3 + 11 * i, i + 1, max_tokens=4 + i % 9) for i in range(15)]
            with concurrent.futures.ThreadPoolExecutor(16) as ex:
                futs = [ex.submit(s.stub.Complete, r) for r in others]
                mine = ex.submit(s.stub.Complete, request(45, 0))
                together = bits(mine.result())
                for f in futs:
                    f.result()
            self.assertEqual(together, alone, "logprobs among 15 others differ from alone")
            return alone
        finally:
            s.stop()

    def test_alone_vs_among_others_and_chunking(self):
        for dtype, kv in (("bf16", "bf16"), ("f32", "bf16"), ("bf16", "int8")):
            with self.subTest(weights=dtype, kv=kv):
                whole = self.check("--weights-dtype", dtype, "--kv-dtype", kv)
                chunked = self.check("--weights-dtype", dtype, "--kv-dtype", kv, "--max-num-batched-tokens", "16")
                self.assertEqual(chunked, whole, "prompt chunking changed the bits")
                if dtype == "bf16" and kv == "bf16":  # prompt logprobs cut to 16 rows of logits a step
                    capped = self.check("--max-logit-rows", "16", "--max-num-seqs", "16")
                    self.assertEqual(capped, whole, "cutting prompts to the rows of logits changed the bits")

    def test_quantized_weights(self):
        src = make_model("samebits", arch="qwen2", vocab=512, ctx=256, seed=11)
        q = os.path.join(TMP, "samebits_q4_k_m.gguf")
        if not os.path.exists(q):
            subprocess.run([os.path.join(BIN, "qkv-model"), "quantize", src, q, "--type", "Q4_K_M"], check=True,
                           stdout=subprocess.DEVNULL)
        whole = self.check(model=q)
        chunked = self.check("--max-num-batched-tokens", "16", model=q)
        self.assertEqual(chunked, whole, "prompt chunking changed the bits on quantized weights")

    def test_moe(self):
        """The same on a mixture of experts (qwen3moe): the grouping of tokens by expert changes no bit."""
        moe = make_model("samebits_moe", arch="qwen3moe", vocab=512, ctx=256, seed=11)
        whole = self.check(model=moe)
        chunked = self.check("--max-num-batched-tokens", "16", model=moe)
        self.assertEqual(chunked, whole, "prompt chunking changed the bits on MoE")

    def test_mla(self):
        """The same on an MLA model (deepseek2: a latent cache, absorbed attention), bf16 and int8 KV."""
        mla = make_model("samebits_mla", arch="deepseek2", vocab=512, ctx=256, seed=11)
        for kv in ("bf16", "int8"):
            with self.subTest(kv=kv):
                whole = self.check("--kv-dtype", kv, model=mla)
                chunked = self.check("--kv-dtype", kv, "--max-num-batched-tokens", "16", model=mla)
                self.assertEqual(chunked, whole, "prompt chunking changed the bits on MLA")


if __name__ == "__main__":
    import harness
    harness.main()
