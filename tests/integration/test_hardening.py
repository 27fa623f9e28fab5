#!/usr/bin/env python3
"""One request never hurts another (issue 13): regression tests through a real server, one per observation
fixed so far."""
import threading
import unittest

import grpc

from harness import TMP, Server, collect, greedy, pb


class HardeningTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.s = Server("--threads", "2")
        cls.stub = cls.s.stub

    @classmethod
    def tearDownClass(cls):
        cls.s.stop()

    def test_max_tokens_near_int_max_fails_alone(self):
        # history + prompt + max_tokens used to wrap around int, pass the context check and fail the whole
        # step, including other clients' streams.
        result = {}

        def stream():
            result["r"] = collect(self.stub.Generate(greedy(text="a steady stream", max_tokens=60, ignore_eos=True)))

        t = threading.Thread(target=stream)
        t.start()
        codes = []
        for n in (257, 200, 1):
            with self.assertRaises(grpc.RpcError) as cm:
                self.stub.Complete(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * n), max_tokens=2147483647))
            codes.append(cm.exception.code())
            self.assertIn("context", cm.exception.details())
        t.join(60)
        self.assertEqual(codes, [grpc.StatusCode.INVALID_ARGUMENT] * 3)
        rs, _, ids = result["r"]
        self.assertEqual(rs[-1].finish_reason, "length")
        self.assertEqual(len(ids), 60)

    def test_tiny_temperature_is_greedy(self):
        want = list(self.stub.Complete(greedy(text="In the beginning", max_tokens=8, ignore_eos=True)).token_ids)
        for t in (1e-40, 1e-6):
            got = self.stub.Complete(pb.GenerateRequest(text="In the beginning", max_tokens=8, temperature=t,
                                                        ignore_eos=True, seed=1))
            self.assertEqual(list(got.token_ids), want, f"temperature {t}")


    def code(self, fn, req):
        with self.assertRaises(grpc.RpcError) as cm:
            fn(req)
        return cm.exception.code(), cm.exception.details()

    def test_request_sizes_are_bounded_before_any_work(self):
        # Observation 3: 400,000 stop strings were accepted and scanned for every token.
        C = self.code
        cases = [
            (pb.GenerateRequest(text="x", stop=["s%d" % i for i in range(400000)]), "--max-stop-strings"),
            (pb.GenerateRequest(text="x", stop=["y" * 20000]), "--max-stop-bytes"),
            (pb.GenerateRequest(text="x", stop_token_ids=list(range(5000))), "--max-stop-token-ids"),
            (pb.GenerateRequest(text="a" * (5 << 20)), "--max-prompt-bytes"),
            (pb.GenerateRequest(messages=pb.Messages(messages=[pb.ChatMessage(role="user", content="hi")] * 2000)),
             "--max-messages"),
        ]
        for req, flag in cases:
            code, details = C(self.stub.Complete, req)
            self.assertEqual(code, grpc.StatusCode.RESOURCE_EXHAUSTED, details)
            self.assertIn(flag, details)
        code, details = C(self.stub.Complete, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 300)))
        self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT, details)
        self.assertIn("context", details)
        # A message past the largest valid request (sized from --max-prompt-bytes and the context) is refused
        # by gRPC before it is parsed into memory (it used to accept 64 MiB, any number of them at once).
        big = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[300] * (6 << 20)))  # ~12 MB on the wire
        code, details = C(self.stub.Complete, big)
        self.assertEqual(code, grpc.StatusCode.RESOURCE_EXHAUSTED, details)
        code, details = C(self.stub.Tokenize, pb.TokenizeRequest(text="a" * (5 << 20)))
        self.assertEqual(code, grpc.StatusCode.RESOURCE_EXHAUSTED)
        # Ids are bounded everywhere and never echoed back beyond their allowed length.
        long_id = "x" * 100000
        for fn, req in [(self.stub.Cancel, pb.CancelRequest(request_id=long_id)),
                        (self.stub.GetSession, pb.GetSessionRequest(session_id=long_id)),
                        (self.stub.CloseSession, pb.CloseSessionRequest(session_id=long_id)),
                        (self.stub.ForkSession, pb.ForkSessionRequest(session_id=long_id)),
                        (self.stub.TruncateSession, pb.TruncateSessionRequest(session_id=long_id)),
                        (self.stub.Complete, pb.GenerateRequest(text="x", session_id=long_id)),
                        (self.stub.Complete, pb.GenerateRequest(text="x", request_id=long_id))]:
            code, details = C(fn, req)
            self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT, details)
            self.assertLess(len(details), 200)
        self.assertTrue(self.stub.Complete(greedy(text="still serving", max_tokens=2)).token_ids)

    def test_limits_are_flags(self):
        s = Server("--max-stop-strings", "2", "--max-prompt-bytes", "10")
        try:
            code, details = self.code(s.stub.Complete, pb.GenerateRequest(text="x", stop=["a", "b", "c"]))
            self.assertEqual((code, "--max-stop-strings" in details), (grpc.StatusCode.RESOURCE_EXHAUSTED, True))
            code, details = self.code(s.stub.Complete, pb.GenerateRequest(text="x" * 11))
            self.assertEqual((code, "--max-prompt-bytes" in details), (grpc.StatusCode.RESOURCE_EXHAUSTED, True))
            self.assertTrue(s.stub.Complete(greedy(text="x" * 10, max_tokens=1, stop=["a", "b"])).token_ids)
        finally:
            s.stop()


