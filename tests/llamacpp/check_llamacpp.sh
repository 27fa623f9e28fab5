#!/usr/bin/env bash
# Cross-checks qkvserve against llama.cpp (the prebuilt build shipped in node-llama-cpp@3.21.1 on npm):
# random f32 models of the llama, qwen2 and qwen3 architectures must load in llama.cpp, tokenize text to
# the same ids, and give the same greedy continuation as `qkv-run --weights-dtype f32 --kv-dtype f32`.
# Not part of ctest (CI need not run node); run by hand:  bash tests/llamacpp/check_llamacpp.sh build/bin
set -euo pipefail
bin=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
work=${QKV_NODE_DIR:-/tmp/qkv-llamacpp}
mkdir -p "$work"
if [ ! -d "$work/node_modules/node-llama-cpp" ]; then
  (cd "$work" && npm init -y >/dev/null && npm i -E node-llama-cpp@3.21.1 >/dev/null)
fi
cp "$here/greedy.mjs" "$work/"
text="Hello world, the quick brown fox's 123 tests"
tokens="5,17,99,3,250,42,7,301,12,8"
pass=0 fail=0
# llama3: Llama 3.1's rope scaling (rope_freqs.weight), with an original context short enough that most pairs
# are divided.
for arch in llama qwen2 qwen3 llama3; do
  rope="" file_arch=$arch
  [ "$arch" = llama3 ] && file_arch=llama && rope=', "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}'
  cat > "$work/c.json" <<JSON
{"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-6$rope}
JSON
  "$bin/qkv-model" random --config "$work/c.json" --out "$work/$arch.gguf" --arch "$file_arch" --dtype f32 --seed 11 >/dev/null
  ref=$(node "$work/greedy.mjs" "$work/$arch.gguf" "$text" "$tokens" 24)
  ours_greedy=$("$bin/qkv-run" --model "$work/$arch.gguf" --tokens "$tokens" -n 24 --temperature 0 --ignore-eos \
    --weights-dtype f32 --kv-dtype f32 --threads 1 --print-ids 2>&1 >/dev/null | sed -n 's/^ids: //p')
  ours_tok=$(printf '%s\n' "$text" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read().rstrip("\n")))' | \
    "$bin/qkv-model" tokenize --model "$work/$arch.gguf" 2>/dev/null || echo "n/a")
  ref_greedy=$(python3 -c 'import json,sys; print(",".join(map(str, json.loads(sys.argv[1])["greedy"])))' "$ref")
  ref_tok=$(python3 -c 'import json,sys; print(json.dumps(json.loads(sys.argv[1])["tokenize"]).replace(" ", ""))' "$ref")
  if [ "$ours_greedy" = "$ref_greedy" ]; then echo "ok   $arch greedy: $ours_greedy"; pass=$((pass+1)); else
    echo "FAIL $arch greedy: ours $ours_greedy llama.cpp $ref_greedy"; fail=$((fail+1)); fi
  if [ "$ours_tok" != "n/a" ]; then
    if [ "$(tr -d ' ' <<<"$ours_tok")" = "$ref_tok" ]; then echo "ok   $arch tokenize: $ref_tok"; pass=$((pass+1)); else
      echo "FAIL $arch tokenize: ours $ours_tok llama.cpp $ref_tok"; fail=$((fail+1)); fi
  fi
done
# Quantized files written by `qkv-model quantize`: llama.cpp must load each, and our teacher-forced argmax
# must follow its greedy tokens on >= 85% of positions (it quantizes activations differently, and random
# models have tiny logit gaps).
cat > "$work/q.json" <<JSON
{"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "intermediate_size": 512, "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}
JSON
n=40
for arch in llama qwen2 qwen3; do
  "$bin/qkv-model" random --config "$work/q.json" --out "$work/q_$arch.gguf" --arch "$arch" --dtype f32 --seed 12 >/dev/null
  for preset in Q8_0 Q6_K Q5_K_M Q4_K_M Q4_0 IQ4_XS Q3_K_M Q2_K; do
    q="$work/q_${arch}_$preset.gguf"
    "$bin/qkv-model" quantize "$work/q_$arch.gguf" "$q" --type "$preset" --quiet >/dev/null
    ref=$(node "$work/greedy.mjs" "$q" "a" "$tokens" $n)
    greedy=$(python3 -c 'import json,sys; print(",".join(map(str, json.loads(sys.argv[1])["greedy"])))' "$ref")
    all="$tokens,$(cut -d, -f1-$((n - 1)) <<<"$greedy")"
    "$bin/qkv-run" --model "$q" --tokens "$all" -n 0 --threads 1 --kv-dtype f32 --logits "$work/l.bin" >/dev/null 2>&1
    agree=$(/usr/bin/python3 - "$work/l.bin" "$tokens" "$greedy" <<'PY'
import sys
import numpy as np
p = len(sys.argv[2].split(","))
g = [int(t) for t in sys.argv[3].split(",")]
lg = np.fromfile(sys.argv[1], dtype="<f4").reshape(-1, 512)  # the config's vocabulary
ours = lg[p - 1:].argmax(1)
m = min(len(ours), len(g))  # llama.cpp stops early at an end-of-generation token
ours, g = ours[:m], g[:m]
print(f"{int((ours == np.array(g)).sum())}/{len(g)}")
PY
)
    if [ "$(( ${agree%/*} * 100 / ${agree#*/} ))" -ge 85 ]; then echo "ok   $arch $preset teacher-forced argmax follows llama.cpp greedy on $agree"; pass=$((pass+1)); else
      echo "FAIL $arch $preset teacher-forced argmax follows llama.cpp greedy on only $agree"; fail=$((fail+1)); fi
  done
