#!/usr/bin/env python3
"""API fuzzing against a live server (issue 14): a generator sends QKV_API_FUZZ_N (default 2,000) requests
across every RPC, with extreme integers, huge repeated fields, invalid ids, UTF-8 edge cases (raw invalid
bytes too), random sampling values, sessions created / forked / truncated / closed in random order and
streams cancelled mid-way. After every request: the process is alive, health is SERVING, the answer is OK
or a client error with a message (never INTERNAL or UNKNOWN), and the engine's block and state accounting
(/debug/accounting) is clean. A canary greedy stream runs throughout and must produce the same tokens
every time. The seed is printed; QKV_API_FUZZ_SEED reproduces a run."""
import math
import os
import random
import threading
import time
import unittest

import grpc

from harness import Server, collect, greedy, health_pb2, make_model, pb

ALLOWED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
}
VOCAB = 512
INTS = [0, 1, -1, 2, 7, 255, 256, VOCAB - 1, VOCAB, 4096, 2**31 - 1, -2**31, 2**31 - 2, -2**31 + 1]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 1e-30, 1e30, 3.4e38, -3.4e38, math.inf, -math.inf, math.nan, 2.0, 100.0]
TEXTS = ["", " ", "a", "In the beginning", "\u0000", "\u00e9\u0301", "\U0001F600" * 10, "\ufeff", "\u200b\u200d",
         "<|endoftext|>", "<|im_start|>user", "x" * 5000, "\n\r\t" * 50, "\u0645\u0631\u062d\u0628\u0627",
         "\uffff\ufffe", "\U0010FFFF", "a\u0000b", "日本語のテキスト"]
BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"ok\x80ok"]
IDS = ["", "s", "a" * 128, "a" * 129, "a" * 100000, "with space", "new\nline", "../etc", "ünï", "\u0000", "-", "_x"]


def varint(n):
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def raw_field(field, payload):
    return varint(field << 3 | 2) + varint(len(payload)) + payload


