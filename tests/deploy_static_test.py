#!/usr/bin/env python3
"""Static checks of deploy/: the Kubernetes manifests parse and carry the required fields, compose names
the services, the nginx config passes `nginx -t` (replica host names replaced by loopback addresses), and
`docker-compose config` validates the compose file where docker-compose is installed."""
import os
import shutil
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D = os.path.join(ROOT, "deploy")
fails = []
passed = [0]


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        fails.append(what)
    else:
        passed[0] += 1


def load(name):
    with open(os.path.join(D, "k8s", name)) as f:
        return yaml.safe_load(f)


dep = load("deployment.yaml")
c = dep["spec"]["template"]["spec"]["containers"][0]
check(dep["kind"] == "Deployment", "deployment kind")
check(c["readinessProbe"]["grpc"]["service"] == "qkvserve.v1.Inference", "readiness probes the Inference service")
check(c["startupProbe"]["grpc"]["service"] == "qkvserve.v1.Inference", "startup probes the Inference service")
check(c["livenessProbe"]["grpc"]["service"] == "", "liveness probes service \"\"")
check("memory" in c["resources"]["requests"] and "cpu" in c["resources"]["requests"], "resource requests")
check(dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 60, "grace period exceeds the drain grace")
check(load("service.yaml")["kind"] == "Service", "service")
check(load("pdb.yaml")["spec"]["minAvailable"] >= 1, "pod disruption budget")
ing = load("ingress.yaml")
check(ing["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_x_session_id", "ingress hashes on x-session-id")
check("kv-cache-bytes" in load("configmap.yaml")["data"]["qkvserve.ini"], "configmap")
# Secure by default: API keys from a Secret, /metrics only for Prometheus.
check("--api-keys" in c["args"], "the deployment requires API keys")
vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
check(vols.get("api-keys", {}).get("secret", {}).get("secretName") == "qkvserve-api-keys", "API keys from a Secret")
svc_ports = {p["name"] for p in load("service.yaml")["spec"]["ports"]}
check(svc_ports == {"grpc"}, "the Service does not expose /metrics")
np = load("networkpolicy.yaml")
rules = np["spec"]["ingress"]
metrics_rules = [r for r in rules if any(p["port"] == 9464 for p in r.get("ports", []))]
check(metrics_rules and all(r.get("from") for r in metrics_rules), "only selected peers reach port 9464")
with open(os.path.join(D, "compose.yaml")) as f:
    comp = yaml.safe_load(f)
check({"qkvserve-0", "qkvserve-1", "nginx", "prometheus", "grafana"} <= set(comp["services"]), "compose services")
for name in ("qkvserve-0", "qkvserve-1"):
    svc = comp["services"][name]
    check("--api-keys" in svc["command"] and "api_keys" in svc.get("secrets", []), f"{name} takes API keys from a secret")
    check("ports" not in svc, f"{name} publishes no port on the host (metrics stay on the compose network)")
nginx = shutil.which("nginx") or "/usr/sbin/nginx"
if os.path.exists(nginx):
    tmp = tempfile.mkdtemp()
    with open(os.path.join(D, "nginx", "nginx.conf")) as f:
        conf = f.read()
    for host, addr in [("qkvserve-0:50051", "127.0.0.1:50051"), ("qkvserve-1:50051", "127.0.0.1:50052"),
                       ("qkvserve-0:8000", "127.0.0.1:8001"), ("qkvserve-1:8000", "127.0.0.1:8002")]:
        conf = conf.replace(host, addr)
    conf = conf.replace("worker_processes 1;", f"worker_processes 1;\npid {tmp}/nginx.pid;\nerror_log {tmp}/error.log;")
    with open(os.path.join(tmp, "nginx.conf"), "w") as f:
        f.write(conf)
    r = subprocess.run([nginx, "-t", "-c", os.path.join(tmp, "nginx.conf"), "-p", tmp], capture_output=True, text=True)
    shutil.rmtree(tmp, ignore_errors=True)
    check(r.returncode == 0, "nginx -t" + (": " + r.stderr.strip() if r.returncode else ""))
else:
    check(False, "nginx is installed")
if shutil.which("docker-compose"):
    r = subprocess.run(["docker-compose", "-f", os.path.join(D, "compose.yaml"), "config", "-q"], capture_output=True, text=True)
    check(r.returncode == 0, "docker-compose config " + r.stderr.strip())
else:
    print("SKIP docker-compose config: docker-compose is not installed")
print(f"deploy_static: {passed[0]} passed, {len(fails)} failed")
sys.exit(1 if fails else 0)
