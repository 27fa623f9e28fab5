#!/usr/bin/env python3
"""A hybrid model (qwen35: Gated DeltaNet layers beside gated attention) through a real qkvserve over gRPC on
127.0.0.1: sessions keep the layers' state between turns (a 4-turn session equals the same conversation sent
fresh, token for token, and reuses its whole history), fork copies it (each branch equals its fresh
conversation), 15 concurrent requests give what each gives alone, cancellations leak no state slot, a client
resending its conversation without a session reuses a state snapshot, and the state is reported by
GetModelInfo, GetStats and /metrics. "Fresh" results come from a second server without prefix caching. Times to first token are printed, not asserted
(docs/performance.md has the measured figures)."""
import concurrent.futures
import json
import os
import subprocess
import unittest

import grpc

from harness import BIN, TMP, Server, greedy, pb

# Linear attention in 6 of 8 layers (interval 4), 2 key heads and 4 value heads of 32.
CONFIG = {"hidden_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-6, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
          "linear_value_head_dim": 32, "partial_rotary_factor": 0.25}
CHUNK = 16  # the Gated DeltaNet layer's chunk (engine/linear_attn.h kDeltaNetChunk)


def state_bytes_per_sequence(c):
    """What the engine keeps per sequence in each linear layer, f32: conv window, matrices, the open chunk."""
    nk, nv, dk, dv, k = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                         c["linear_value_head_dim"], c["linear_conv_kernel_dim"])
    channels = 2 * nk * dk + nv * dv
    per_layer = (k - 1) * channels + nv * dk * dv + CHUNK * (nk * dk + nv * (dv + 1))
    linear = sum(1 for i in range(c["num_hidden_layers"]) if (i + 1) % c["full_attention_interval"] != 0)
    return linear, 4 * per_layer * linear


def ids(n, salt):
    return [(i * 37 + salt * 101 + 11) % 500 + 1 for i in range(n)]


class HybridTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cpath, cls.model = os.path.join(TMP, "hybrid.json"), os.path.join(TMP, "hybrid.gguf")
        with open(cpath, "w") as f:
            json.dump(CONFIG, f)
        subprocess.run([os.path.join(BIN, "qkv-model"), "random", "--config", cpath, "--out", cls.model, "--arch",
                        "qwen35", "--seed", "9"], check=True, stdout=subprocess.DEVNULL)
        cls.s = Server("--threads", "2", "--debug-accounting", "--kv-cache-bytes", "64MiB", "--state-slots", "24",
                       model=cls.model)
        cls.stub = cls.s.stub
        # The same model without prefix caching: what a request sent fresh computes.
        cls.plain = Server("--threads", "2", "--kv-cache-bytes", "64MiB", "--no-prefix-caching", model=cls.model)

    @classmethod
    def tearDownClass(cls):
        cls.s.stop()
        cls.plain.stop()

    def complete(self, tokens, n=8, session=None, stub=None):
        extra = {"session_id": session} if session else {}
        return (stub or self.stub).Complete(greedy(token_ids=pb.TokenIds(ids=tokens), max_tokens=n, ignore_eos=True,
                                                   **extra))

    def fresh(self, tokens, n=8):
        return self.complete(tokens, n, stub=self.plain.stub)

    def history(self, sid):
        return list(self.stub.GetSession(pb.GetSessionRequest(session_id=sid, include_token_ids=True)).token_ids)

    def test_model_info_and_metrics_report_the_state(self):
        linear, per_seq = state_bytes_per_sequence(CONFIG)
        info = self.stub.GetModelInfo(pb.GetModelInfoRequest())
        self.assertEqual(info.architecture, "qwen35")
        self.assertEqual(info.linear_attention_layers, linear)
        self.assertEqual(info.state_bytes_per_sequence, per_seq)
        self.assertEqual(info.state_slots, 24)
        # Only the 2 attention layers cache K/V per token: 2 layers x 2 x 2 kv heads x 32 x 2 bytes.
        self.assertEqual(info.kv_bytes_per_token, 2 * 2 * 2 * 32 * 2)
        m = self.s.metrics()
        self.assertEqual(info.state_snapshot_slots, 6)
        self.assertEqual(m['qkvserve_memory_bytes{component="state"}'], (24 + 6) * per_seq)
        self.assertEqual(m['qkvserve_state_bytes_per_sequence'], per_seq)
        self.assertEqual(m['qkvserve_state_slots{state="used"}'] + m['qkvserve_state_slots{state="free"}'], 24)
        st = self.stub.GetStats(pb.GetStatsRequest())
        self.assertEqual(st.memory_state_bytes, (24 + 6) * per_seq)
        self.assertEqual(st.state_slots_used + st.state_slots_free, 24)

    def test_four_turn_session_equals_fresh_and_reuses_history(self):
        sid = "turns"
        self.stub.CreateSession(pb.CreateSessionRequest(session_id=sid))
        ttft = []
        for turn in range(4):
            before = self.history(sid)
            new = ids(1990 if turn == 0 else 7 + turn, turn)
            r = self.complete(new, session=sid)
            fresh = self.fresh(before + new)
            self.assertEqual(list(r.token_ids), list(fresh.token_ids), f"turn {turn}")
            self.assertEqual(r.usage.prompt_tokens, len(before) + len(new))
            # The whole history is reused (state and attention KV) but its last token, the previous reply's
            # last, which no forward pass has seen yet.
            self.assertEqual(r.usage.cached_tokens, max(len(before) - 1, 0), f"turn {turn}")
            ttft.append((len(before), r.timings.time_to_first_token_seconds, fresh.timings.time_to_first_token_seconds))
        for hist, t_session, t_fresh in ttft[1:]:
            print(f"history {hist} tokens: time to first token {1e3 * t_session:.1f} ms in the session, "
                  f"{1e3 * t_fresh:.1f} ms sent fresh ({t_fresh / max(t_session, 1e-9):.1f}x)")
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))

    def test_fork_then_diverge(self):
        sid = "trunk"
        self.stub.CreateSession(pb.CreateSessionRequest(session_id=sid))
        self.complete(ids(45, 1), session=sid)
        self.stub.ForkSession(pb.ForkSessionRequest(session_id=sid, child_session_id="branch"))
        for name, salt in ((sid, 2), ("branch", 3), (sid, 4), ("branch", 5)):
            before, new = self.history(name), ids(9 + salt, salt)
            r = self.complete(new, session=name)
            self.assertEqual(list(r.token_ids), list(self.fresh(before + new).token_ids), name)
            self.assertEqual(r.usage.cached_tokens, len(before) - 1, name)
        self.stub.CloseSession(pb.CloseSessionRequest(session_id="branch"))
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))

    def test_stateless_resend_reuses_a_state_snapshot(self):
        """A client without sessions resends the growing conversation: the prefix cache reuses the attention
        layers' blocks up to a block boundary where the state was snapshotted (the previous request's last),
        and the reply is what the same request computes without any cache."""
        convo = ids(50, 21)
        for turn in range(3):
            r = self.complete(convo)
            self.assertEqual(list(r.token_ids), list(self.fresh(convo).token_ids), f"turn {turn}")
            if turn > 0:
                self.assertGreater(r.usage.cached_tokens, 0, f"turn {turn}")
                self.assertEqual(r.usage.cached_tokens % 16, 0)
            convo = convo + list(r.token_ids) + ids(9, 30 + turn)
        self.assertTrue(self.s.wait_metric('qkvserve_state_snapshots{state="used"}', lambda v: v > 0))
        m = self.s.metrics()
        self.assertEqual(m['qkvserve_state_snapshots{state="capacity"}'], 6)  # a quarter of the 24 slots
        self.assertEqual(self.s.accounting(), "")

    def test_fifteen_concurrent_requests_match_solo(self):
        prompts = [ids(5 + 23 * k, 10 + k) for k in range(15)]
        solo = [list(self.fresh(p, n=12).token_ids) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(15) as ex:
            together = list(ex.map(lambda p: list(self.complete(p, n=12).token_ids), prompts))
        self.assertEqual(together, solo)

    def test_truncate_recomputes_and_cancel_leaks_nothing(self):
        sid = "cut"
        self.stub.CreateSession(pb.CreateSessionRequest(session_id=sid))
        self.complete(ids(40, 6), session=sid)
        self.stub.TruncateSession(pb.TruncateSessionRequest(session_id=sid, num_tokens=30))
        before, new = self.history(sid), ids(5, 7)
        r = self.complete(new, session=sid)
        # Cut below what it computed, the session's state starts over (from a prefix snapshot where one exists).
        self.assertEqual(list(r.token_ids), list(self.fresh(before + new).token_ids))
        self.assertEqual(r.usage.cached_tokens % 16, 0)
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        # Cancelled and deadline-killed streams give their slots back.
        for j in range(12):
            call = self.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids(30 + j, j)), max_tokens=200,
                                                         ignore_eos=True), timeout=None if j % 2 else 0.05)
            try:
                for k, _ in enumerate(call):
                    if k >= 1:
                        call.cancel()
            except grpc.RpcError:
                pass
        self.assertTrue(self.s.wait_metric('qkvserve_state_slots{state="used"}', 0.0),
                        self.s.metrics().get('qkvserve_state_slots{state="used"}'))
        self.assertEqual(self.s.accounting(), "")


if __name__ == "__main__":
    import harness
    harness.main(verbosity=2)
