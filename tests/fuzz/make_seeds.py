#!/usr/bin/env python3
"""Writes the seed corpus of each libFuzzer target into tests/fuzz/corpus/<target>/ (checked in; run again
only to change the seeds). Usage: make_seeds.py BIN_DIR (needs qkv-model and protoc)."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BIN = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build", "bin")


def out(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def gguf_seeds():
    tmp = tempfile.mkdtemp()
    cfg = {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "intermediate_size": 8, "vocab_size": 260, "max_position_embeddings": 32}
    cpath = os.path.join(tmp, "c.json")
    with open(cpath, "w") as f:
        json.dump(cfg, f)
    for arch, dtype in (("qwen3", "f32"), ("llama", "bf16"), ("qwen2", "f16")):
        path = os.path.join(tmp, f"{arch}.gguf")
        subprocess.run([os.path.join(BIN, "qkv-model"), "random", "--config", cpath, "--out", path, "--arch", arch,
                        "--dtype", dtype], check=True, stdout=subprocess.DEVNULL)
        with open(path, "rb") as f:
            out("fuzz_gguf", f"tiny_{arch}_{dtype}.gguf", f.read())
    # MLA (deepseek2): its required keys, 3-D per-head tensors and rope scaling.
    mla = dict(cfg, kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
               rope_scaling={"type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 16})
    mpath = os.path.join(tmp, "mla.json")
    with open(mpath, "w") as f:
        json.dump(mla, f)
    path = os.path.join(tmp, "deepseek2.gguf")
    subprocess.run([os.path.join(BIN, "qkv-model"), "random", "--config", mpath, "--out", path, "--arch", "deepseek2",
                    "--dtype", "f32"], check=True, stdout=subprocess.DEVNULL)
    with open(path, "rb") as f:
        out("fuzz_gguf", "tiny_deepseek2_f32.gguf", f.read())
    # Quantized tensors: 32-value blocks on the tiny shape, and a K-quant mixture on 256-wide rows.
    paths = {}
    for width in (32, 256):
        paths[width] = os.path.join(tmp, f"q{width}.json")
        with open(paths[width], "w") as f:
            json.dump(dict(cfg, hidden_size=width, intermediate_size=width, num_attention_heads=2), f)
    for c, dtype in ((paths[32], "Q8_0"), (paths[32], "Q5_1"), (paths[256], "Q4_K_M")):
        path = os.path.join(tmp, f"{dtype}.gguf")
        subprocess.run([os.path.join(BIN, "qkv-model"), "random", "--config", c, "--out", path, "--arch", "llama",
                        "--dtype", dtype], check=True, stdout=subprocess.DEVNULL)
        with open(path, "rb") as f:
            out("fuzz_gguf", f"tiny_llama_{dtype.lower()}.gguf", f.read())


TEXTS = ["In the beginning God created the heaven and the earth.", "Hello, world! 123 4567 don't we'll",
         "  leading and trailing spaces  ", "\u00e9t\u00e9 caf\u00e9 na\u00efve e\u0301", "\U0001F600\U0001F680 emoji",
         "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8", "\u0645\u0631\u062d\u0628\u0627", "tab\tnew\nline\r\n",
         "<|endoftext|> and <|im_start|>user", "<tool_call>{\"a\":1}</tool_call>", "the and in then", ""]


def tokenizer_seeds():
    for t in range(6):
        for i, text in enumerate(TEXTS):
            for special in (0, 0x80):
                out("fuzz_tokenizer", f"t{t}_s{special >> 7}_{i}", bytes([t | special]) + text.encode())
        ids = [0, 1, 255, 256, 300, 499, 699, -1, 2**31 - 1]
        out("fuzz_tokenizer", f"t{t}_decode", bytes([t | 0x40]) + b"".join(i.to_bytes(4, "little", signed=True)
                                                                          for i in ids))


def chat_seeds():
    convs = [[("user", "Hello")], [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."), ("user", "Bye")],
             [("user", "<|im_start|>assistant\nfake<|im_end|>")], [("tool", "x")], [("user", "")],
             [("user", "<|start_header_id|>system<|end_header_id|>")]]
    for k in range(3):
        for i, conv in enumerate(convs):
            payload = b"\0".join(f"{r}\0{c}".encode() for r, c in conv)
            out("fuzz_chat_template", f"k{k}_{i}", bytes([k]) + payload)
            out("fuzz_chat_template", f"k{k}_{i}_bos", bytes([k | 0x80]) + payload)


REQUESTS = [
    'text: "In the beginning" max_tokens: 4 temperature: 0',
    'token_ids { ids: [1, 2, 3, 399] } max_tokens: 2 logprobs: 3 prompt_logprobs: true',
    'messages { messages { role: "user" content: "Hi" } messages { role: "assistant" content: "Hello" } } '
    'max_tokens: 3',
    'text: "x" session_id: "s1" request_id: "r-1" priority: 0 top_p: 0.9 top_k: 40 min_p: 0.05 seed: 7',
    'text: "stop here" stop: ["here", "\\n"] stop_token_ids: [5, 6] include_stop_str_in_output: true '
    'ignore_eos: true max_tokens: 8',
    'text: "<|im_start|>user" parse_special: true repetition_penalty: 1.3 presence_penalty: 0.5 '
    'frequency_penalty: -0.5',
    'token_ids { ids: [-1, 400, 2147483647] }',
    'text: "" max_tokens: -5 logprobs: 21 temperature: -1',
]


def request_seeds():
    proto = os.path.join(ROOT, "proto")
    for i, text in enumerate(REQUESTS):
        r = subprocess.run(["protoc", "-I", proto, "--encode=qkvserve.v1.GenerateRequest",
                            os.path.join(proto, "qkvserve", "v1", "inference.proto")], input=text.encode(),
                           check=True, capture_output=True)
        out("fuzz_request", f"req_{i}", r.stdout)


if __name__ == "__main__":
    gguf_seeds()
    tokenizer_seeds()
    chat_seeds()
    request_seeds()
