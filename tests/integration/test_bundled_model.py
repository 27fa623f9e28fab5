#!/usr/bin/env python3
"""The bundled model served exactly: qkvserve (started with no --model, so the default resolution is tested
too) against the PyTorch evaluation committed beside the model (tools/train/train.py computed it from the
GGUF's own weights in float64).

  * held-out perplexity through the API (prompt_logprobs) within 0.1% with f32 weights and KV, within 1%
    with the defaults (bf16); with --kv-dtype int8 within 1% of the bf16-KV figure;
  * greedy continuations of the committed prompts identical in f32;
  * the server's tokenizer gives the committed prompt ids;
  * 20 turns of `qkvctl chat` run without an error (drop_oldest keeps the chat inside the context)."""
import glob
import json
import math
import os
import unittest

import numpy as np

from harness import BIN, ROOT, Server, pb

MODEL = sorted(glob.glob(os.path.join(ROOT, "models", "*.gguf")))
EVAL = MODEL[0][:-len(".gguf")] + ".eval" if MODEL else None


def perplexity(stub, windows):
    total, n = 0.0, 0
    for win in windows:
        r = stub.Complete(pb.GenerateRequest(token_ids=pb.TokenIds(ids=win), max_tokens=1, temperature=0,
                                             prompt_logprobs=True))
        lps = [p.logprob for p in r.prompt_logprobs[1:]]
        assert len(lps) == len(win) - 1 and all(p.HasField("logprob") for p in r.prompt_logprobs[1:])
        total += sum(lps)
        n += len(lps)
    return math.exp(-total / n), n


@unittest.skipIf(not MODEL, "no bundled model under models/")
class BundledModelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(os.path.join(EVAL, "summary.json")) as f:
            cls.summary = json.load(f)
        with open(os.path.join(EVAL, "heldout_ids.json")) as f:
            ids = json.load(f)
        L = cls.summary["eval_window"]
        cls.windows = [ids[i:i + L] for i in range(0, len(ids), L)]
        cls.ref_lp = np.fromfile(os.path.join(EVAL, "heldout_logprobs.f32"), dtype="<f4").astype(np.float64)
        cls.ref_ppl = math.exp(-cls.ref_lp.sum() / len(cls.ref_lp))
        with open(os.path.join(EVAL, "greedy.json")) as f:
            cls.greedy = json.load(f)

    def serve(self, *args):
        # No --model: the server must find the bundled model by itself.
        env_model = os.environ.pop("QKVSERVE_MODEL", None)
        try:
            return Server(*args, model="")
        finally:
            if env_model is not None:
                os.environ["QKVSERVE_MODEL"] = env_model

    def test_f32_exact(self):
        s = self.serve("--weights-dtype", "f32", "--kv-dtype", "f32")
        try:
            info = s.stub.GetModelInfo(pb.GetModelInfoRequest())
            self.assertEqual(info.name, os.path.basename(MODEL[0])[:-5])
            ppl, n = perplexity(s.stub, self.windows)
            self.assertEqual(n, len(self.ref_lp))
            rel = abs(ppl - self.ref_ppl) / self.ref_ppl
            print(f"f32: qkvserve perplexity {ppl:.4f}, PyTorch {self.ref_ppl:.4f}, relative difference {rel:.2e}")
            self.assertLess(rel, 1e-3)
            for g in self.greedy:
                toks = list(s.stub.Tokenize(pb.TokenizeRequest(text=g["prompt"])).token_ids)
                self.assertEqual(toks, g["prompt_ids"])
                r = s.stub.Complete(pb.GenerateRequest(token_ids=pb.TokenIds(ids=g["prompt_ids"]), max_tokens=64,
                                                       temperature=0, ignore_eos=True))
                self.assertEqual(list(r.token_ids), g["greedy_ids"], g["prompt"])
        finally:
            s.stop()

    def test_bf16_defaults_within_one_percent(self):
        s = self.serve()
        try:
            ppl, _ = perplexity(s.stub, self.windows)
            rel = abs(ppl - self.ref_ppl) / self.ref_ppl
            print(f"bf16: qkvserve perplexity {ppl:.4f}, PyTorch {self.ref_ppl:.4f}, relative difference {rel:.2e}")
            self.assertLess(rel, 1e-2)
        finally:
            s.stop()
        # An int8 KV cache costs less than 1% of perplexity against the bf16 cache.
        s = self.serve("--kv-dtype", "int8")
        try:
            ppl8, _ = perplexity(s.stub, self.windows)
            rel8 = (ppl8 - ppl) / ppl
            print(f"int8 KV: qkvserve perplexity {ppl8:.4f}, bf16 KV {ppl:.4f}, relative difference {rel8:+.2e}")
            self.assertLess(abs(rel8), 1e-2)
        finally:
            s.stop()

    def test_chat_keeps_going(self):
        """The README's chat: 20 turns of `qkvctl chat` on the bundled model (1,024-token context, replies
        up to 128 tokens, lines of ~40 tokens) run without an error; the oldest history is dropped as the context
        fills."""
        import subprocess
        s = self.serve()
        try:
            lines = "".join(f"And the LORD spake unto Moses, saying, Speak unto the children of Israel, and say unto "
                            f"them, When any man of you bring an offering unto the LORD of the cattle {i}\n"
                            for i in range(20))
            r = subprocess.run([os.path.join(BIN, "qkvctl"), "--addr", s.addr, "chat", "--temperature", "0",
                                "--system", "Thou art a scribe."], input=lines, capture_output=True, text=True,
                               timeout=600)
            self.assertEqual(r.returncode, 0, r.stderr[-2000:])
            summaries = [l for l in r.stderr.splitlines() if "generated" in l and "prompt" in l]
            self.assertEqual(len(summaries), 20, r.stderr[-2000:])
            self.assertTrue(any("dropped" in l for l in summaries), summaries)
            self.assertNotIn("INVALID_ARGUMENT", r.stderr)
        finally:
            s.stop()


if __name__ == "__main__":
    import harness
    harness.main(verbosity=2)
