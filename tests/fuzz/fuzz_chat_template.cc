// libFuzzer target: chat templates. The input is a template choice byte, then role\0content\0role\0...
// Checks: a refused conversation names a message; an accepted one has exactly one template opening per
// message plus the assistant's (message content is text, so "<|im_start|>" typed by a user never becomes
// the special token); every id is in the vocabulary. Template detection and parsing take any text.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/chat_template.h"
#include "engine/tokenizer.h"
#include "engine/tokenizer_bpe.h"
#include "engine/utf8.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

const char* kMarkers[] = {"<|im_start|>",      "<|im_end|>", "<|start_header_id|>",
                          "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>"};

struct Vocab {
  std::unique_ptr<qkv::Tokenizer> tok;
  std::vector<int> marker_ids;  // kMarkers' ids
};

Vocab& TheVocab() {
  static Vocab v = [] {
    auto b = qkv::MakeSyntheticByteBpe(600, 3);
    Check(b.ok());
    std::vector<std::string> tokens = b->tokens;
    std::vector<int32_t> types = b->types;
    Vocab out;
    for (const char* m : kMarkers) {
      out.marker_ids.push_back(static_cast<int>(tokens.size()));
      tokens.push_back(m);
      types.push_back(3);
    }
    auto t = qkv::MakeByteBpeTokenizer(
        tokens, types, b->merges, out.marker_ids.back(), b->eos_id, true,
        {R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"}, false);
    Check(t.ok());
    out.tok = std::move(*t);
    return out;
  }();
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string rest(reinterpret_cast<const char*>(data + 1), size - 1);
  (void)qkv::ParseChatTemplate(rest);
  (void)qkv::DetectChatTemplate(rest);
  const auto kind = static_cast<qkv::ChatTemplateKind>(data[0] % 3);
  const bool add_bos = data[0] & 0x80;
  std::vector<qkv::ChatMessageIn> messages;
  size_t start = 0;
  std::vector<std::string> parts;
  for (size_t i = 0; i <= rest.size(); ++i) {
    if (i == rest.size() || rest[i] == '\0') {
      parts.push_back(rest.substr(start, i - start));
      start = i + 1;
    }
  }
  for (size_t i = 0; i + 1 < parts.size(); i += 2) {
    if (!qkv::IsValidUtf8(parts[i + 1])) return 0;  // the server refuses invalid UTF-8 content
    messages.push_back({parts[i], parts[i + 1]});
  }
  Vocab& v = TheVocab();
  auto ids = qkv::ApplyChatTemplate(kind, *v.tok, messages, add_bos);
  if (!ids.ok()) {
    Check(messages.empty() || ids.status().message().find("messages[") != std::string::npos);
    return 0;
  }
  int openings = 0;
  for (int id : *ids) {
    Check(id >= 0 && id < v.tok->vocab_size());
    if (kind == qkv::ChatTemplateKind::kChatMl && id == v.marker_ids[0]) ++openings;
    if (kind == qkv::ChatTemplateKind::kLlama3 && id == v.marker_ids[2]) ++openings;
    if (kind == qkv::ChatTemplateKind::kPlain) {
      for (int m : v.marker_ids) Check(id != m || (add_bos && id == v.marker_ids.back()));
    }
  }
  if (kind != qkv::ChatTemplateKind::kPlain) Check(openings == static_cast<int>(messages.size()) + 1);
  return 0;
}
