"""Shared helpers for the integration tests: a real qkvserve process on 127.0.0.1 and Python gRPC stubs
generated at test time with protoc and grpc_python_plugin (Debian's grpc-tools embed an old protoc)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("QKV_BIN", os.path.join(ROOT, "build", "bin"))
_STUBS = tempfile.mkdtemp(prefix="qkvstubs")
# The health proto is copied under another path: a generated "grpc.health" module would shadow grpcio.
os.makedirs(os.path.join(_STUBS, "src", "qkv_health"))
with open(os.path.join(ROOT, "proto", "grpc", "health", "v1", "health.proto")) as f_in, \
        open(os.path.join(_STUBS, "src", "qkv_health", "health.proto"), "w") as f_out:
    f_out.write(f_in.read())
subprocess.run(["protoc", "-I", os.path.join(ROOT, "proto"), "-I", os.path.join(_STUBS, "src"),
                "--python_out=" + _STUBS, "--grpc_python_out=" + _STUBS,
                "--plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin",
                os.path.join(ROOT, "proto", "qkvserve", "v1", "inference.proto"),
                os.path.join(_STUBS, "src", "qkv_health", "health.proto")], check=True)
sys.path.insert(0, _STUBS)
from qkvserve.v1 import inference_pb2 as pb  # noqa: E402
from qkvserve.v1 import inference_pb2_grpc as rpc  # noqa: E402
from qkv_health import health_pb2, health_pb2_grpc  # noqa: E402

TMP = tempfile.mkdtemp(prefix="qkvint")


def main(**kw):
    """unittest.main for a test script: TMP (models, server logs) and the generated stubs are removed when every
    test passed, kept and named on stderr when one did not (or when QKV_KEEP_TMP=1), so that runs do not pile
    up in /tmp (300 runs had left 1.5 GB there)."""
    ok = unittest.main(exit=False, **kw).result.wasSuccessful()
    remove_tmp(ok)
    sys.exit(0 if ok else 1)


def remove_tmp(ok=True):
    """Removes TMP and the stubs when ok (and QKV_KEEP_TMP is not set); otherwise names them on stderr. Every
    script that imports this module calls it (or main) before it exits."""
    if ok and not os.environ.get("QKV_KEEP_TMP"):
        shutil.rmtree(TMP, ignore_errors=True)
        shutil.rmtree(_STUBS, ignore_errors=True)
    else:
        print(f"kept the test's files in {TMP} (stubs: {_STUBS})", file=sys.stderr)


# Hugging Face DeepSeek-V2 names for a small MLA model (make_model(arch="deepseek2")): a latent of 32 and a
# rope key of 16 per token and layer, a low-rank query path.
MLA = {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16}
# and for a small mixture of experts (make_model(arch="qwen3moe")): 8 experts of 32, 2 per token.
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# and for a small hybrid (make_model(arch="qwen35", extra=HYBRID)): Gated DeltaNet in layer 0, attention in 1.
HYBRID = {"full_attention_interval": 2, "linear_conv_kernel_dim": 4, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "head_dim": 16}


def make_model(name="model", arch="llama", vocab=512, ctx=256, seed=3, chat_stop=(), extra=None):
    path = os.path.join(TMP, name + ".gguf")
    if not os.path.exists(path):
        cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 128, "vocab_size": vocab, "max_position_embeddings": ctx,
               **(MLA if arch == "deepseek2" else {}), **(MOE if arch == "qwen3moe" else {}), **(extra or {})}
        cpath = os.path.join(TMP, name + ".json")
        with open(cpath, "w") as f:
            json.dump(cfg, f)
        subprocess.run([os.path.join(BIN, "qkv-model"), "random", "--config", cpath, "--out", path, "--arch", arch,
                        "--seed", str(seed), *[a for st in chat_stop for a in ("--chat-stop", st)]], check=True,
                       stdout=subprocess.DEVNULL)
    return path


def self_signed_cert(name):
    """A key and a self-signed certificate for localhost/127.0.0.1 in TMP/name; returns (key, cert) paths."""
    d = os.path.join(TMP, name)
    os.makedirs(d, exist_ok=True)
    key, cert = os.path.join(d, "key.pem"), os.path.join(d, "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


def node_script(cache, packages, marker, script):
    """Copies tests/integration/SCRIPT into the npm directory CACHE, installing PACKAGES there first unless
    node_modules/MARKER exists; returns the copy's path. Fails the caller when node or npm is missing."""
    import shutil
    if not shutil.which("node") or not shutil.which("npm"):
        raise AssertionError(f"node and npm are needed for {script}")
    if not os.path.isdir(os.path.join(cache, "node_modules", marker)):
        os.makedirs(cache, exist_ok=True)
        subprocess.run(["npm", "init", "-y"], cwd=cache, check=True, capture_output=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", *packages], cwd=cache, check=True,
                       capture_output=True, timeout=600)
    path = os.path.join(cache, script)
    shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), script), path)
    return path


