#!/usr/bin/env bash
# Installs every Debian package qkvserve needs to build, test and run. Idempotent.
set -euo pipefail
PKGS=(
  build-essential cmake pkg-config git ca-certificates clang-format
  clang-14 libclang-rt-14-dev libomp-14-dev
  libdnnl-dev ocl-icd-opencl-dev opencl-c-headers
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libfmt-dev libgtest-dev libgmock-dev libbenchmark-dev
  prometheus-cpp-dev libcivetweb-dev libssl-dev libcli11-dev nlohmann-json3-dev libpcre2-dev
  python3 python3-numpy python3-torch python3-grpcio python3-protobuf python3-regex libopenblas0-openmp curl
  bible-kjv prometheus nginx python3-yaml docker-compose openssl qemu-user
)
# Node.js runs the foreign-client test. Machines of this kind ship it (with npm) from NodeSource; Debian's
# own nodejs/npm are only installed where there is none, since Debian's npm conflicts with NodeSource's.
command -v node >/dev/null || PKGS+=(nodejs)
command -v npm >/dev/null || PKGS+=(npm)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PKGS[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
