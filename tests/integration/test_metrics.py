#!/usr/bin/env python3
"""Metrics operators can trust: after a scripted workload every gauge and counter equals the value computed
by hand, GetStats agrees with /metrics, memory components sum to RSS within 5%, and a real Prometheus
(Debian's) scraping the server answers every query of the shipped dashboard with values matching GetStats."""
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
import unittest
import urllib.parse
import urllib.request

import grpc

from harness import BIN, MLA, MOE, ROOT, TMP, Server, greedy, make_model, pb

B = 16  # block size


class MetricsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # Prefix caching off so that block counts follow from the workload alone.
        cls.s = Server("--no-prefix-caching", "--block-size", str(B))
        cls.stub = cls.s.stub

    @classmethod
    def tearDownClass(cls):
        cls.s.stop()

    def stats(self):
        return self.stub.GetStats(pb.GetStatsRequest(top_sessions=10))

    def test_scripted_workload_matches_hand_computed_values(self):
        st, m0 = self.stub, self.stats()
        # Two one-off requests (their blocks are freed at the end), two sessions, a fork, a cancel.
        r1 = st.Complete(greedy(token_ids=pb.TokenIds(ids=list(range(1, 21))), max_tokens=5, ignore_eos=True))
        r2 = st.Complete(greedy(token_ids=pb.TokenIds(ids=list(range(30, 70))), max_tokens=3, ignore_eos=True))
        st.CreateSession(pb.CreateSessionRequest(session_id="m1"))
        st.CreateSession(pb.CreateSessionRequest(session_id="m2"))
        a = st.Complete(greedy(token_ids=pb.TokenIds(ids=list(range(5, 42))), session_id="m1", max_tokens=4, ignore_eos=True))
        b = st.Complete(greedy(token_ids=pb.TokenIds(ids=list(range(7, 17))), session_id="m2", max_tokens=2, ignore_eos=True))
        st.ForkSession(pb.ForkSessionRequest(session_id="m1", child_session_id="m1.f"))
        stream = st.Generate(pb.GenerateRequest(text="cancel me", max_tokens=240, request_id="mc", ignore_eos=True))
        cancelled = [next(stream)]
        st.Cancel(pb.CancelRequest(request_id="mc"))
        cancelled += list(stream)
        n_cancelled = sum(len(r.token_ids) for r in cancelled)
        # On a fast machine the request may finish before the cancel lands; count what really happened.
        was_cancelled = cancelled[-1].finish_reason == "cancelled"
        time.sleep(0.3)  # let the engine publish a snapshot after the last step
        s = self.stats()
        # m1 holds 37 + 4 = 41 tokens, 40 of them with KV (the last sampled token is not computed yet);
        # m2: 12 tokens, 11 with KV; m1.f shares m1's blocks.
        m1_blocks, m2_blocks = math.ceil(40 / B), math.ceil(11 / B)
        self.assertEqual(s.kv_blocks_used, m1_blocks + m2_blocks)  # shared blocks count once
        self.assertEqual(s.kv_tokens_used, 40 + 11)
        self.assertEqual(s.kv_cache_slack_tokens, s.kv_blocks_used * B - 51)
        self.assertEqual(s.kv_blocks_used + s.kv_blocks_cached + s.kv_blocks_free, s.kv_blocks_total)
        self.assertEqual(s.kv_blocks_cached, 0)  # prefix caching off
        self.assertEqual(s.sessions_resident, 3)
        self.assertEqual(s.session_kv_bytes, (2 * m1_blocks + m2_blocks) * B * s.kv_bytes_per_token)
        self.assertEqual(s.requests_running + s.requests_waiting, 0)
        d = lambda f: getattr(s, f) - getattr(m0, f)  # noqa: E731
        self.assertEqual(d("requests_finished_length_total"), 4 + (0 if was_cancelled else 1))
        self.assertEqual(d("requests_finished_cancelled_total"), 1 if was_cancelled else 0)
        self.assertEqual(d("generated_tokens_total"), 5 + 3 + 4 + 2 + n_cancelled)
        self.assertEqual(d("prompt_tokens_total") - len(list(st.Tokenize(pb.TokenizeRequest(text="cancel me")).token_ids)),
                         20 + 40 + 37 + 10)
        self.assertEqual(d("cached_prompt_tokens_total"), 0)
        # The same numbers on /metrics.
        m = self.s.metrics()
        pairs = {
            'qkvserve_kv_cache_blocks{state="used"}': s.kv_blocks_used,
            'qkvserve_kv_cache_blocks{state="cached"}': s.kv_blocks_cached,
            'qkvserve_kv_cache_blocks{state="free"}': s.kv_blocks_free,
            'qkvserve_kv_cache_tokens{state="used"}': s.kv_tokens_used,
            'qkvserve_kv_cache_tokens{state="capacity"}': s.kv_tokens_capacity,
            'qkvserve_kv_cache_slack_tokens': s.kv_cache_slack_tokens,
            'qkvserve_kv_bytes_per_token': s.kv_bytes_per_token,
            'qkvserve_kv_block_size_tokens': B,
            'qkvserve_sessions{state="resident"}': s.sessions_resident,
            'qkvserve_session_kv_bytes': s.session_kv_bytes,
            'qkvserve_requests_finished_total{reason="cancelled"}': s.requests_finished_cancelled_total,
            'qkvserve_generated_tokens_total': s.generated_tokens_total,
            'qkvserve_prompt_tokens_total': s.prompt_tokens_total,
        }
        for k, v in pairs.items():
            self.assertEqual(m[k], v, k)
        self.assertAlmostEqual(m["qkvserve_kv_cache_usage_ratio"], s.kv_blocks_used / s.kv_blocks_total)
        self.assertGreaterEqual(m["qkvserve_time_to_first_token_seconds_count"], 5)
        self.assertEqual([u.session_id for u in s.top_sessions][:2], ["m1", "m1.f"] if s.top_sessions[0].session_id == "m1" else ["m1.f", "m1"])
        # Closing frees: used blocks return to zero and the counters say why.
        for sid in ("m1.f", "m1", "m2"):
            st.CloseSession(pb.CloseSessionRequest(session_id=sid))
        time.sleep(0.3)
        s2 = self.stats()
        self.assertEqual(s2.kv_blocks_used, 0)
        self.assertEqual(s2.session_evictions_closed_total - m0.session_evictions_closed_total, 3)

    def test_memory_components_sum_to_rss(self):
        s = self.stats()
        parts = [s.memory_weights_bytes, s.memory_kv_arena_bytes, s.memory_scratch_bytes, s.memory_heap_bytes, s.memory_other_bytes]
        self.assertTrue(all(p > 0 for p in parts), parts)
        self.assertLess(abs(sum(parts) - s.resident_memory_bytes) / s.resident_memory_bytes, 0.05,
                        f"components {parts} sum {sum(parts)} vs RSS {s.resident_memory_bytes}")
        self.assertEqual(s.memory_kv_arena_bytes, s.kv_tokens_capacity * s.kv_bytes_per_token)


