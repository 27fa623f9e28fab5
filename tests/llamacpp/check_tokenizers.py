#!/usr/bin/env python3
"""Cross-checks the GGUF tokenizer path against llama.cpp itself (node-llama-cpp@3.21.1's prebuilt build):
for each `tokenizer.ggml.pre` name of tests/tokenizers/variants.json and the older ones (gpt-2, llama-bpe,
qwen2), a vocabulary-only GGUF with the real vocabulary must tokenize every string of corpus.json and
marks_corpus.json to llama.cpp's ids. Not part of ctest (CI need not run node); run by hand:
  python3 tests/llamacpp/check_tokenizers.py build/bin"""
import json
import os
import shutil
import struct
import subprocess
import sys
import unicodedata

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tokenizers"))
import check_vectors as cv  # noqa: E402

MARKS_DIFFER = {"tekken", "gpt-4o"}
WORK = os.environ.get("QKV_NODE_DIR", "/tmp/qkv-llamacpp")


def with_llama_hparams(path):
    """Appends the llama hyperparameters llama.cpp reads even for a vocabulary-only load."""
    with open(path, "rb") as f:
        b = bytearray(f.read())
    kv = [("general.architecture", struct.pack("<I", 8) + struct.pack("<Q", 5) + b"llama")]
    for k, v in (("context_length", 512), ("embedding_length", 64), ("block_count", 1), ("feed_forward_length", 128),
                 ("attention.head_count", 4), ("attention.head_count_kv", 4)):
        kv.append(("llama." + k, struct.pack("<II", 4, v)))
    kv.append(("llama.attention.layer_norm_rms_epsilon", struct.pack("<If", 6, 1e-6)))
    n_kv = struct.unpack_from("<Q", b, 16)[0]
    struct.pack_into("<Q", b, 16, n_kv + len(kv))
    for k, v in kv:
        e = k.encode()
        b += struct.pack("<Q", len(e)) + e + v
    with open(path, "wb") as f:
        f.write(b)


def main():
    bin_dir = sys.argv[1]
    if not os.path.isdir(os.path.join(WORK, "node_modules", "node-llama-cpp")):
        os.makedirs(WORK, exist_ok=True)
        subprocess.run("npm init -y >/dev/null && npm i -E node-llama-cpp@3.21.1 >/dev/null", shell=True, cwd=WORK,
                       check=True)
    shutil.copy(os.path.join(HERE, "tokenize.mjs"), WORK)  # node resolves node-llama-cpp from the script's place
    texts = []
    for f in ("corpus.json", "marks_corpus.json"):
        with open(os.path.join(HERE, "..", "tokenizers", f), encoding="utf-8") as fh:
            texts += json.load(fh)
    tpath = os.path.join(WORK, "texts.json")
    with open(tpath, "w", encoding="utf-8") as f:
        json.dump(texts, f, ensure_ascii=False)
    with open(os.path.join(HERE, "..", "tokenizers", "variants.json"), encoding="utf-8") as f:
        variants = json.load(f)
    cases = [(name, cv.fetch_variant(name, v), v["gguf_pre"]) for name, v in variants.items()]
    cases += [(n, cv.fetch(n, cv.PACKAGES[n]), pre) for n, pre in (("gpt2", "gpt-2"), ("llama3", "llama-bpe"),
                                                                     ("qwen3", "qwen2"))]
    failed = 0
    for name, tok, pre in cases:
        gpath = os.path.join(WORK, f"vocab-{name}.gguf")
        cv.gguf_from_json(tok, pre, gpath)
        with_llama_hparams(gpath)
        opath = os.path.join(WORK, f"ids-{name}.json")
        r = subprocess.run(["node", os.path.join(WORK, "tokenize.mjs"), gpath, tpath, opath], capture_output=True, text=True,
                           cwd=WORK)
        if r.returncode != 0:
            print(f"{name} (pre {pre}): llama.cpp failed: {r.stderr.strip()[-300:]}")
            failed += 1
            continue
        with open(opath) as f:
            ref = json.load(f)
        ours = cv.run(bin_dir, ["--model", gpath], [json.dumps(s) for s in texts])
        bad = [i for i, (a, b) in enumerate(zip(ours, ref)) if a != b]
        print(f"{name} (pre {pre}): {len(texts) - len(bad)}/{len(texts)} strings give llama.cpp's ids")
        if pre in MARKS_DIFFER:
            # llama.cpp's adaptation of these regexes (lookaheads for its own regex engine) leaves combining
            # marks out of the letter classes, so words with marks split differently from the model's own
            # tokenizer, which tests/tokenizers/check_vectors.py checks we follow. Those strings are expected.
            marks = [i for i in bad if any(unicodedata.category(c).startswith("M") for c in texts[i])]
            print(f"  {len(marks)} of them have combining marks (llama.cpp's {pre} regex drops \\p{{M}}): expected")
            bad = [i for i in bad if i not in set(marks)]
        for i in bad[:4]:
            print(f"  mismatch {json.dumps(texts[i], ensure_ascii=False)[:70]}: ours {ours[i][:14]} llama.cpp {ref[i][:14]}")
        failed += bool(bad)
    print(f"check_tokenizers: {len(cases) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