def scrape_metrics(addr):
    """{'name{labels}': value} of a /metrics scrape."""
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class Server:
    """A qkvserve process on 127.0.0.1 with free ports, ready when its ready file appears."""

    def __init__(self, *args, model=None, env=None):
        self.ready_path = tempfile.mktemp(prefix="ready", dir=TMP)
        self.log_path = self.ready_path + ".log"
        # model="" starts the server without --model (its default resolution).
        model_args = [] if model == "" else ["--model", model or make_model()]
        defaults = [] if "--threads" in args else ["--threads", "1"]
        defaults += [] if "--kv-cache-bytes" in args else ["--kv-cache-bytes", "8MiB"]
        defaults += [] if "--http-listen" in args else ["--http-listen", "127.0.0.1:0"]
        cmd = [os.path.join(BIN, "qkvserve"), *model_args, "--listen", "127.0.0.1:0",
               "--metrics-listen", "127.0.0.1:0", "--ready-file", self.ready_path, *defaults, *args]
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", **(env or {}))
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 60
        while not os.path.exists(self.ready_path):
            if self.proc.poll() is not None:
                with open(self.log_path) as f:
                    raise RuntimeError("qkvserve exited: " + f.read())
            if time.time() > deadline:
                raise RuntimeError("qkvserve not ready in 60 s")
            time.sleep(0.05)
        with open(self.ready_path) as f:
            info = json.load(f)
        self.addr, self.metrics_addr, self.http_addr = info["grpc"], info["metrics"], info.get("http")
        self.channel = grpc.insecure_channel(self.addr)
        self.stub = rpc.InferenceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def metrics(self):
        return scrape_metrics(self.metrics_addr)

    def accounting(self):
        """'' when /debug/accounting (--debug-accounting) reports no error, else its line."""
        text = urllib.request.urlopen(f"http://{self.metrics_addr}/debug/accounting", timeout=30).read().decode()
        for line in text.splitlines():
            if line.startswith("qkvserve_debug_accounting_errors"):
                return "" if line.endswith(" 0") else line
        return "no accounting line: " + text

    def used_blocks(self):
        return self.metrics()['qkvserve_kv_cache_blocks{state="used"}']

    def wait_used_blocks(self, n, timeout=30):
        return self.wait_metric('qkvserve_kv_cache_blocks{state="used"}', n, timeout)

    def wait_metric(self, name, value, timeout=30):
        """True once the scraped NAME equals VALUE, or VALUE(it) is true for a callable VALUE (the engine
        publishes its figures at the end of a step, at most every 50x the snapshot's cost and 1 s, so a reply can
        reach the client before the counters that count it reach /metrics)."""
        ok = value if callable(value) else (lambda v: v == value)
        deadline = time.time() + timeout
        while time.time() < deadline:
            v = self.metrics().get(name)
            if v is not None and ok(v):
                return True
            time.sleep(0.05)
        return False

    def stop(self, sig=signal.SIGTERM, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.channel.close()
        self.log.close()
        return self.proc.returncode


def greedy(**kw):
    kw.setdefault("temperature", 0.0)
    return pb.GenerateRequest(**kw)


def collect(stream):
    """(responses, text, token ids) of a Generate stream."""
    rs = list(stream)
    return rs, "".join(r.text for r in rs), [t for r in rs for t in r.token_ids]
