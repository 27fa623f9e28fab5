#!/usr/bin/env python3
"""One request never hurts another (issue 13): regression tests through a real server, one per observation
fixed so far."""
import threading
import unittest

import grpc

from harness import Server, collect, greedy, pb


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
            self.assertIn("max_tokens", cm.exception.details())
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


if __name__ == "__main__":
    unittest.main()
