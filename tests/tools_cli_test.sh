#!/usr/bin/env bash
# The command-line tools end to end: qkv-model random/info, qkv-run with and without the cache, and
# clear errors for bad input. Usage: tools_cli_test.sh BIN_DIR
set -euo pipefail
bin=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
cat > "$tmp/c.json" <<'JSON'
{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
 "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 128}
JSON
"$bin/qkv-model" random --config "$tmp/c.json" --out "$tmp/m.gguf" --arch qwen3 --dtype bf16 --seed 3 >/dev/null
info=$("$bin/qkv-model" info "$tmp/m.gguf")
grep -q "tokenizer:         gpt2/gpt-2" <<<"$info" || fail "info lacks the tokenizer"
grep -q "architecture:      qwen3" <<<"$info" || fail "info lacks the architecture"
grep -q "MQA" <<<"$info" || fail "info lacks the attention kind"
grep -q "kv bytes/token:    128 (bf16), 256 (f32)" <<<"$info" || fail "KV bytes per token: 2 layers x 2 x 1 kv head x 16 x 2 bytes = 128; got: $info"
# Cache and no-cache give the same greedy ids.
a=$("$bin/qkv-run" --model "$tmp/m.gguf" --prompt "The cat sat" -n 24 --temperature 0 --print-ids --threads 1 2>&1 >/dev/null | grep '^ids:')
b=$("$bin/qkv-run" --model "$tmp/m.gguf" --prompt "The cat sat" -n 24 --temperature 0 --print-ids --no-cache --threads 1 2>&1 >/dev/null | grep '^ids:')
[ -n "$a" ] && [ "$a" = "$b" ] || fail "cache ($a) and no-cache ($b) differ"
# Seeded sampling is reproducible.
s1=$("$bin/qkv-run" --model "$tmp/m.gguf" --tokens 1,2,3 -n 16 --temperature 1 --seed 9 --print-ids --threads 1 2>&1 >/dev/null | grep '^ids:')
s2=$("$bin/qkv-run" --model "$tmp/m.gguf" --tokens 1,2,3 -n 16 --temperature 1 --seed 9 --print-ids --threads 1 2>&1 >/dev/null | grep '^ids:')
[ "$s1" = "$s2" ] || fail "same seed, different tokens"
# Whatever team OpenMP gives (a thread limit, dynamic teams), every GEMM slice is computed: the same ids
# and the same logits bits as a full team of 2.
"$bin/qkv-model" random --config "$tmp/c.json" --out "$tmp/l.gguf" --arch llama --dtype bf16 --seed 5 >/dev/null
t0=$("$bin/qkv-run" --model "$tmp/l.gguf" --prompt "The cat sat" -n 16 --temperature 0 --print-ids --threads 2 --logits "$tmp/t0.bin" 2>&1 >/dev/null | grep '^ids:')
t1=$(OMP_THREAD_LIMIT=1 "$bin/qkv-run" --model "$tmp/l.gguf" --prompt "The cat sat" -n 16 --temperature 0 --print-ids --threads 2 --logits "$tmp/t1.bin" 2>&1 >/dev/null | grep '^ids:')
t2=$(OMP_DYNAMIC=true "$bin/qkv-run" --model "$tmp/l.gguf" --prompt "The cat sat" -n 16 --temperature 0 --print-ids --threads 2 --logits "$tmp/t2.bin" 2>&1 >/dev/null | grep '^ids:')
[ -n "$t0" ] && [ "$t0" = "$t1" ] && [ "$t0" = "$t2" ] || fail "OpenMP team size changed the tokens: $t0 / $t1 / $t2"
cmp -s "$tmp/t0.bin" "$tmp/t1.bin" && cmp -s "$tmp/t0.bin" "$tmp/t2.bin" || fail "OpenMP team size changed the logits"
# Bad input: clear errors, non-zero exit, no crash.
expect_error() {
  local want=$1; shift
  set +e
  out=$("$@" 2>&1); rc=$?
  set -e
  [ $rc -ne 0 ] && [ $rc -lt 128 ] || fail "expected a clean failure from: $* (rc=$rc)"
  grep -q -- "$want" <<<"$out" || fail "expected '$want' in: $out"
}
expect_error "out of range\|outside the vocabulary" "$bin/qkv-run" --model "$tmp/m.gguf" --tokens 1,999 -n 1
expect_error "not a token id" "$bin/qkv-run" --model "$tmp/m.gguf" --tokens 1,x -n 1
expect_error "exceeds the context" "$bin/qkv-run" --model "$tmp/m.gguf" --tokens 1,2 -n 500
expect_error "weights-dtype" "$bin/qkv-run" --model "$tmp/m.gguf" --tokens 1 --weights-dtype f16
expect_error "QKV_MAX_ISA must be avx2, avx512, avx512_vnni, avx512_bf16 or amx, got 'sse2'" env QKV_MAX_ISA=sse2 "$bin/qkv-run" --model "$tmp/m.gguf" --tokens 1 -n 1
expect_error "QKV_KV_PREFETCH must be l1 or l2, got 'l3'" env QKV_KV_PREFETCH=l3 "$bin/qkv-run" --model "$tmp/m.gguf" --tokens 1 -n 1
expect_error "cannot open" "$bin/qkv-run" --model "$tmp/none.gguf" --tokens 1
head -c 1000 "$tmp/m.gguf" > "$tmp/trunc.gguf"
expect_error "DATA_LOSS" "$bin/qkv-run" --model "$tmp/trunc.gguf" --tokens 1
# A tokenizer.json with a field of the wrong type is an error message, not a terminate (issue 13).
echo '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "added_tokens": [{"id": "x"}]}' > "$tmp/badtok.json"
set +e
out=$(echo '"hi"' | "$bin/qkv-model" tokenize --tokenizer "$tmp/badtok.json" 2>&1); rc=$?
set -e
[ $rc -eq 1 ] && grep -q "wrong shape" <<<"$out" || fail "bad tokenizer.json: rc=$rc, $out"
echo '{"hidden_size": 64}' > "$tmp/bad.json"
expect_error "missing 'num_hidden_layers'" "$bin/qkv-model" random --config "$tmp/bad.json" --out "$tmp/x.gguf"
# Quantize: a Q4_K_M file (64-wide rows: llama-quantize's fallbacks) runs kept quantized, is about a quarter
# of the f32 file, and refuses to overwrite its input or take an unknown preset.
"$bin/qkv-model" random --config "$tmp/c.json" --out "$tmp/f.gguf" --arch llama --dtype f32 --seed 5 >/dev/null
"$bin/qkv-model" quantize "$tmp/f.gguf" "$tmp/q.gguf" --type Q4_K_M --quiet > "$tmp/q.txt"
grep -q "blk.0.attn_q.weight *f32 *-> q5_0" "$tmp/q.txt" || fail "Q4_K_M on 64-wide rows should fall back to q5_0: $(cat "$tmp/q.txt")"
[ $(stat -c %s "$tmp/q.gguf") -lt $(( $(stat -c %s "$tmp/f.gguf") / 3 )) ] || fail "quantized file is not smaller"
log=$("$bin/qkv-run" --model "$tmp/q.gguf" --tokens 1,2,3 -n 4 --temperature 0 --log-level info 2>&1)
grep -q "(quantized)" <<<"$log" || fail "the quantized file was not run quantized: $log"
# stdout is the generated text alone: the log lines go to stderr.
out=$("$bin/qkv-run" --model "$tmp/q.gguf" --tokens 1,2,3 -n 4 --temperature 0 --log-level info 2>/dev/null)
grep -q "\[info\]" <<<"$out" && fail "qkv-run's log lines are on stdout: $out"
expect_error "same file" "$bin/qkv-model" quantize "$tmp/q.gguf" "$tmp/q.gguf" --type Q8_0
expect_error "must be one of" "$bin/qkv-model" quantize "$tmp/f.gguf" "$tmp/q2.gguf" --type Q4_K_X
# MLA (deepseek2): random writes what llama.cpp loads, info reports the latent cache, cache = no-cache, and the
# config rules llama.cpp imposes are errors that name the field.
cat > "$tmp/mla.json" <<'JSON'
{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 300,
 "max_position_embeddings": 128, "kv_lora_rank": 32, "q_lora_rank": 24, "qk_nope_head_dim": 16,
 "qk_rope_head_dim": 8, "v_head_dim": 12, "rope_scaling": {"type": "yarn", "factor": 4, "mscale_all_dim": 1.0,
 "original_max_position_embeddings": 32}}
JSON
"$bin/qkv-model" random --config "$tmp/mla.json" --out "$tmp/mla.gguf" --arch deepseek2 --seed 3 >/dev/null
info=$("$bin/qkv-model" info "$tmp/mla.gguf")
grep -q "attention:         MLA (4 query heads, per token and layer a latent of 32 and one rope key of 8" <<<"$info" || fail "info lacks MLA: $info"
grep -q "rope scaling:      yarn x4, original context 32" <<<"$info" || fail "info lacks the rope scaling: $info"
grep -q "kv bytes/token:    160 (bf16), 320 (f32), 88 (int8)" <<<"$info" || fail "MLA bytes per token: 2 layers x (32 + 8) x 2 = 160; got: $info"
plan=$("$bin/qkv-model" plan --config "$tmp/mla.json" --json)
grep -q '"kv_bytes_per_token":160' <<<"$plan" || fail "plan disagrees with info: $plan"
a=$("$bin/qkv-run" --model "$tmp/mla.gguf" --prompt "The cat sat" -n 24 --temperature 0 --print-ids --threads 1 2>&1 >/dev/null | grep '^ids:')
b=$("$bin/qkv-run" --model "$tmp/mla.gguf" --prompt "The cat sat" -n 24 --temperature 0 --print-ids --no-cache --threads 1 2>&1 >/dev/null | grep '^ids:')
[ -n "$a" ] && [ "$a" = "$b" ] || fail "MLA cache ($a) and no-cache ($b) differ"
sed 's/"q_lora_rank": 24/"q_lora_rank": null/' "$tmp/mla.json" > "$tmp/mla_noq.json"
expect_error "'q_lora_rank' null needs 26 or 27 layers" "$bin/qkv-model" random --config "$tmp/mla_noq.json" --out "$tmp/x.gguf" --arch deepseek2
sed 's/"kv_lora_rank": 32, //' "$tmp/mla.json" > "$tmp/mla_nokv.json"
expect_error "missing 'kv_lora_rank'" "$bin/qkv-model" random --config "$tmp/mla_nokv.json" --out "$tmp/x.gguf" --arch deepseek2
sed 's/"vocab_size": 300,/"vocab_size": 300, "n_routed_experts": 8,/' "$tmp/mla.json" > "$tmp/mla_moe.json"
expect_error "missing 'num_experts_per_tok'" "$bin/qkv-model" random --config "$tmp/mla_moe.json" --out "$tmp/x.gguf" --arch deepseek2
sed 's/"type": "yarn"/"type": "longrope"/' "$tmp/mla.json" > "$tmp/mla_lr.json"
expect_error "rope scaling 'longrope' is not supported" "$bin/qkv-model" random --config "$tmp/mla_lr.json" --out "$tmp/x.gguf" --arch deepseek2
# Llama 3.1's rope scaling: random writes rope_freqs.weight (as llama.cpp's converter), info reports it; other
# architectures refuse it.
cat > "$tmp/l3.json" <<'JSON'
{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 300,
 "max_position_embeddings": 128, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
JSON
"$bin/qkv-model" random --config "$tmp/l3.json" --out "$tmp/l3.gguf" --arch llama --seed 3 >/dev/null
info=$("$bin/qkv-model" info "$tmp/l3.gguf")
grep -q "rope scaling:      none; llama3 frequency divisors (rope_freqs.weight) 1 to 8$" <<<"$info" || fail "info lacks the llama3 divisors: $info"
expect_error "rope_scaling type 'llama3' is supported for llama only" "$bin/qkv-model" random --config "$tmp/l3.json" --out "$tmp/x.gguf" --arch qwen2
# qkv-bench with a baseline: the model over the baseline per repetition, and their median.
out=$("$bin/qkv-bench" --model "$tmp/m.gguf" --baseline "$tmp/l.gguf" --prompt 8 --gen 4 --reps 2 --threads 1 2>&1)
grep -q "^rep 2: baseline decode [0-9.]* tok/s; the model decodes [0-9.]*x the baseline$" <<<"$out" || fail "qkv-bench --baseline per repetition: $out"
grep -q "^baseline $tmp/l.gguf: decode median [0-9.]* tok/s; the model over the baseline per repetition: median [0-9.]*x ([0-9.]*x-[0-9.]*x)$" <<<"$out" || fail "qkv-bench --baseline summary: $out"
expect_error "baseline: .*cannot open" "$bin/qkv-bench" --model "$tmp/m.gguf" --baseline "$tmp/none.gguf" --prompt 8 --gen 4
expect_error "exceeds the context of $tmp/m.gguf" "$bin/qkv-bench" --model "$tmp/m.gguf" --prompt 100 --gen 100
# qkv-bench-engine on a model of 128 tokens of context: without --history the session figure takes what the
# context leaves (it hung on a model shorter than the default 2000), and bad options are clear errors.
out=$("$bin/qkv-bench-engine" --model "$tmp/m.gguf" --concurrency 1,2 --gen 4 --threads 1 2>&1)
grep -q "^decode,  2 concurrent: *[0-9.]* tok/s aggregate" <<<"$out" || fail "qkv-bench-engine decode figure: $out"
grep -q "^time to first token, turn 4 with [0-9]* tokens of history" <<<"$out" || fail "qkv-bench-engine session figure: $out"
expect_error "history 2000 + the measured turn's 68 tokens exceed the context of 128 tokens" "$bin/qkv-bench-engine" --model "$tmp/m.gguf" --history 2000
expect_error "temperature must be in" "$bin/qkv-bench-engine" --model "$tmp/m.gguf" --concurrency 1 --temperature -1
expect_error "exceeds the context of 128 tokens" "$bin/qkv-bench-engine" --model "$tmp/m.gguf" --concurrency 1 --gen 500
expect_error "\-\-gen: Value 0 not in range" "$bin/qkv-bench-engine" --model "$tmp/m.gguf" --gen 0
# The compute team's default size is the CPUs the process may use (kernels/cpu.h), not the machine's: one
# under taskset -c 0, for qkv-run and for the server; more threads than that are kept, with a warning.
log=$(taskset -c 0 "$bin/qkv-run" --model "$tmp/m.gguf" --tokens 1,2,3 -n 2 --temperature 0 --log-level info 2>&1 >/dev/null)
grep -q "compute threads: 1, the CPUs this process may use (affinity mask: 1 of" <<<"$log" || fail "taskset -c 0 qkv-run: $log"
log=$(taskset -c 0 "$bin/qkv-run" --model "$tmp/m.gguf" --tokens 1,2,3 -n 2 --temperature 0 --threads 2 2>&1 >/dev/null)
grep -q "\-\-threads 2 is more than the 1 CPU(s) this process may use" <<<"$log" || fail "taskset -c 0 qkv-run --threads 2: $log"
taskset -c 0 "$bin/qkvserve" --model "$tmp/m.gguf" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --http-listen "" \
  --ready-file "$tmp/ready" > "$tmp/serve.log" 2>&1 &
serve=$!
for _ in $(seq 600); do [ -e "$tmp/ready" ] || ! kill -0 $serve 2>/dev/null && break; sleep 0.1; done
kill $serve 2>/dev/null || true
wait $serve 2>/dev/null || true
grep -q "compute threads: 1, the CPUs this process may use" "$tmp/serve.log" || fail "taskset -c 0 qkvserve: $(cat "$tmp/serve.log")"
echo "tools_cli: 35 passed, 0 failed"
