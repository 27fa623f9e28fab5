#!/usr/bin/env python3
"""Benchmark: the cost of a /metrics scrape, and generation throughput with and without a scrape every
100 ms. Runs qkvserve on the bundled model (or $QKVSERVE_MODEL) on 127.0.0.1.
Usage: /usr/bin/python3 tools/bench_scrape.py [--clients 32] [--tokens 200] [--rounds 3]"""
import argparse
import os
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))
from harness import Server, pb  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    s = Server("--threads", "2", model="")
    try:
        url = f"http://{s.metrics_addr}/metrics"
        t0 = time.perf_counter()
        n = 200
        size = 0
        for _ in range(n):
            size = len(urllib.request.urlopen(url).read())
        per = (time.perf_counter() - t0) / n
        print(f"scrape: {1e3 * per:.2f} ms per /metrics request ({size} bytes), {n} scrapes, idle server")

        def load():
            def one(i):
                list(s.stub.Generate(pb.GenerateRequest(text=f"And it came to pass {i}", max_tokens=a.tokens,
                                                        ignore_eos=True, temperature=0)))
            ts = [threading.Thread(target=one, args=(i,)) for i in range(a.clients)]
            t = time.perf_counter()
            for x in ts:
                x.start()
            for x in ts:
                x.join()
            return a.clients * a.tokens / (time.perf_counter() - t)

        for r in range(a.rounds):  # alternate, side by side
            base = load()
            stop = threading.Event()
            scrapes = [0]

            def scraper():
                while not stop.is_set():
                    urllib.request.urlopen(url).read()
                    scrapes[0] += 1
                    stop.wait(0.1)
            th = threading.Thread(target=scraper)
            th.start()
            scraped = load()
            stop.set()
            th.join()
            print(f"round {r}: {base:.0f} tok/s without scraping, {scraped:.0f} tok/s with a scrape every 100 ms "
                  f"({scrapes[0]} scrapes, {100 * (scraped - base) / base:+.1f}%)")
    finally:
        s.stop()


if __name__ == "__main__":
    import harness
    ok = False
    try:
        main()
        ok = True
    finally:
        harness.remove_tmp(ok)