def check_sessions(test, st, sid):
    """A session over three turns, a fork of it and a truncation of the fork give what fresh requests over the
    same history give (greedy tokens); turns after the first reuse cached tokens. Closes both sessions."""
    st.CreateSession(pb.CreateSessionRequest(session_id=sid))
    history = []
    for turn in range(3):
        ids = list(range(10 + turn, 40 + 3 * turn))
        r = st.Complete(greedy(token_ids=pb.TokenIds(ids=ids), session_id=sid, max_tokens=6, ignore_eos=True))
        fresh = st.Complete(greedy(token_ids=pb.TokenIds(ids=history + ids), max_tokens=6, ignore_eos=True))
        test.assertEqual(list(r.token_ids), list(fresh.token_ids), f"turn {turn}")
        if turn:
            test.assertGreater(r.usage.cached_tokens, 0)
        history += ids + list(r.token_ids)
    child = sid + ".f"
    st.ForkSession(pb.ForkSessionRequest(session_id=sid, child_session_id=child))
    st.TruncateSession(pb.TruncateSessionRequest(session_id=child, num_tokens=37))
    tail = list(range(100, 109))
    r = st.Complete(greedy(token_ids=pb.TokenIds(ids=tail), session_id=child, max_tokens=6, ignore_eos=True))
    fresh = st.Complete(greedy(token_ids=pb.TokenIds(ids=history[:37] + tail), max_tokens=6, ignore_eos=True))
    test.assertEqual(list(r.token_ids), list(fresh.token_ids))
    for s in (child, sid):
        st.CloseSession(pb.CloseSessionRequest(session_id=s))