class QuotaTest(unittest.TestCase):
    """Observation 4: one key forked 12,000 sessions; the session cap was global; priority crossed keys."""

    def code(self, fn, req, **kw):
        with self.assertRaises(grpc.RpcError) as cm:
            fn(req, **kw)
        return cm.exception.code(), cm.exception.details()

    def test_per_key_sessions_priority_and_running(self):
        import os
        import tempfile
        keys = os.path.join(tempfile.mkdtemp(dir=TMP), "keys")
        with open(keys, "w") as f:
            f.write("# key quotas\nalpha sessions=2 priority=0..5 running=1\nbeta\n")
        s = Server("--api-keys", keys, "--max-sessions-per-key", "3")
        try:
            a = [("authorization", "Bearer alpha")]
            b = [("authorization", "Bearer beta")]
            s.stub.CreateSession(pb.CreateSessionRequest(session_id="a1"), metadata=a)
            s.stub.CreateSession(pb.CreateSessionRequest(session_id="a2"), metadata=a)
            code, details = self.code(s.stub.CreateSession, pb.CreateSessionRequest(session_id="a3"), metadata=a)
            self.assertEqual(code, grpc.StatusCode.RESOURCE_EXHAUSTED, details)
            self.assertIn("sessions", details)
            code, details = self.code(s.stub.ForkSession, pb.ForkSessionRequest(session_id="a1", child_session_id="a4"),
                                      metadata=a)
            self.assertEqual(code, grpc.StatusCode.RESOURCE_EXHAUSTED, details)  # forks count
            for i in range(3):  # another key is not affected; it has the flag's default of 3
                s.stub.CreateSession(pb.CreateSessionRequest(session_id=f"b{i}"), metadata=b)
            code, _ = self.code(s.stub.CreateSession, pb.CreateSessionRequest(session_id="b3"), metadata=b)
            self.assertEqual(code, grpc.StatusCode.RESOURCE_EXHAUSTED)
            # Priority: alpha may ask for 5, beta only for 0 (the default range).
            self.assertTrue(s.stub.Complete(greedy(text="hi", max_tokens=2, priority=5), metadata=a).token_ids)
            code, details = self.code(s.stub.Complete, greedy(text="hi", max_tokens=2, priority=1), metadata=b)
            self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT, details)
            self.assertIn("priority", details)
            # running=1: alpha's three concurrent requests all finish, one at a time.
            import concurrent.futures
            with concurrent.futures.ThreadPoolExecutor(3) as ex:
                futs = [ex.submit(s.stub.Complete, greedy(text=f"x{i}", max_tokens=20, ignore_eos=True), metadata=a)
                        for i in range(3)]
                peak = 0
                while not all(f.done() for f in futs):
                    peak = max(peak, s.stub.GetStats(pb.GetStatsRequest(), metadata=a).requests_running)
                self.assertEqual([len(f.result().token_ids) for f in futs], [20, 20, 20])
            self.assertLessEqual(peak, 1)
        finally:
            s.stop()

    def test_bad_key_file_is_refused(self):
        import os
        import subprocess
        import tempfile
        from harness import BIN, make_model
        keys = os.path.join(tempfile.mkdtemp(dir=TMP), "keys")
        with open(keys, "w") as f:
            f.write("alpha sessions=lots\n")
        r = subprocess.run([os.path.join(BIN, "qkvserve"), "--model", make_model(), "--api-keys", keys],
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("line 1", r.stderr)


class EngineFaultTest(unittest.TestCase):
    """Observations 5, 6 and 8: non-finite logits, exceptions on the engine thread (with the engine's fault
    injection, QKV_FAULT_INJECT) and liveness."""

    def test_non_finite_logits_end_the_request_with_internal(self):
        import os
        import shutil
        import struct
        import sys
        from harness import make_model
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reference"))
        from gguf_ref import Gguf
        # A final norm of 1e38 (finite, so the loader accepts it) makes every logit overflow to +-inf.
        path = os.path.join(TMP, "overflow.gguf")
        shutil.copy(make_model(), path)
        g = Gguf(path)
        ne, ttype, off = g.tensors["output_norm.weight"]
        self.assertEqual(ttype, 0)
        with open(path, "r+b") as f:
            f.seek(g.data + off)
            f.write(struct.pack("<%df" % ne[0], *([1e38] * ne[0])))
        s = Server("--threads", "1", "--weights-dtype", "f32", model=path)
        try:
            for _ in range(2):
                with self.assertRaises(grpc.RpcError) as cm:
                    s.stub.Complete(greedy(text="overflow", max_tokens=4))
                self.assertEqual(cm.exception.code(), grpc.StatusCode.INTERNAL)
                self.assertIn("non-finite logits", cm.exception.details())
            self.assertTrue(s.stub.Tokenize(pb.TokenizeRequest(text="still serving")).token_ids)
        finally:
            s.stop()

    def test_exception_on_the_engine_thread_fails_the_step_not_the_process(self):
        s = Server("--threads", "1", env={"QKV_FAULT_INJECT": "throw_on_step=3"})
        try:
            failed = 0
            for i in range(4):
                try:
                    s.stub.Complete(greedy(text=f"try {i}", max_tokens=4, ignore_eos=True))
                except grpc.RpcError as e:
                    self.assertEqual(e.code(), grpc.StatusCode.INTERNAL)
                    self.assertIn("engine step failed", e.details())
                    failed += 1
            self.assertEqual(failed, 1)
            self.assertIsNone(s.proc.poll())
            self.assertEqual(len(s.stub.Complete(greedy(text="after", max_tokens=3, ignore_eos=True)).token_ids), 3)
        finally:
            s.stop()

    def test_liveness_follows_the_engine_thread(self):
        import time
        from harness import health_pb2
        s = Server("--threads", "1", "--liveness-timeout-seconds", "1",
                   env={"QKV_FAULT_INJECT": "stall_on_step=3:6"})
        try:
            live = lambda: s.health.Check(health_pb2.HealthCheckRequest(service="")).status  # noqa: E731
            self.assertEqual(live(), health_pb2.HealthCheckResponse.SERVING)
            fut = s.stub.Complete.future(greedy(text="stall", max_tokens=4, ignore_eos=True))
            seen = set()
            deadline = time.time() + 20
            while time.time() < deadline and not (health_pb2.HealthCheckResponse.NOT_SERVING in seen and fut.done()):
                seen.add(live())
                time.sleep(0.1)
            self.assertIn(health_pb2.HealthCheckResponse.NOT_SERVING, seen, "a stalled engine thread is not live")
            self.assertEqual(len(fut.result().token_ids), 4)
            time.sleep(0.6)
            self.assertEqual(live(), health_pb2.HealthCheckResponse.SERVING, "live again once it progresses")
        finally:
            s.stop()


class ProcessLifeTest(unittest.TestCase):
    """Observation 7: SIGTERM during load was ignored until loading ended; a second SIGTERM did nothing; the
    engine was destroyed before the metrics exposer that reads it. Observation 9: the automatic KV budget
    ignored a container's memory limit."""

    def test_scrapes_during_shutdown_do_not_crash_it(self):
        import threading
        import urllib.request
        for _ in range(3):
            s = Server("--threads", "1", "--drain-grace-seconds", "1")
            stop = threading.Event()

            def scrape():
                while not stop.is_set():
                    try:
                        urllib.request.urlopen(f"http://{s.metrics_addr}/metrics", timeout=2).read()
                    except Exception:
                        pass

            threads = [threading.Thread(target=scrape) for _ in range(3)]
            for t in threads:
                t.start()
            try:
                self.assertEqual(s.stop(), 0, "exit status while /metrics was being scraped")
            finally:
                stop.set()
                for t in threads:
                    t.join()

    def test_kv_budget_follows_the_cgroup_limit(self):
        import os
        import re
        import subprocess
        import tempfile
        from harness import BIN, make_model

        def arena_mib(env):
            d = tempfile.mkdtemp(dir=TMP)
            ready = os.path.join(d, "ready")
            p = subprocess.Popen([os.path.join(BIN, "qkvserve"), "--model", make_model(), "--listen", "127.0.0.1:0",
                                  "--metrics-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--threads", "1", "--ready-file", ready],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=dict(os.environ, **env))
            import time
            deadline = time.time() + 60
            while not os.path.exists(ready) and time.time() < deadline and p.poll() is None:
                time.sleep(0.05)
            p.send_signal(__import__("signal").SIGTERM)
            out = p.communicate(timeout=60)[0]
            m = re.search(r"kv cache: .* ([0-9.]+) MiB", out)
            self.assertIsNotNone(m, out)
            return float(m.group(1))

        host = arena_mib({})
        cg = tempfile.mkdtemp(dir=TMP)
        with open(os.path.join(cg, "memory.max"), "w") as f:
            f.write(str(60 << 20))
        with open(os.path.join(cg, "memory.current"), "w") as f:
            f.write(str(20 << 20))
        limited = arena_mib({"QKV_CGROUP_ROOT": cg})
        # 40 MiB left under the limit: a quarter of it (after the tiny model's weights) is about 10 MiB.
        self.assertLess(limited, 10.5)
        self.assertGreater(host, limited)
        os.makedirs(os.path.join(cg, "v1", "memory"))
        with open(os.path.join(cg, "v1", "memory", "memory.limit_in_bytes"), "w") as f:
            f.write(str(60 << 20))
        with open(os.path.join(cg, "v1", "memory", "memory.usage_in_bytes"), "w") as f:
            f.write(str(20 << 20))
        self.assertLess(arena_mib({"QKV_CGROUP_ROOT": os.path.join(cg, "v1")}), 10.5)

    def test_sigterm_while_starting_exits_at_once(self):
        import os
        import signal
        import subprocess
        import time
        from harness import BIN, make_model
        model = make_model()
        for delay in (0.0, 0.02, 0.05):
            p = subprocess.Popen([os.path.join(BIN, "qkvserve"), "--model", model, "--listen", "127.0.0.1:0",
                                  "--metrics-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--threads", "1", "--kv-cache-bytes", "8MiB"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(delay)
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                self.fail(f"qkvserve ignored SIGTERM {delay} s after start")

    def test_second_sigterm_while_draining_exits_now(self):
        import signal
        import time
        s = Server("--threads", "1", "--drain-grace-seconds", "120")
        stream = s.stub.Generate(pb.GenerateRequest(text="go", max_tokens=200, ignore_eos=True))
        next(stream)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        self.assertIsNone(s.proc.poll(), "the first signal drains (the stream is still running)")
        t0 = time.time()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(10)
        self.assertLess(time.time() - t0, 10)
        self.assertEqual(s.proc.returncode, 1)
        s.stop()


if __name__ == "__main__":
    import harness
    harness.main()
