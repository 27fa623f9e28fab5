// Loads a GGUF in llama.cpp (the prebuilt one in node-llama-cpp) and prints, as JSON, how it tokenizes a
// text and the greedy continuation of a token list. Used by check_llamacpp.sh to compare with qkvserve.
// Usage: node greedy.mjs MODEL.gguf TEXT TOKENS(comma-separated) N
import {getLlama} from "node-llama-cpp";

const [modelPath, text, tokenList, nStr] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({contextSize: 512, threads: 1});
const seq = context.getSequence();
const prompt = tokenList.split(",").map(Number);
const out = [];
for await (const t of seq.evaluate(prompt, {temperature: 0})) {
  out.push(t);
  if (out.length >= Number(nStr)) break;
}
console.log(JSON.stringify({tokenize: model.tokenize(text, false), greedy: out}));
process.exit(0);