class Int8KvTest(unittest.TestCase):
    """--kv-dtype int8: the accounting counts the scales everywhere (GetModelInfo, GetStats, /metrics, the
    arena), the same --kv-cache-bytes holds more tokens, and sessions, forks and truncation keep working."""

    def test_accounting_and_sessions(self):
        bf = Server("--block-size", str(B), "--kv-cache-bytes", "4MiB")
        i8 = Server("--block-size", str(B), "--kv-cache-bytes", "4MiB", "--kv-dtype", "int8")
        try:
            info, info_bf = (x.stub.GetModelInfo(pb.GetModelInfoRequest()) for x in (i8, bf))
            self.assertEqual((info.kv_dtype, info_bf.kv_dtype), ("int8", "bf16"))
            per_vector = info.head_dim + 2  # int8 values and a bf16 scale
            self.assertEqual(info.kv_bytes_per_token, info.num_layers * 2 * info.num_kv_heads * per_vector)
            self.assertEqual(info_bf.kv_bytes_per_token, info.num_layers * 2 * info.num_kv_heads * info.head_dim * 2)
            s, s_bf = (x.stub.GetStats(pb.GetStatsRequest()) for x in (i8, bf))
            self.assertEqual(s.kv_bytes_per_token, info.kv_bytes_per_token)
            self.assertEqual(s.memory_kv_arena_bytes, s.kv_tokens_capacity * s.kv_bytes_per_token)
            self.assertEqual(s.kv_bytes_capacity, s.kv_tokens_capacity * s.kv_bytes_per_token)
            # Same budget, more tokens: the ratio of the bytes per token (within a block of rounding).
            ratio = info_bf.kv_bytes_per_token / info.kv_bytes_per_token
            self.assertAlmostEqual(s.kv_tokens_capacity / s_bf.kv_tokens_capacity, ratio, delta=ratio * B / s_bf.kv_tokens_capacity)
            m = i8.metrics()
            self.assertEqual(m["qkvserve_kv_bytes_per_token"], info.kv_bytes_per_token)
            self.assertEqual(m['qkvserve_kv_cache_tokens{state="capacity"}'], s.kv_tokens_capacity)
            with open(i8.log_path) as f:
                self.assertIn(f"KV {info.kv_bytes_per_token} per token", f.read())
            # A session over three turns, a fork and a truncation give what fresh requests give.
            check_sessions(self, i8.stub, "q")
        finally:
            bf.stop()
            i8.stop()


