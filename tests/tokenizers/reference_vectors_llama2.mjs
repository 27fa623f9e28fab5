// Writes llama2.json: reference ids of corpus.json from llama-tokenizer-js@1.2.2 (no BOS, with the preceding space).
import fs from "node:fs";
import llamaTokenizer from "llama-tokenizer-js";
const corpus = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
fs.writeFileSync(process.argv[3], JSON.stringify(corpus.map((s) => llamaTokenizer.encode(s, false, true))));
