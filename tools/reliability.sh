#!/usr/bin/env bash
# The reliability stages (docs/reliability.md), each in its own build directory with clang-14:
#   asan  ASan + UBSan build (with libFuzzer coverage): the unit tests and the integration tests
#   fuzz  every libFuzzer target over its seed corpus for QKV_FUZZ_SECONDS (default 25) each
#   tsan  TSan build of the engine and the server: the engine's unit tests and the concurrent
#         integration tests (OMP_NUM_THREADS=1: Debian's libgomp is not instrumented)
# Any sanitizer report, in a test or in any qkvserve a test started, fails the stage: reports go to files
# (log_path) and the stage fails when one exists. Prints each stage's time. integration_metrics is not
# run under ASan (its malloc replaces glibc's, so the heap figures the test checks do not exist there), and
# the storm's RSS check is skipped in sanitizer builds (QKV_SANITIZED).
# Usage: bash tools/reliability.sh [asan] [fuzz] [tsan]   (default: all three, in that order)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(asan fuzz tsan)
export CC=clang-14 CXX=clang++-14
export OMP_WAIT_POLICY=PASSIVE
jobs=$(nproc)
reports=$(mktemp -d /tmp/qkv-sanitizer-reports.XXXXXX)
times=()

stage() { printf '\n== reliability: %s (%s)\n' "$1" "$(date +%T)"; }
check_reports() {  # $1: stage name; fails if any sanitizer wrote a report
  local found
  found=$(find "$reports" -type f -size +0 | head -n 20)
  if [ -n "$found" ]; then
    echo "reliability: $1: sanitizer reports:"
    for f in $found; do
      echo "--- $f"
      head -n 60 "$f"
    done
    return 1
  fi
  echo "reliability: $1: no sanitizer reports"
}

asan_env() {
  export ASAN_OPTIONS="log_path=$reports/asan:abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1"
  export UBSAN_OPTIONS="log_path=$reports/ubsan:print_stacktrace=1:halt_on_error=1"
  export LSAN_OPTIONS="suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0"
}

run_asan() {
  stage "asan+ubsan build"
  local t0=$(date +%s)
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Release -DQKV_SANITIZE=address,undefined -DQKV_FUZZ=ON >/dev/null
  cmake --build build-asan -j"$jobs" --target qkvserve qkv-model qkv-run qkvctl gguf_test linear_test model_test \
    sampler_test tokenizer_test text_stream_test engine_test plan_test scheduler_test fuzz_gguf fuzz_tokenizer \
    fuzz_chat_template fuzz_request
  local t1=$(date +%s)
  stage "asan+ubsan tests"
  asan_env
  local rc=0
  # Unit tests, then the integration tests that drive a real qkvserve (built with the sanitizers) hardest.
  (cd build-asan && ctest --output-on-failure -j2 -L unit) || rc=1
  (cd build-asan && QKV_API_FUZZ_N=${QKV_API_FUZZ_N_ASAN:-1000} QKV_STORM_STREAMS=${QKV_STORM_STREAMS_ASAN:-240} \
    QKV_SANITIZED=1 ctest --output-on-failure -R "^integration_(server|hardening|api_fuzz|storm)$") || rc=1
  check_reports asan || rc=1
  local t2=$(date +%s)
  times+=("asan build $((t1 - t0))s" "asan tests $((t2 - t1))s")
  return $rc
}

run_fuzz() {
  stage "libFuzzer targets"
  local t0=$(date +%s)
  [ -x build-asan/bin/fuzz_gguf ] || {
    cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Release -DQKV_SANITIZE=address,undefined -DQKV_FUZZ=ON >/dev/null
    cmake --build build-asan -j"$jobs" --target fuzz_gguf fuzz_tokenizer fuzz_chat_template fuzz_request
  }
  asan_env
  export ASAN_OPTIONS="${ASAN_OPTIONS/log_path=$reports\/asan:/}"  # libFuzzer prints its reports itself
  local secs=${QKV_FUZZ_SECONDS:-25} rc=0
  for t in fuzz_gguf fuzz_tokenizer fuzz_chat_template fuzz_request; do
    local work=build-asan/fuzz/$t
    mkdir -p "$work/corpus" "$work/artifacts"
    # New inputs go to the work corpus; the checked-in seeds (and past crashes kept there) run first.
    if build-asan/bin/$t -max_total_time="$secs" -rss_limit_mb=4096 -max_len=65536 -timeout=20 \
        -artifact_prefix="$work/artifacts/" -print_final_stats=1 "$work/corpus" "tests/fuzz/corpus/$t" \
        >"$work/log" 2>&1; then
      echo "fuzz: $t: $(grep -E '^#[0-9]+.*DONE' "$work/log" | tail -n 1)"
    else
      echo "fuzz: $t FAILED; artifacts in $work/artifacts:"
      ls "$work/artifacts"
      grep -E "ERROR|SUMMARY|fuzz_" "$work/log" | head -n 20
      rc=1
    fi
  done
  times+=("fuzz $(($(date +%s) - t0))s")
  return $rc
}

run_tsan() {
  stage "tsan build"
  local t0=$(date +%s)
  cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Release -DQKV_SANITIZE=thread >/dev/null
  cmake --build build-tsan -j"$jobs" --target qkvserve qkv-model qkvctl engine_test scheduler_test
  local t1=$(date +%s)
  stage "tsan tests"
  export TSAN_OPTIONS="log_path=$reports/tsan:halt_on_error=1:second_deadlock_stack=1:suppressions=$root/tests/sanitizers/tsan.supp"
  # LLVM's libomp is not instrumented either: one OpenMP thread, no helper threads.
  export OMP_NUM_THREADS=1 OMP_THREAD_LIMIT=1 LIBOMP_USE_HIDDEN_HELPER_TASK=0
  local rc=0
  (cd build-tsan && ctest --output-on-failure -j2 -R "^(EngineTest|Scheduler|StateStore|CacheStores)\.") || rc=1
  (cd build-tsan && QKV_API_FUZZ_N=${QKV_API_FUZZ_N_TSAN:-300} QKV_STORM_STREAMS=${QKV_STORM_STREAMS_TSAN:-120} \
    QKV_SANITIZED=1 ctest --output-on-failure -R "^integration_(server|storm|api_fuzz)$") || rc=1
  check_reports tsan || rc=1
  unset OMP_NUM_THREADS OMP_THREAD_LIMIT LIBOMP_USE_HIDDEN_HELPER_TASK TSAN_OPTIONS
  local t2=$(date +%s)
  times+=("tsan build $((t1 - t0))s" "tsan tests $((t2 - t1))s")
  return $rc
}

rc=0
for s in "${stages[@]}"; do
  case $s in
    asan) run_asan || rc=1 ;;
    fuzz) run_fuzz || rc=1 ;;
    tsan) run_tsan || rc=1 ;;
    *) echo "reliability: unknown stage '$s' (asan, fuzz, tsan)"; exit 2 ;;
  esac
done
printf '\nreliability stage times: %s\n' "$(IFS=,; echo "${times[*]}")"
if [ $rc -eq 0 ]; then
  rm -rf "$reports"
  echo "reliability: all stages passed"
else
  echo "reliability: FAILED (sanitizer reports, if any, in $reports)"
fi
exit $rc