class MlaTest(unittest.TestCase):
    """An MLA model (deepseek2): GetModelInfo, GetStats and /metrics report the latent cache's bytes per token
    exactly (no K and V per head), on bf16 and int8 KV; sessions, forks and truncation give what fresh
    requests give."""

    def test_accounting_and_sessions(self):
        model = make_model("mla", arch="deepseek2", seed=9)
        R, P = MLA["kv_lora_rank"], MLA["qk_rope_head_dim"]
        for kv, per_layer in (("bf16", (R + P) * 2), ("int8", R + P + 2 * 2)):
            with self.subTest(kv=kv):
                s = Server("--block-size", str(B), "--kv-cache-bytes", "4MiB", "--kv-dtype", kv, model=model)
                try:
                    st = s.stub
                    info = st.GetModelInfo(pb.GetModelInfoRequest())
                    self.assertEqual((info.architecture, info.attention), ("deepseek2", "MLA"))
                    self.assertEqual((info.kv_lora_rank, info.qk_rope_head_dim, info.q_lora_rank,
                                      info.qk_nope_head_dim, info.v_head_dim, info.num_kv_heads),
                                     (R, P, MLA["q_lora_rank"], MLA["qk_nope_head_dim"], MLA["v_head_dim"], 1))
                    self.assertEqual(info.kv_bytes_per_token, info.num_layers * per_layer)
                    stats = st.GetStats(pb.GetStatsRequest())
                    self.assertEqual(stats.kv_bytes_per_token, info.kv_bytes_per_token)
                    self.assertEqual(stats.memory_kv_arena_bytes, stats.kv_tokens_capacity * stats.kv_bytes_per_token)
                    self.assertEqual(stats.kv_tokens_capacity, (4 << 20) // (B * info.kv_bytes_per_token) * B)
                    m = s.metrics()
                    self.assertEqual(m["qkvserve_kv_bytes_per_token"], info.kv_bytes_per_token)
                    labels = [k for k in m if k.startswith("qkvserve_build_info")]
                    self.assertTrue(labels and 'attention="MLA"' in labels[0], labels)
                    # The offline planner computes the same figure from the Hugging Face config.
                    with open(os.path.join(TMP, "mla.json")) as f:
                        cfg = f.read()
                    plan = subprocess.run([os.path.join(BIN, "qkv-model"), "plan", "--config", "/dev/stdin", "--dtype",
                                           kv, "--json"], input=cfg, capture_output=True, text=True, check=True)
                    self.assertEqual(json.loads(plan.stdout)["kv_bytes_per_token"], info.kv_bytes_per_token)
                    check_sessions(self, st, "m")
                    self.assertTrue(s.wait_used_blocks(0), "blocks still used after the sessions closed")
                finally:
                    s.stop()


class MoeTest(unittest.TestCase):
    """A mixture of experts (qwen3moe): GetModelInfo reports experts and active parameters, the expert-load
    counter adds up to experts-per-token × tokens run in every layer, and sessions give what fresh requests
    give."""

    def test_expert_load_and_sessions(self):
        s = Server("--no-prefix-caching", "--block-size", str(B), model=make_model("moe", arch="qwen3moe", seed=4))
        try:
            st = s.stub
            info = st.GetModelInfo(pb.GetModelInfoRequest())
            self.assertEqual((info.architecture, info.num_experts, info.experts_per_token),
                             ("qwen3moe", MOE["num_experts"], MOE["num_experts_per_tok"]))
            self.assertLess(info.active_parameters, info.num_parameters)
            self.assertGreater(info.weight_bytes_per_token, 0)
            n_prompt, n_gen = 40, 6
            st.Complete(greedy(token_ids=pb.TokenIds(ids=list(range(3, 3 + n_prompt))), max_tokens=n_gen,
                               ignore_eos=True))
            key = 'qkvserve_moe_expert_tokens_total{{layer="{l}",expert="{e}"}}'
            deadline = time.time() + 10
            while True:
                m = s.metrics()
                # Every token fed to the model: the prompts (with BOS) and each generated token but the last.
                finished = sum(v for k, v in m.items() if k.startswith("qkvserve_requests_finished_total"))
                fed = m["qkvserve_prompt_tokens_total"] + m["qkvserve_generated_tokens_total"] - finished
                want = MOE["num_experts_per_tok"] * fed
                per_layer = [sum(m.get(key.format(e=e, l=l), 0) for e in range(MOE["num_experts"]))
                             for l in range(info.num_layers)]
                if (fed >= n_prompt + n_gen - 1 and per_layer == [want] * info.num_layers) or time.time() > deadline:
                    break
                time.sleep(0.1)
            self.assertEqual(per_layer, [want] * info.num_layers, m)
            check_sessions(self, st, "x")
        finally:
            s.stop()


PROM = shutil.which("prometheus")


@unittest.skipIf(PROM is None, "Debian's prometheus is not installed (tools/install-deps.sh installs it)")
class PrometheusTest(unittest.TestCase):
    def test_real_prometheus_and_dashboard_queries(self):
        s = Server()
        d = tempfile.mkdtemp(dir=TMP)
        try:
            with open(os.path.join(ROOT, "deploy", "prometheus", "prometheus.yml")) as f:
                cfg = f.read()
            r = subprocess.run(["promtool", "check", "config", os.path.join(ROOT, "deploy", "prometheus", "prometheus.yml")],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            cfg = cfg.replace("scrape_interval: 15s", "scrape_interval: 1s")
            cfg = cfg.replace("qkvserve:9464", s.metrics_addr).replace("qkvserve-0:9464", s.metrics_addr).replace("qkvserve-1:9464", s.metrics_addr)
            with open(os.path.join(d, "prometheus.yml"), "w") as f:
                f.write(cfg)
            import socket
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()
            prom = subprocess.Popen([PROM, "--config.file", os.path.join(d, "prometheus.yml"), "--storage.tsdb.path", d,
                                     "--web.listen-address", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            def query(q):
                url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
                return json.load(urllib.request.urlopen(url, timeout=10))

            try:
                deadline = time.time() + 60
                while True:  # until Prometheus is up and has scraped the server once
                    try:
                        if query("up")["data"]["result"]:
                            break
                    except OSError:
                        pass
                    self.assertLess(time.time(), deadline, "prometheus did not scrape in 60 s")
                    time.sleep(0.3)
                # A load while Prometheus scrapes.
                s.stub.CreateSession(pb.CreateSessionRequest(session_id="p"))
                for i in range(12):
                    s.stub.Complete(greedy(text=f"load {i} " * 4, max_tokens=12, session_id="p" if i % 2 else None))
                time.sleep(3)
                with open(os.path.join(ROOT, "deploy", "grafana", "qkvserve-dashboard.json")) as f:
                    dash = json.load(f)
                exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
                self.assertGreater(len(exprs), 8)
                for e in exprs:
                    q = e.replace("$__rate_interval", "30s").replace("[$__interval]", "[30s]")
                    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
                    res = json.load(urllib.request.urlopen(url, timeout=10))
                    self.assertEqual(res["status"], "success", q)
                    self.assertTrue(res["data"]["result"], f"no data for {q}")
                st = s.stub.GetStats(pb.GetStatsRequest())
                time.sleep(2)
                for q, want in [("qkvserve_kv_cache_blocks{state=\"used\"}", st.kv_blocks_used),
                                ("qkvserve_generated_tokens_total", st.generated_tokens_total),
                                ("qkvserve_sessions{state=\"resident\"}", st.sessions_resident)]:
                    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
                    res = json.load(urllib.request.urlopen(url, timeout=10))
                    self.assertEqual(float(res["data"]["result"][0]["value"][1]), want, q)
            finally:
                prom.terminate()
                prom.wait(30)
        finally:
            s.stop()


if __name__ == "__main__":
    import harness
    harness.main(verbosity=2)
