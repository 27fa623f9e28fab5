// Unicode NFC normalization (the `NFC` normalizer of Hugging Face tokenizers, used by Qwen), from tables
// generated out of Python's unicodedata (tools/unicode/gen_nfc_tables.py).
#pragma once

#include <string>
#include <string_view>

namespace qkv {

// The NFC form of a UTF-8 string. Invalid UTF-8 bytes are passed through unchanged.
std::string NfcNormalize(std::string_view utf8);

}  // namespace qkv
