// A foreign client: @grpc/grpc-js with @grpc/proto-loader runs a streaming generate and a two-turn session.
// Usage: node node_client.mjs ADDR PROTO_DIR   (prints one JSON line; exits non-zero on failure)
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const [addr, protoDir] = process.argv.slice(2);
const def = protoLoader.loadSync("qkvserve/v1/inference.proto", {includeDirs: [protoDir], keepCase: true, longs: Number, defaults: true});
const pkg = grpc.loadPackageDefinition(def).qkvserve.v1;
const client = new pkg.Inference(addr, grpc.credentials.createInsecure());

function unary(method, req, md = new grpc.Metadata()) {
  return new Promise((resolve, reject) => client[method](req, md, (err, res) => (err ? reject(err) : resolve(res))));
}

function generate(req, md = new grpc.Metadata()) {
  return new Promise((resolve, reject) => {
    const out = {text: "", token_ids: [], responses: 0, last: null};
    const call = client.Generate(req, md);
    call.on("data", (r) => {
      out.responses++;
      out.text += r.text;
      out.token_ids.push(...r.token_ids);
      if (r.finish_reason) out.last = r;
    });
    call.on("error", reject);
    call.on("end", () => resolve(out));
  });
}

const g = await generate({text: "Hello from node", max_tokens: 6, temperature: 0});
if (g.token_ids.length !== 6 || g.last.finish_reason !== "length") throw new Error("bad generate: " + JSON.stringify(g));
const sid = "node-session";
const md = new grpc.Metadata();
md.set("x-session-id", sid);
await unary("CreateSession", {session_id: sid}, md);
const t1 = await generate({text: "first turn", session_id: sid, max_tokens: 4, temperature: 0}, md);
const t2 = await generate({text: " second turn", session_id: sid, max_tokens: 4, temperature: 0}, md);
if (!(t2.last.usage.cached_tokens > 0)) throw new Error("second turn did not reuse the session: " + JSON.stringify(t2.last));
await unary("CloseSession", {session_id: sid}, md);
console.log(JSON.stringify({generate_tokens: g.token_ids.length, turn1: t1.last.usage, turn2: t2.last.usage}));
client.close();
