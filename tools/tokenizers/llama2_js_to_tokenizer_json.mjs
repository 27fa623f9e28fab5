// Converts the Llama 1/2 vocabulary embedded in llama-tokenizer-js@1.2.2 (MIT) to a Hugging Face
// tokenizer.json (SentencePiece-style BPE: byte fallback, "▁" for spaces, a prepended "▁") that qkvserve
// loads with --tokenizer. Usage: node llama2_js_to_tokenizer_json.mjs PATH/llama-tokenizer.js OUT.json
import fs from "node:fs";
import path from "node:path";
import url from "node:url";

const llamaTokenizer = (await import(url.pathToFileURL(path.resolve(process.argv[2])).href)).default;

const vocab = {};
llamaTokenizer.vocabById.forEach((s, id) => { vocab[s] = id; });
const merges = [...llamaTokenizer.merges.entries()].sort((a, b) => a[1] - b[1]).map(([k]) => k);
const added = [["<unk>", 0], ["<s>", 1], ["</s>", 2]].map(([content, id]) => ({
  id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true}));
const tok = {
  version: "1.0",
  added_tokens: added,
  normalizer: {type: "Sequence", normalizers: [{type: "Prepend", prepend: "▁"}, {type: "Replace", pattern: {String: " "}, content: "▁"}]},
  pre_tokenizer: null,
  decoder: {type: "Sequence", decoders: [{type: "Replace", pattern: {String: "▁"}, content: " "}, {type: "ByteFallback"}, {type: "Fuse"}]},
  model: {type: "BPE", dropout: null, unk_token: "<unk>", continuing_subword_prefix: null, end_of_word_suffix: null,
          fuse_unk: true, byte_fallback: true, vocab, merges},
};
fs.writeFileSync(process.argv[3], JSON.stringify(tok));
console.log(`${Object.keys(vocab).length} tokens, ${merges.length} merges`);
