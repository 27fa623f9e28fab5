// Drives qkvserve's HTTP API with the official `openai` npm package (test_http.py installs it).
// Usage: node openai_client.mjs BASE_URL MODEL  → one JSON line of what it saw.
import OpenAI from "openai";

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0 });
const out = {};
const greedy = { temperature: 0, ignore_eos: true };

const c = await client.completions.create({ model, prompt: "Hello from the SDK", max_tokens: 8, ...greedy });
out.completion_text = c.choices[0].text;
out.completion_tokens = c.usage.completion_tokens;
out.completion_finish = c.choices[0].finish_reason;

const messages = [{ role: "system", content: "Be brief." }, { role: "user", content: "Hi" }];
const chat = await client.chat.completions.create({ model, messages, max_tokens: 8, logprobs: true, top_logprobs: 2, ...greedy });
out.chat_text = chat.choices[0].message.content;
out.chat_logprobs = chat.choices[0].logprobs.content.length;
out.chat_cached_tokens = chat.usage.prompt_tokens_details.cached_tokens;

const stream = await client.chat.completions.create({
  model, messages, max_tokens: 8, logprobs: true, stream: true, stream_options: { include_usage: true }, ...greedy,
});
let text = "", usage = null, lps = 0;
for await (const chunk of stream) {
  if (chunk.choices.length) {
    text += chunk.choices[0].delta.content ?? "";
    lps += chunk.choices[0].logprobs?.content?.length ?? 0;
  }
  if (chunk.usage) usage = chunk.usage;
}
out.stream_text = text;
out.stream_logprobs = lps;
out.stream_usage_completion_tokens = usage.completion_tokens;

try {
  await client.chat.completions.create({ model, messages, tools: [{ type: "function", function: { name: "f", parameters: {} } }] });
} catch (e) {
  out.bad_request_status = e.status;
  out.bad_request_param = e.param;
}
try {
  await client.completions.create({ model: "no-such-model", prompt: "x" });
} catch (e) {
  out.not_found_status = e.status;
}
console.log(JSON.stringify(out));
