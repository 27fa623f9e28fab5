// Writes reference_digests.json: for each tokenizer of variants.json, the ids of every string of corpus.json
// then marks_corpus.json, as computed by @lenml/tokenizers@3.7.2 (transformers.js) from the package's
// tokenizer.json, with the variant's pre_tokenizer/normalizer put in its place where it gives them. Stored as
// the first 16 hex digits of sha256(JSON.stringify(ids)) per string, to keep the repository small.
// variants.json writes tokenizers' Digits pre-tokenizer as a Split on \p{N}: transformers.js implements Digits
// with JavaScript's \d (ASCII digits only), tokenizers (Rust) and llama.cpp with every Unicode number (Nd, Nl,
// No), so "½", "Ⅻ" and Arabic-Indic digits would otherwise differ from the model's own tokenizer.
// Usage (in a directory where @lenml/tokenizers and the variants' packages are installed):
//   node reference_digests.mjs DIR_OF_THIS_FILE
import crypto from "node:crypto";
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";

const here = process.argv[2];
const require = createRequire(path.join(process.cwd(), "x.js"));  // packages from the working directory
const { TokenizerLoader } = require("@lenml/tokenizers");
const read = (f) => JSON.parse(fs.readFileSync(path.join(here, f), "utf8"));
const corpus = read("corpus.json").concat(read("marks_corpus.json"));
const variants = read("variants.json");
const out = {};
for (const [name, v] of Object.entries(variants)) {
  const pkg = v.package.slice(0, v.package.lastIndexOf("@"));
  const json = JSON.parse(fs.readFileSync(require.resolve(`${pkg}/models/tokenizer.json`), "utf8"));
  const config = JSON.parse(fs.readFileSync(require.resolve(`${pkg}/models/tokenizer_config.json`), "utf8"));
  if ("pre_tokenizer" in v) json.pre_tokenizer = v.pre_tokenizer;
  if ("normalizer" in v) json.normalizer = v.normalizer;
  const t = TokenizerLoader.fromPreTrained({ tokenizerJSON: json, tokenizerConfig: config });
  out[name] = corpus.map((s) => {
    const ids = Array.from(t.encode(s, { add_special_tokens: false }));
    return crypto.createHash("sha256").update(JSON.stringify(ids)).digest("hex").slice(0, 16);
  });
  console.log(name, out[name].length);
}
fs.writeFileSync(path.join(here, "reference_digests.json"), JSON.stringify(out, null, 0));
