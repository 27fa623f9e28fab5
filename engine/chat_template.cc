#include "engine/chat_template.h"

#include "engine/utf8.h"

namespace qkv {

const char* ChatTemplateName(ChatTemplateKind k) {
  switch (k) {
    case ChatTemplateKind::kPlain: return "plain";
    case ChatTemplateKind::kChatMl: return "chatml";
    case ChatTemplateKind::kLlama3: return "llama3";
  }
  return "plain";
}

StatusOr<ChatTemplateKind> ParseChatTemplate(const std::string& name) {
  if (name == "plain") return ChatTemplateKind::kPlain;
  if (name == "chatml") return ChatTemplateKind::kChatMl;
  if (name == "llama3") return ChatTemplateKind::kLlama3;
  return InvalidArgument("chat template must be plain, chatml or llama3, got '" + name + "'");
}

ChatTemplateKind DetectChatTemplate(const std::string& jinja) {
  if (jinja.find("<|im_start|>") != std::string::npos) return ChatTemplateKind::kChatMl;
  if (jinja.find("<|start_header_id|>") != std::string::npos) return ChatTemplateKind::kLlama3;
  return ChatTemplateKind::kPlain;
}

StatusOr<std::vector<int>> ApplyChatTemplate(ChatTemplateKind k, const Tokenizer& tok,
                                             const std::vector<ChatMessageIn>& messages, bool add_bos) {
  if (messages.empty()) return InvalidArgument("messages is empty");
  std::vector<int> out;
  if (add_bos && tok.bos_id() >= 0) out.push_back(tok.bos_id());
  auto markup = [&](const std::string& s) {  // template text: specials parsed
    const auto ids = tok.Encode(s, /*parse_special=*/true);
    out.insert(out.end(), ids.begin(), ids.end());
  };
  auto content = [&](const std::string& s) {  // user text: never special
    const auto ids = tok.Encode(s, /*parse_special=*/false);
    out.insert(out.end(), ids.begin(), ids.end());
  };
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& m = messages[i];
    if (m.role != "system" && m.role != "user" && m.role != "assistant") {
      return InvalidArgument("messages[" + std::to_string(i) + "].role must be system, user or assistant");
    }
    switch (k) {
      case ChatTemplateKind::kChatMl:
        markup("<|im_start|>" + m.role + "\n");
        content(m.content);
        markup("<|im_end|>\n");
        break;
      case ChatTemplateKind::kLlama3:
        markup("<|start_header_id|>" + m.role + "<|end_header_id|>\n\n");
        content(m.content);
        markup("<|eot_id|>");
        break;
      case ChatTemplateKind::kPlain:
        content((m.role == "user" ? "User: " : m.role == "assistant" ? "Assistant: " : "System: ") + m.content + "\n");
        break;
    }
  }
  switch (k) {
    case ChatTemplateKind::kChatMl: markup("<|im_start|>assistant\n"); break;
    case ChatTemplateKind::kLlama3: markup("<|start_header_id|>assistant<|end_header_id|>\n\n"); break;
    case ChatTemplateKind::kPlain: content("Assistant:"); break;
  }
  return out;
}

StatusOr<std::vector<std::string>> ChatStopStrings(const GgufFile& f) {
  const GgufValue* v = f.Find(kKeyChatStop);
  if (!v) return std::vector<std::string>{};
  const std::string bad =
      std::string("gguf: '") + kKeyChatStop + "' must be an array of 1 to 16 strings of 1..64 bytes of UTF-8";
  if (v->type != GgufType::kArray || v->array_type != GgufType::kString || v->array.empty() || v->array.size() > 16) {
    return DataLoss(bad);
  }
  std::vector<std::string> out;
  for (const GgufValue& e : v->array) {
    if (e.s.empty() || e.s.size() > 64 || !IsValidUtf8(e.s)) return DataLoss(bad);
    out.push_back(e.s);
  }
  return out;
}

}  // namespace qkv
