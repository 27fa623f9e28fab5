#!/usr/bin/env bash
# Builds the qkvserve image (deploy/Dockerfile) as qkvserve:latest. Starts dockerd when none runs (host
# networking, overlay2), and where no image registry is reachable makes the Debian base image offline:
# debootstrap from the machine's own apt mirror, then `docker import`.
# Exit codes: 0 built; 3 no Docker engine can run here (the reason is printed); other: failure.
set -euo pipefail
cd "$(dirname "$0")/.."
log=${QKV_DOCKER_LOG:-/tmp/qkv-dockerd.log}
if ! docker info >/dev/null 2>&1; then
  if ! command -v dockerd >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io >/dev/null 2>&1 || {
      echo "docker-build: cannot install docker.io"; exit 3; }
  fi
  # Without TMPDIR: tools/test.sh points it into its own directory, which a daemon must not keep files in.
  env -u TMPDIR nohup dockerd --iptables=false --bridge=none --storage-driver=overlay2 >"$log" 2>&1 &
  echo $! > /tmp/qkv-dockerd.pid
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  if ! docker info >/dev/null 2>&1; then
    echo "docker-build: dockerd does not start here: $(tail -n 3 "$log" | tr '\n' ' ')"
    exit 3
  fi
fi
base=debian:bookworm-slim
if ! docker image inspect "$base" >/dev/null 2>&1 && ! timeout 60 docker pull "$base" >/dev/null 2>&1; then
  base=qkv-base:bookworm
  if ! docker image inspect "$base" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
    # The mirror apt already uses for bookworm/main (no host is named here).
    mirror=$(apt-cache policy | awk '$3 == "bookworm/main" && $2 ~ /:\/\// {print $2; exit}')
    [ -n "$mirror" ] || { echo "docker-build: no apt mirror configured"; exit 1; }
    root=$(mktemp -d)
    echo "docker-build: making $base offline (debootstrap from the configured mirror)"
    debootstrap --variant=minbase bookworm "$root" "$mirror" >/dev/null
    tar -C "$root" -c . | docker import - "$base" >/dev/null
    rm -rf "$root"
  fi
fi
docker build --network host --build-arg BASE="$base" -f deploy/Dockerfile -t qkvserve:latest .
docker image ls qkvserve:latest --format 'qkvserve:latest {{.Size}}'
