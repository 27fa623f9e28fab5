// Chat templates: messages → prompt tokens. Built in: ChatML (Qwen), Llama 3, and a plain one for models
// without a template (such as random and the bundled model). The template's own markers are encoded as
// special tokens; message content is always plain text, so "<|im_end|>" typed by a user stays text.
#pragma once

#include <string>
#include <vector>

#include "engine/gguf.h"
#include "engine/status.h"
#include "engine/tokenizer.h"

namespace qkv {

enum class ChatTemplateKind { kPlain, kChatMl, kLlama3 };
const char* ChatTemplateName(ChatTemplateKind k);
StatusOr<ChatTemplateKind> ParseChatTemplate(const std::string& name);
// Picks the built-in template that matches a model's `tokenizer.chat_template` text (plain if none).
ChatTemplateKind DetectChatTemplate(const std::string& jinja);

// The stop strings a model file declares for chat replies (GGUF key `qkvserve.chat.stop`, an array of
// strings; absent: none). Clients such as `qkvctl chat` use them by default (GetModelInfo.chat_stop); the
// bundled model declares the end of a verse. Each must be 1..64 bytes of UTF-8, at most 16 of them.
inline constexpr const char* kKeyChatStop = "qkvserve.chat.stop";
StatusOr<std::vector<std::string>> ChatStopStrings(const GgufFile& f);

struct ChatMessageIn {
  std::string role;
  std::string content;
};

// Formats the conversation and appends the assistant's turn opening. Roles must be system, user or
// assistant; the message index is named in errors.
StatusOr<std::vector<int>> ApplyChatTemplate(ChatTemplateKind k, const Tokenizer& tok,
                                             const std::vector<ChatMessageIn>& messages, bool add_bos);

}  // namespace qkv