done
# MLA (deepseek2, dense): llama.cpp loads files from `qkv-model random --arch deepseek2` (with and without
# the low-rank query path, which llama.cpp decides from the layer count; other splits; YaRN; the legacy
# attn_kv_b), and our teacher-forced argmax follows its 24 greedy tokens, 24 of 24, for two prompts.
/usr/bin/python3 - "$work" <<'PY'
import json, sys
mla = {"kv_lora_rank": 64, "q_lora_rank": 48, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 24}
base = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256,
        "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, **mla}
cfgs = {
    "mla": base,
    "mla_no_q_lora": dict(base, hidden_size=64, intermediate_size=96, num_hidden_layers=26, kv_lora_rank=32,
                          q_lora_rank=None, qk_nope_head_dim=16, v_head_dim=16),
    "mla_splits": dict(base, kv_lora_rank=32, q_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=48),
    "mla_yarn": dict(base, rope_scaling={"type": "yarn", "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                                         "original_max_position_embeddings": 32}),
    "mla_yarn_no_mscale": dict(base, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "mla_legacy_kv_b": dict(base, legacy_kv_b=True),
}
moe = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 32, "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 512,
       "rms_norm_eps": 1e-6, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
cfgs["moe"] = moe
cfgs["moe_16x4"] = dict(moe, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32)
ds = dict(base, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
          first_k_dense_replace=1)
cfgs["moe_ds2_softmax"] = ds
cfgs["moe_ds3_sigmoid_groups"] = dict(ds, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
                                      norm_topk_prob=True, routed_scaling_factor=2.5, num_hidden_layers=3)
# qwen35 hybrids (Gated DeltaNet + gated attention). llama.cpp needs equal key and value head widths; value
# heads a multiple of key heads (ratio 2 and 3: its tiled head order), intervals 2, 4 and 3, partial rotary.
hy = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
      "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
      "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
      "linear_num_key_heads": 2, "linear_num_value_heads": 4, "full_attention_interval": 2, "partial_rotary_factor": 0.5}
cfgs["hybrid_i2"] = hy
cfgs["hybrid_i4"] = dict(hy, linear_num_key_heads=1, linear_num_value_heads=3, full_attention_interval=4,
                         partial_rotary_factor=0.25)
cfgs["hybrid_i3"] = dict(hy, num_hidden_layers=6, linear_num_value_heads=6, full_attention_interval=3,
                         linear_conv_kernel_dim=3, partial_rotary_factor=1.0)
for name, c in cfgs.items():
    json.dump(c, open(f"{sys.argv[1]}/{name}.json", "w"))
PY
# ...and mixtures of experts the same way: qwen3moe (softmax router, top-k, weights normalized) and
# deepseek2 with routed and shared experts (softmax; sigmoid with the selection bias, groups and scaling); and
# the qwen35 hybrids (38 positions: two of the Gated DeltaNet layer's 16-token chunks and part of a third).
for name in mla mla_no_q_lora mla_splits mla_yarn mla_yarn_no_mscale mla_legacy_kv_b moe moe_16x4 moe_ds2_softmax \
    moe_ds3_sigmoid_groups hybrid_i2 hybrid_i4 hybrid_i3; do
  arch=deepseek2; [[ $name == moe* && $name != moe_ds* ]] && arch=qwen3moe; [[ $name == hybrid* ]] && arch=qwen35
  "$bin/qkv-model" random --config "$work/$name.json" --out "$work/$name.gguf" --arch $arch --dtype f32 --seed 5 >/dev/null
  for prompt in "$tokens" "7,7,7,400,3,99,123,64,2,1,0,511,300,17"; do
    ref=$(node "$work/greedy.mjs" "$work/$name.gguf" "a" "$prompt" 24)
    greedy=$(python3 -c 'import json,sys; print(",".join(map(str, json.loads(sys.argv[1])["greedy"])))' "$ref")
    all="$prompt,$(cut -d, -f1-23 <<<"$greedy")"
    "$bin/qkv-run" --model "$work/$name.gguf" --tokens "$all" -n 0 --threads 1 --weights-dtype f32 --kv-dtype f32 \
      --logits "$work/l.bin" >/dev/null 2>&1
    agree=$(/usr/bin/python3 - "$work/l.bin" "$prompt" "$greedy" <<'PY'
import sys
import numpy as np
p = len(sys.argv[2].split(","))
g = np.array([int(t) for t in sys.argv[3].split(",")])
ours = np.fromfile(sys.argv[1], dtype="<f4").reshape(-1, 512)[p - 1:].argmax(1)
print(f"{int((ours[:len(g)] == g).sum())}/{len(g)}")
PY
)
    # llama.cpp stops early at an end-of-generation token: all of what it generated must agree.
    if [ "${agree%/*}" = "${agree#*/}" ] && [ "${agree#*/}" -gt 0 ]; then echo "ok   $arch $name teacher-forced argmax follows llama.cpp greedy on $agree"; pass=$((pass+1)); else
      echo "FAIL $arch $name teacher-forced argmax follows llama.cpp greedy on only $agree"; fail=$((fail+1)); fi
  done
done
echo "llamacpp: $pass passed, $fail failed"
[ $fail -eq 0 ]
