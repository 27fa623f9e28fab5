#!/usr/bin/env bash
# Installs dependencies, builds everything (Release, warnings as errors) and runs every test with ctest,
# then the reliability stages (tools/reliability.sh: ASan+UBSan, libFuzzer, TSan builds and their tests).
# Prints how long each stage took. Usage: bash tools/test.sh [extra ctest args]
# QKV_QUICK=1 skips the reliability stages (a quick local run; CI always runs them).
set -euo pipefail
cd "$(dirname "$0")/.."
stage() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }
t0=$(date +%s)
stage "dependencies"
bash tools/install-deps.sh
t1=$(date +%s)
stage "configure and build"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
t2=$(date +%s)
stage "tests"
# Idle OpenMP threads sleep instead of spinning, so concurrent test processes do not starve each other.
export OMP_WAIT_POLICY=PASSIVE
# The tests' temporary files (Python's tempfile, mktemp, the C++ tests' TempDir) go to a directory of this
# run. A test that leaves files there although every test passed fails the run; the directory is removed
# when everything passed and kept (its path printed) when not, for the servers' logs.
TMPDIR=$(mktemp -d /tmp/qkv-test.XXXXXX)
export TMPDIR
rc=0
(cd build && ctest --output-on-failure -j2 "$@") || rc=$?
left=$(find "$TMPDIR" -mindepth 1 -maxdepth 1 | head -n 20 || true)
if [ $rc -eq 0 ] && [ -n "$left" ]; then
  printf 'tests: every test passed but these were left in %s:\n%s\n' "$TMPDIR" "$left"
  rc=1
fi
t3=$(date +%s)
rrc=0
if [ -z "${QKV_QUICK:-}" ]; then
  stage "reliability (sanitizers, fuzzing)"
  bash tools/reliability.sh || rrc=$?
fi
t4=$(date +%s)
printf '\nstage times: dependencies %ss, build %ss, tests %ss, reliability %ss\n' $((t1 - t0)) $((t2 - t1)) \
  $((t3 - t2)) $((t4 - t3))
if [ $rc -eq 0 ] && [ $rrc -eq 0 ]; then
  rm -rf "$TMPDIR"
else
  echo "tests: temporary files kept in $TMPDIR"
  exit 1
fi
