// libFuzzer target: the GGUF reader and everything that reads a parsed file's metadata (model config,
// tokenizer loader) and tensors (dequantization). A file may be refused, never crash or read out of bounds.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/gguf.h"
#include "engine/model_config.h"
#include "engine/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto f = qkv::GgufFile::Parse(std::span<const uint8_t>(data, size));
  if (!f.ok()) return 0;
  const qkv::GgufFile& g = **f;
  (void)qkv::ModelConfig::FromGguf(g);
  if (auto tok = qkv::LoadTokenizerFromGguf(g); tok.ok()) {
    const auto ids = (*tok)->Encode("In the beginning <|endoftext|> 123", true);
    (void)(*tok)->Decode(ids);
  }
  for (const qkv::GgufTensor& t : g.tensors()) {
    const uint64_t n = t.n_elements();
    if (n == 0 || n > (1u << 20)) continue;  // dequantize small tensors only (time per input)
    std::vector<float> out(n);
    (void)qkv::DequantizeToF32(t, out.data());
  }
  return 0;
}