class ApiFuzzTest(unittest.TestCase):
    def test_generated_requests(self):
        n_requests = int(os.environ.get("QKV_API_FUZZ_N", "2000"))
        seed = int(os.environ.get("QKV_API_FUZZ_SEED", str(int(time.time()))))
        print(f"api fuzz: {n_requests} requests, seed {seed} (QKV_API_FUZZ_SEED={seed} reproduces)", flush=True)
        rng = random.Random(seed)
        s = Server("--threads", "1", "--debug-accounting", "--max-sessions-per-key", "64", "--max-waiting", "64",
                   "--kv-cache-bytes", "4MiB", model=make_model("fuzz", vocab=VOCAB))
        stub, ch = s.stub, s.channel
        raw_complete = ch.unary_unary("/qkvserve.v1.Inference/Complete", request_serializer=lambda b: b,
                                      response_deserializer=pb.CompleteResponse.FromString)
        raw_tokenize = ch.unary_unary("/qkvserve.v1.Inference/Tokenize", request_serializer=lambda b: b,
                                      response_deserializer=pb.TokenizeResponse.FromString)
        canary_req = greedy(text="And God said", max_tokens=40, ignore_eos=True)
        canary_want = list(stub.Complete(canary_req).token_ids)
        self.assertEqual(len(canary_want), 40)
        canary = {"runs": 0, "bad": [], "stop": False}

        def canary_loop():
            while not canary["stop"]:
                try:
                    _, _, ids = collect(stub.Generate(canary_req, timeout=120))
                    if ids != canary_want:
                        canary["bad"].append(ids)
                    canary["runs"] += 1
                except grpc.RpcError as e:  # RESOURCE_EXHAUSTED under a flood is allowed; nothing else
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        canary["bad"].append(f"{e.code()}: {e.details()}")
                    time.sleep(0.05)

        t = threading.Thread(target=canary_loop)
        t.start()
        sessions = []
        codes = {}
        messages = {}
        try:
            for i in range(n_requests):
                kind, code, details = self.one_request(rng, stub, raw_complete, raw_tokenize, sessions)
                codes[(kind, code)] = codes.get((kind, code), 0) + 1
                where = f"request {i} ({kind}, seed {seed})"
                if kind == "raw_bad_utf8" and code == grpc.StatusCode.UNIMPLEMENTED:
                    # protobuf refuses invalid UTF-8 in a proto3 string while parsing, before qkvserve sees the
                    # request, and gRPC C++ 1.51 answers a failed parse with a bare UNIMPLEMENTED (see
                    # docs/reliability.md); the server must still be unharmed, which the checks below verify.
                    details = "(refused by protobuf's parser)"
                else:
                    self.assertIn(code, ALLOWED, f"{where}: {code} {details}")
                if code != grpc.StatusCode.OK and code != grpc.StatusCode.CANCELLED:
                    self.assertTrue(details, f"{where}: {code} without a message")
                    messages[details[:60]] = messages.get(details[:60], 0) + 1
                self.assertIsNone(s.proc.poll(), f"{where}: the server exited")
                hs = s.health.Check(health_pb2.HealthCheckRequest(service="qkvserve.v1.Inference"), timeout=10)
                self.assertEqual(hs.status, health_pb2.HealthCheckResponse.SERVING, where)
                self.assertEqual(s.accounting(), "", where)
        finally:
            canary["stop"] = True
            t.join(180)
        self.assertEqual(canary["bad"], [], "the canary stream changed")
        self.assertGreater(canary["runs"], 0)
        summary = {}
        for (kind, code), n in codes.items():
            summary.setdefault(kind, {})[code.name] = n
        print("api fuzz: answers by RPC:", summary, flush=True)
        top = sorted(messages.items(), key=lambda kv: -kv[1])[:12]
        print("api fuzz: most frequent errors:", top, flush=True)
        print(f"api fuzz: canary ran {canary['runs']} times, same tokens each time", flush=True)
        for sid in sessions:
            try:
                stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            except grpc.RpcError:
                pass
        self.assertTrue(s.wait_used_blocks(0, timeout=30), "blocks still used after every session closed")
        self.assertEqual(s.metrics().get("qkvserve_grpc_live_reactors"), 0.0)
        self.assertEqual(s.stop(), 0)

    # --- the generator ---------------------------------------------------------------------------------
    def pick_int(self, rng):
        return rng.choice(INTS) if rng.random() < 0.6 else rng.randint(-1000, 1000)

    def pick_float(self, rng):
        return rng.choice(FLOATS) if rng.random() < 0.3 else rng.uniform(0, 2)

    def pick_text(self, rng):
        if rng.random() < 0.7:
            return rng.choice(TEXTS)
        return "".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0x80, 0x7ff), rng.randint(0x800, 0xd7ff),
                                       rng.randint(0xe000, 0xffff), rng.randint(0x10000, 0x10ffff)]))
                       for _ in range(rng.randint(1, 40)))

    def pick_id(self, rng, sessions):
        if sessions and rng.random() < 0.6:
            return rng.choice(sessions)
        return rng.choice(IDS) if rng.random() < 0.7 else "fz-%d" % rng.randint(0, 50)

    def generate_request(self, rng, sessions):
        r = pb.GenerateRequest()
        which = rng.random()
        if which < 0.45:
            r.text = self.pick_text(rng)
        elif which < 0.75:
            n = rng.choice([0, 1, 3, 20, 200, 255, 256, 300, 100000]) if rng.random() < 0.3 else rng.randint(1, 30)
            r.token_ids.ids.extend(self.pick_int(rng) if rng.random() < 0.1 else rng.randint(0, VOCAB - 1)
                                   for _ in range(n))
        elif which < 0.95:
            for _ in range(rng.choice([0, 1, 2, 3, 5, 300, 2000]) if rng.random() < 0.2 else rng.randint(1, 4)):
                r.messages.messages.add(role=rng.choice(["user", "assistant", "system", "", "tool", "USER"]),
                                        content=self.pick_text(rng))
        if rng.random() < 0.35:
            r.session_id = self.pick_id(rng, sessions)
        if rng.random() < 0.2:
            r.request_id = self.pick_id(rng, [])
        if rng.random() < 0.2:
            r.priority = self.pick_int(rng)
        r.parse_special = rng.random() < 0.2
        for field in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if rng.random() < 0.12:
                setattr(r, field, self.pick_float(rng))
        if rng.random() < 0.2:
            r.top_k = self.pick_int(rng)
        if rng.random() < 0.3:
            r.seed = rng.choice([0, 1, 2**64 - 1, rng.randint(0, 2**63)])
        r.max_tokens = self.pick_int(rng) if rng.random() < 0.1 else rng.randint(1, 24)
        if rng.random() < 0.15:
            r.stop.extend(self.pick_text(rng) for _ in range(rng.choice([1, 2, 5, 100, 10000])))
        if rng.random() < 0.1:
            r.stop_token_ids.extend(self.pick_int(rng) for _ in range(rng.choice([1, 5, 1000])))
        r.ignore_eos = rng.random() < 0.3
        r.include_stop_str_in_output = rng.random() < 0.2
        if rng.random() < 0.2:
            r.logprobs = rng.choice([0, 1, 5, 20, 21, -1, 2**31 - 1])
        r.prompt_logprobs = rng.random() < 0.1
        if rng.random() < 0.25:
            self.fill_overflow(rng, r.overflow)
        return r

    def fill_overflow(self, rng, o):
        o.policy = rng.choice([0, 1, 2, 2, 2, 3, -1, 2**31 - 1])  # unknown values too
        o.keep_tokens = self.pick_int(rng) if rng.random() < 0.3 else rng.randint(0, 40)

    def one_request(self, rng, stub, raw_complete, raw_tokenize, sessions):
        """Sends one generated request; returns (rpc, status code, details)."""
        kinds = ["generate", "complete", "cancel_mid_stream", "raw_bad_utf8", "create", "fork", "truncate", "close",
                 "get", "list", "tokenize", "detokenize", "cancel", "info", "stats", "update"]
        kind = rng.choices(kinds, weights=[14, 14, 8, 4, 8, 6, 6, 5, 4, 2, 6, 5, 4, 2, 2, 4])[0]
        timeout = 60
        try:
            if kind == "generate":
                collect(stub.Generate(self.generate_request(rng, sessions), timeout=timeout))
            elif kind == "complete":
                stub.Complete(self.generate_request(rng, sessions), timeout=timeout)
            elif kind == "cancel_mid_stream":
                req = self.generate_request(rng, sessions)
                req.max_tokens = 200
                req.ignore_eos = True
                call = stub.Generate(req, timeout=timeout)
                for k, _ in enumerate(call):
                    if k >= rng.randint(0, 3):
                        break
                call.cancel()
                return kind, grpc.StatusCode.OK, ""
            elif kind == "raw_bad_utf8":
                bad = rng.choice(BAD_UTF8) * rng.randint(1, 3)
                if rng.random() < 0.5:
                    raw_complete(raw_field(1, bad), timeout=timeout)
                else:
                    raw_tokenize(raw_field(1, bad), timeout=timeout)
            elif kind == "create":
                req = pb.CreateSessionRequest(ttl_seconds=rng.choice([0, 0, 0.01, 1, 1e9, -1, math.nan, math.inf]),
                                              priority=self.pick_int(rng) if rng.random() < 0.2 else 0)
                if rng.random() < 0.8:
                    req.session_id = "fz-%d" % rng.randint(0, 50) if rng.random() < 0.8 else rng.choice(IDS)
                if rng.random() < 0.3:
                    self.fill_overflow(rng, req.overflow)
                if rng.random() < 0.3:
                    req.initial_token_ids.extend(rng.randint(0, VOCAB - 1) if rng.random() < 0.95 else
                                                 self.pick_int(rng) for _ in range(rng.choice([1, 10, 100, 300])))
                out = stub.CreateSession(req, timeout=timeout)
                sessions.append(out.session_id)
            elif kind == "fork":
                req = pb.ForkSessionRequest(session_id=self.pick_id(rng, sessions))
                if rng.random() < 0.7:
                    req.child_session_id = "fz-%d" % rng.randint(0, 50)
                out = stub.ForkSession(req, timeout=timeout)
                sessions.append(out.session_id)
            elif kind == "truncate":
                stub.TruncateSession(pb.TruncateSessionRequest(session_id=self.pick_id(rng, sessions),
                                                               num_tokens=self.pick_int(rng)), timeout=timeout)
            elif kind == "close":
                sid = self.pick_id(rng, sessions)
                stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=timeout)
                if sid in sessions:
                    sessions.remove(sid)
            elif kind == "get":
                stub.GetSession(pb.GetSessionRequest(session_id=self.pick_id(rng, sessions),
                                                     include_token_ids=rng.random() < 0.5), timeout=timeout)
            elif kind == "list":
                stub.ListSessions(pb.ListSessionsRequest(), timeout=timeout)
            elif kind == "tokenize":
                stub.Tokenize(pb.TokenizeRequest(text=self.pick_text(rng), parse_special=rng.random() < 0.5,
                                                 add_special=rng.random() < 0.5), timeout=timeout)
            elif kind == "detokenize":
                n = rng.choice([0, 1, 10, 1000, 100000])
                stub.Detokenize(pb.DetokenizeRequest(token_ids=[self.pick_int(rng) for _ in range(n)]),
                                timeout=timeout)
            elif kind == "cancel":
                stub.Cancel(pb.CancelRequest(request_id=self.pick_id(rng, [])), timeout=timeout)
            elif kind == "info":
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)
            elif kind == "update":
                req = pb.UpdateSessionRequest(session_id=self.pick_id(rng, sessions))
                self.fill_overflow(rng, req.overflow)
                stub.UpdateSession(req, timeout=timeout)
            elif kind == "stats":
                stub.GetStats(pb.GetStatsRequest(top_sessions=self.pick_int(rng)), timeout=timeout)
        except grpc.RpcError as e:
            return kind, e.code(), e.details()
        return kind, grpc.StatusCode.OK, ""


if __name__ == "__main__":
    import harness
    harness.main()
