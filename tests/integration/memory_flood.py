#!/usr/bin/env python3
"""Memory pressure (issue 14), run by tests/docker_test.sh against a qkvserve container started with the
memory limit of deploy/k8s: for QKV_FLOOD_SECONDS (default 40) clients flood it with sessions (long
initial histories), forks, oversized and large requests and concurrent generations. The flood must be met
with RESOURCE_EXHAUSTED (and other client errors), never by the process dying; the caller then checks that
the container was not OOM-killed and still serves.
Usage: memory_flood.py GRPC_ADDR"""
import os
import sys
import threading
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import pb, rpc  # noqa: E402

CLIENT_ERRORS = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED,
                 grpc.StatusCode.DEADLINE_EXCEEDED}


def main():
    addr = sys.argv[1]
    seconds = float(os.environ.get("QKV_FLOOD_SECONDS", "40"))
    stop = time.time() + seconds
    counts = {}
    bad = []
    lock = threading.Lock()
    opts = [("grpc.max_send_message_length", 128 << 20), ("grpc.max_receive_message_length", 128 << 20)]
    info = rpc.InferenceStub(grpc.insecure_channel(addr)).GetModelInfo(pb.GetModelInfoRequest())
    ctx, vocab = info.context_length, info.vocab_size

    def note(kind, code, details=""):
        with lock:
            counts[(kind, code.name)] = counts.get((kind, code.name), 0) + 1
            if code != grpc.StatusCode.OK and code not in CLIENT_ERRORS:
                bad.append(f"{kind}: {code.name} {details}")

    def loop(kind, fn):
        stub = rpc.InferenceStub(grpc.insecure_channel(addr, options=opts))
        i = 0
        while time.time() < stop:
            i += 1
            try:
                fn(stub, i)
                note(kind, grpc.StatusCode.OK)
            except grpc.RpcError as e:
                note(kind, e.code(), e.details())
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    time.sleep(0.2)

    history = [(i * 7 + 3) % vocab for i in range(ctx - 8)]
    mine = []

    def sessions(stub, i):
        s = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=history, ttl_seconds=600), timeout=30)
        with lock:
            mine.append(s.session_id)

    def forks(stub, i):
        with lock:
            parent = mine[i % len(mine)] if mine else None
        if parent is None:
            time.sleep(0.05)
            return
        s = stub.ForkSession(pb.ForkSessionRequest(session_id=parent), timeout=30)
        with lock:
            mine.append(s.session_id)

    def huge_ids(stub, i):  # far past any prompt limit: refused before it costs the server memory
        stub.Complete(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * (12 << 20))), timeout=60)

    def big_text(stub, i):  # just under --max-prompt-bytes: tokenized, then too long for the context
        stub.Complete(pb.GenerateRequest(text="In the beginning God " * ((4 << 20) // 22)), timeout=120)

    def generate(stub, i):
        with lock:
            sid = mine[(i * 31) % len(mine)] if mine and i % 2 else None
        req = pb.GenerateRequest(text=" and the earth", max_tokens=64, ignore_eos=True)
        if sid:
            req.session_id = sid
        for _ in stub.Generate(req, timeout=60):
            pass

    threads = []
    for kind, fn, n in (("sessions", sessions, 4), ("forks", forks, 4), ("huge_ids", huge_ids, 6),
                        ("big_text", big_text, 3), ("generate", generate, 6)):
        for _ in range(n):
            threads.append(threading.Thread(target=loop, args=(kind, fn)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 180)
    summary = {}
    for (kind, code), n in sorted(counts.items()):
        summary.setdefault(kind, {})[code] = n
    print("memory_flood: answers:", summary)
    exhausted = sum(n for (k, c), n in counts.items() if c == "RESOURCE_EXHAUSTED")
    if bad:
        print("memory_flood: FAIL: unexpected answers:", bad[:10])
        return 1
    if exhausted == 0:
        print("memory_flood: FAIL: the flood never met RESOURCE_EXHAUSTED")
        return 1
    print(f"memory_flood: {exhausted} RESOURCE_EXHAUSTED, {len(mine)} sessions made")
    return 0


if __name__ == "__main__":
    rc = main()
    import harness
    harness.remove_tmp(rc == 0)
    sys.exit(rc)
