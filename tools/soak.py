#!/usr/bin/env python3
"""A bounded soak (issue 14; not run in CI): one qkvserve under a steady mixed load for --minutes, sampled
every --every seconds: RSS, sessions, running/waiting requests, engine step time and command-queue wait
(p50/p99 from the /metrics histograms over each interval), plotted with matplotlib to --plot and printed.

The load, at --rate operations per second from --clients threads: multi-turn chat sessions (some with a
TTL short enough to expire during the run), forks and truncations, one-off generations of which some are
cancelled mid-stream, large prompts (near the context), and session closes. Errors other than the
expected client errors (RESOURCE_EXHAUSTED, NOT_FOUND for expired sessions, ...) are counted and printed.

Usage: /usr/bin/python3 tools/soak.py --minutes 30 [--model M] [--bin build/bin] [--plot docs/img/soak.png]
(needs python3-matplotlib from apt)
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))

EXPECTED = {"RESOURCE_EXHAUSTED", "NOT_FOUND", "CANCELLED", "FAILED_PRECONDITION", "ALREADY_EXISTS",
            "DEADLINE_EXCEEDED", "INVALID_ARGUMENT"}


def buckets(m, name):
    """[(upper bound, cumulative count)] of a histogram, +Inf last."""
    out = []
    for k, v in m.items():
        if k.startswith(name + "_bucket{le="):
            le = k.split('le="')[1].split('"')[0]
            out.append((float("inf") if le == "+Inf" else float(le), v))
    return sorted(out)


def quantile(prev, cur, q):
    """The q-quantile (upper bucket bound) of the observations between two scrapes."""
    diff = [(b, c - p) for (b, c), (_, p) in zip(cur, prev)] if prev else cur
    total = diff[-1][1] if diff else 0
    if total <= 0:
        return float("nan")
    for b, c in diff:
        if c >= q * total:
            return b
    return diff[-1][0]


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def plot(samples, path, title):
    """RSS, sessions and requests, step time and command wait over time, to a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = [s["t"] / 60 for s in samples]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    ax[0][0].plot(t, [s["rss_mib"] for s in samples])
    ax[0][0].set_ylabel("RSS (MiB)")
    ax[0][1].plot(t, [s["sessions"] for s in samples], label="sessions")
    ax[0][1].plot(t, [s["running"] for s in samples], label="running")
    ax[0][1].plot(t, [s["waiting"] for s in samples], label="waiting")
    ax[0][1].legend()
    ax[1][0].plot(t, [s["step_p50_ms"] for s in samples], label="p50")
    ax[1][0].plot(t, [s["step_p99_ms"] for s in samples], label="p99")
    ax[1][0].set_ylabel("engine step (ms, bucket bound)")
    ax[1][0].legend()
    ax[1][1].plot(t, [s["cmd_p50_ms"] for s in samples], label="p50")
    ax[1][1].plot(t, [s["cmd_p99_ms"] for s in samples], label="p99")
    ax[1][1].set_ylabel("command wait (ms, bucket bound)")
    ax[1][1].legend()
    for a in ax[1]:
        a.set_xlabel("minutes")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=80)
    print("soak: plot written to", path, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--every", type=float, default=10)
    ap.add_argument("--rate", type=float, default=20, help="operations per second, all clients together")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--model", default="", help="GGUF (default: the bundled model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-bytes", default="256MiB")
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "soak.png"))
    ap.add_argument("--json", default="", help="write the samples here too")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replot", default="", help="only plot the samples of an earlier --json")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.plot, f"qkvserve soak: {args.minutes:g} min, {args.rate:g} ops/s, {args.clients} clients")
        return 0
    os.environ["QKV_BIN"] = args.bin
    import grpc  # noqa: E402
    from harness import pb, rpc, scrape_metrics as scrape  # noqa: E402

    tmp = tempfile.mkdtemp(prefix="qkvsoak")
    ready = os.path.join(tmp, "ready")
    cmd = [os.path.join(args.bin, "qkvserve"), "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
           "--http-listen", "127.0.0.1:0", "--ready-file", ready, "--threads", str(args.threads),
           "--kv-cache-bytes", args.kv_cache_bytes]
    if args.model:
        cmd += ["--model", args.model]
    log = open(os.path.join(tmp, "server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    while not os.path.exists(ready):
        if proc.poll() is not None:
            sys.exit("qkvserve exited; see " + log.name)
        time.sleep(0.1)
    time.sleep(0.2)
    with open(ready) as f:
        info = json.load(f)
    addr, maddr = info["grpc"], info["metrics"]
    stub0 = rpc.InferenceStub(grpc.insecure_channel(addr))
    ctx = stub0.GetModelInfo(pb.GetModelInfoRequest()).context_length
    words = "In the beginning God created the heaven and the earth and the earth was without form".split()

    stop = time.time() + args.minutes * 60
    lock = threading.Lock()
    counts, unexpected = {}, []
    period = args.clients / args.rate

    def note(op, code):
        with lock:
            counts[(op, code)] = counts.get((op, code), 0) + 1
            if code != "OK" and code not in EXPECTED:
                unexpected.append((op, code))

    def client(cid):
        r = random.Random(args.seed * 1000 + cid)
        stub = rpc.InferenceStub(grpc.insecure_channel(addr))
        mine = []
        nxt = time.time()
        while time.time() < stop:
            nxt += period * r.uniform(0.5, 1.5)
            time.sleep(max(0.0, nxt - time.time()))
            op = r.choices(["turn", "new_session", "fork", "truncate", "oneoff", "cancel", "large", "close"],
                           weights=[30, 8, 5, 4, 20, 10, 3, 6])[0]
            sid = None
            try:
                text = " ".join(r.choice(words) for _ in range(r.randint(3, 20)))
                if op == "new_session" or (op in ("turn", "fork", "truncate", "close") and not mine):
                    ttl = r.choice([0, 0, 5, 60])  # some expire during the run
                    mine.append(stub.CreateSession(pb.CreateSessionRequest(ttl_seconds=ttl)).session_id)
                    op = "new_session"
                elif op == "turn":
                    sid = r.choice(mine)
                    resp = stub.Complete(pb.GenerateRequest(session_id=sid, text=" " + text,
                                                            max_tokens=r.randint(8, 48)), timeout=120)
                    if resp.usage.prompt_tokens > ctx - 128:  # keep the conversation inside the context
                        stub.TruncateSession(pb.TruncateSessionRequest(session_id=sid, num_tokens=ctx // 4))
                elif op == "fork":
                    sid = r.choice(mine)
                    mine.append(stub.ForkSession(pb.ForkSessionRequest(session_id=sid)).session_id)
                elif op == "truncate":
                    sid = r.choice(mine)
                    stub.TruncateSession(pb.TruncateSessionRequest(session_id=sid, num_tokens=r.randint(0, 64)))
                elif op == "oneoff":
                    stub.Complete(pb.GenerateRequest(text=text, max_tokens=r.randint(8, 64)), timeout=120)
                elif op == "cancel":
                    call = stub.Generate(pb.GenerateRequest(text=text, max_tokens=200, ignore_eos=True))
                    for k, _ in enumerate(call):
                        if k >= r.randint(1, 8):
                            break
                    call.cancel()
                elif op == "large":
                    n = max(16, ctx - 80)
                    stub.Complete(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[(i * 13 + cid) % 200 + 10
                                                                                 for i in range(n)]),
                                                     max_tokens=16), timeout=120)
                elif op == "close":
                    sid = mine.pop(r.randrange(len(mine)))
                    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
                note(op, "OK")
            except grpc.RpcError as e:
                note(op, e.code().name)
                if e.code() == grpc.StatusCode.NOT_FOUND and sid in mine:
                    mine.remove(sid)  # it expired (TTL)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.clients)]
    t0 = time.time()
    for t in threads:
        t.start()
    samples = []
    prev = None
    print(f"soak: {args.minutes} min, {args.rate} ops/s from {args.clients} clients, server pid {proc.pid}",
          flush=True)
    print(f"{'t_s':>6} {'rss_MiB':>8} {'sessions':>8} {'running':>7} {'waiting':>7} {'step_p50_ms':>11} "
          f"{'step_p99_ms':>11} {'cmd_p50_ms':>10} {'cmd_p99_ms':>10} {'ops':>6}", flush=True)
    while time.time() < stop + 1:
        time.sleep(args.every)
        if proc.poll() is not None:
            print("soak: the server exited!", flush=True)
            break
        m = scrape(maddr)
        step, cmdw = buckets(m, "qkvserve_step_duration_seconds"), buckets(m, "qkvserve_command_wait_seconds")
        s = {
            "t": time.time() - t0, "rss_mib": rss_mib(proc.pid),
            "sessions": m['qkvserve_sessions{state="resident"}'] + m['qkvserve_sessions{state="evicted"}'],
            "running": m['qkvserve_requests{state="running"}'], "waiting": m['qkvserve_requests{state="waiting"}'],
            "step_p50_ms": 1e3 * quantile(prev and prev[0], step, 0.5),
            "step_p99_ms": 1e3 * quantile(prev and prev[0], step, 0.99),
            "cmd_p50_ms": 1e3 * quantile(prev and prev[1], cmdw, 0.5),
            "cmd_p99_ms": 1e3 * quantile(prev and prev[1], cmdw, 0.99),
            "ops": sum(counts.values()),
        }
        prev = (step, cmdw)
        samples.append(s)
        print(f"{s['t']:6.0f} {s['rss_mib']:8.1f} {s['sessions']:8.0f} {s['running']:7.0f} {s['waiting']:7.0f} "
              f"{s['step_p50_ms']:11.2f} {s['step_p99_ms']:11.2f} {s['cmd_p50_ms']:10.2f} {s['cmd_p99_ms']:10.2f} "
              f"{s['ops']:6d}", flush=True)
    for t in threads:
        t.join(180)
    alive = proc.poll() is None
    proc.terminate()
    proc.wait(60)
    summary = {}
    for (op, code), n in sorted(counts.items()):
        summary.setdefault(op, {})[code] = n
    print("soak: answers:", json.dumps(summary), flush=True)
    print(f"soak: unexpected answers: {len(unexpected)} {unexpected[:5]}; server alive at the end: {alive}",
          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(samples, f)
    if samples:
        plot(samples, args.plot, f"qkvserve soak: {args.minutes:g} min, {args.rate:g} ops/s, {args.clients} clients")
    return 0 if alive and not unexpected else 1


if __name__ == "__main__":
    rc = main()
    if "harness" in sys.modules:
        sys.modules["harness"].remove_tmp(rc == 0)
    sys.exit(rc)
