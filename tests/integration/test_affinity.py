#!/usr/bin/env python3
"""Session affinity without containers: two qkvserve replicas and nginx on 127.0.0.1, using the shipped
nginx config (deploy/nginx/nginx.conf) with the replica addresses filled in. 20 sessions x 3 turns plus a
fork of each, all through nginx with the x-session-id header: every call reaches the replica that owns the
session (checked by instance_id), later turns report cached_tokens > 0, and sessions spread over both."""
import os
import shutil
import socket
import subprocess
import tempfile
import time
import unittest

import grpc

from harness import ROOT, TMP, Server, greedy, pb, rpc

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def nginx_conf(backends, port, prefix, http_backends=("127.0.0.1:1", "127.0.0.1:2"), http_port=None):
    with open(os.path.join(ROOT, "deploy", "nginx", "nginx.conf")) as f:
        conf = f.read()
    conf = conf.replace("server qkvserve-0:50051;", f"server {backends[0]};").replace("server qkvserve-1:50051;", f"server {backends[1]};")
    conf = conf.replace("listen 8080 http2;", f"listen 127.0.0.1:{port} http2;")
    conf = conf.replace("server qkvserve-0:8000;", f"server {http_backends[0]};")
    conf = conf.replace("server qkvserve-1:8000;", f"server {http_backends[1]};")
    conf = conf.replace("listen 8000;", f"listen 127.0.0.1:{http_port or free_port()};")
    conf = conf.replace("worker_processes 1;", f"worker_processes 1;\npid {prefix}/nginx.pid;\nerror_log {prefix}/error.log;\ndaemon off;")
    conf = conf.replace("http {", f"http {{\n  access_log off;\n  client_body_temp_path {prefix};\n  proxy_temp_path {prefix};\n"
                        f"  fastcgi_temp_path {prefix};\n  uwsgi_temp_path {prefix};\n  scgi_temp_path {prefix};")
    path = os.path.join(prefix, "nginx.conf")
    with open(path, "w") as f:
        f.write(conf)
    return path


@unittest.skipIf(NGINX is None, "nginx is not installed (tools/install-deps.sh installs it)")
class AffinityTest(unittest.TestCase):
    def test_nginx_keeps_sessions_and_forks_on_their_replica(self):
        a, b = Server("--instance-id", "replica-a"), Server("--instance-id", "replica-b")
        prefix = tempfile.mkdtemp(dir=TMP)
        port = free_port()
        conf = nginx_conf([a.addr, b.addr], port, prefix)
        t = subprocess.run([NGINX, "-t", "-c", conf, "-p", prefix], capture_output=True, text=True)
        self.assertEqual(t.returncode, 0, t.stderr)
        ng = subprocess.Popen([NGINX, "-c", conf, "-p", prefix], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            ch = grpc.insecure_channel(f"127.0.0.1:{port}")
            grpc.channel_ready_future(ch).result(timeout=30)
            stub = rpc.InferenceStub(ch)
            owners = {}

            def owner(key):
                return stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("x-session-id", key)]).instance_id

            for i in range(20):
                sid = f"sess{i}"
                md = [("x-session-id", sid)]
                created = stub.CreateSession(pb.CreateSessionRequest(session_id=sid), metadata=md)
                self.assertEqual(created.affinity_key, sid)
                owners[sid] = owner(sid)
                for turn in range(3):
                    r = stub.Complete(greedy(text=f" turn {turn} of {sid}", session_id=sid, max_tokens=4), metadata=md)
                    if turn > 0:
                        self.assertGreater(r.usage.cached_tokens, 0)
                    self.assertEqual(owner(sid), owners[sid])
                fork = stub.ForkSession(pb.ForkSessionRequest(session_id=sid, child_session_id=sid + ".f"), metadata=md)
                fmd = [("x-session-id", fork.affinity_key)]
                r = stub.Complete(greedy(text=" fork turn", session_id=sid + ".f", max_tokens=3), metadata=fmd)
                self.assertGreater(r.usage.cached_tokens, 0)
                self.assertEqual(owner(fork.affinity_key), owners[sid])
                # The replica that does not own the session has never heard of it.
                other = b if owners[sid] == "replica-a" else a
                with self.assertRaises(grpc.RpcError) as cm:
                    other.stub.GetSession(pb.GetSessionRequest(session_id=sid))
                self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)
            self.assertEqual(set(owners.values()), {"replica-a", "replica-b"})
            ch.close()
        finally:
            ng.terminate()
            ng.wait(10)
            a.stop()
            b.stop()


    def test_http_sessions_through_nginx(self):
        """The same over the OpenAI-style HTTP API: nginx's HTTP upstream hashes x-session-id too."""
        import json
        import urllib.request
        a, b = Server("--instance-id", "replica-a"), Server("--instance-id", "replica-b")
        prefix = tempfile.mkdtemp(dir=TMP)
        port, hport = free_port(), free_port()
        conf = nginx_conf([a.addr, b.addr], port, prefix, [a.http_addr, b.http_addr], hport)
        ng = subprocess.Popen([NGINX, "-c", conf, "-p", prefix], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            def chat(sid, messages):
                req = urllib.request.Request(f"http://127.0.0.1:{hport}/v1/chat/completions",
                                             data=json.dumps({"messages": messages, "max_tokens": 4, "temperature": 0,
                                                              "ignore_eos": True}).encode(),
                                             headers={"Content-Type": "application/json", "x-session-id": sid})
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.headers["x-qkvserve-instance"], json.loads(r.read())
            deadline = time.time() + 30
            while True:  # nginx starts in the background
                try:
                    chat("warm", [{"role": "user", "content": "x"}])
                    break
                except OSError:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.2)
            owners = {}
            for i in range(20):
                sid = f"http{i}"
                msgs = [{"role": "user", "content": f"first turn of {sid}"}]
                for turn in range(3):
                    inst, j = chat(sid, msgs)
                    owners.setdefault(sid, inst)
                    self.assertEqual(inst, owners[sid])
                    if turn > 0:
                        self.assertGreater(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
                    msgs += [{"role": "assistant", "content": j["choices"][0]["message"]["content"]},
                             {"role": "user", "content": f"turn {turn + 1}"}]
                mine, other = (a, b) if owners[sid] == "replica-a" else (b, a)
                self.assertGreater(mine.stub.GetSession(pb.GetSessionRequest(session_id=sid)).num_tokens, 0)
                with self.assertRaises(grpc.RpcError) as cm:
                    other.stub.GetSession(pb.GetSessionRequest(session_id=sid))
                self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)
            self.assertEqual(set(owners.values()), {"replica-a", "replica-b"})
        finally:
            ng.terminate()
            ng.wait(10)
            a.stop()
            b.stop()


if __name__ == "__main__":
    import harness
    harness.main(verbosity=2)
