// Tokenizes every string of a JSON list with llama.cpp (node-llama-cpp's prebuilt build, vocabulary only) and
// writes the id lists as one JSON list. Used by check_tokenizers.py.
// Usage: node tokenize.mjs VOCAB.gguf TEXTS.json OUT.json
import fs from "node:fs";
import {getLlama} from "node-llama-cpp";

const [modelPath, textsPath, outPath] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath, vocabOnly: true});
const texts = JSON.parse(fs.readFileSync(textsPath, "utf8"));
// A file, not stdout: process.exit would cut a pipe short.
fs.writeFileSync(outPath, JSON.stringify(texts.map((t) => Array.from(model.tokenize(t, false)))));
process.exit(0);
