// Writes gpt2.json: the reference ids of corpus.json from gpt-3-encoder@1.1.4 (OpenAI's GPT-2 encoder in JS).
// Usage (where gpt-3-encoder is installed): node reference_vectors_gpt2.mjs CORPUS.json OUT.json
import fs from "node:fs";
import enc from "gpt-3-encoder";
const corpus = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const out = corpus.map((s) => { try { return enc.encode(s); } catch (e) { return null; } });
fs.writeFileSync(process.argv[3], JSON.stringify(out));
console.log(out.filter((x) => x === null).length, "errors");
