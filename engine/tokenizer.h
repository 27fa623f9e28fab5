// Text <-> token ids. The Tokenizer interface is what the engine, tools and server use; concrete
// tokenizers are built from a GGUF file's `tokenizer.ggml.*` metadata or from a Hugging Face
// tokenizer.json.
//
// Two families: byte-level BPE (`tokenizer.ggml.model = gpt2`: GPT-2, Llama 3, Qwen pre-tokenizers, via
// PCRE2 with UTF and Unicode properties so that \p{L} and \p{N} are real Unicode classes) and
// SentencePiece-style BPE with byte fallback (`tokenizer.ggml.model = llama`). See docs/tokenizers.md.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/gguf.h"
#include "engine/status.h"

namespace qkv {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Encodes text. Special-token text (e.g. "<|endoftext|>") is plain text unless parse_special is set.
  // Adds no BOS/EOS; callers add them with add_bos() / bos_id().
  virtual std::vector<int> Encode(std::string_view text, bool parse_special = false) const = 0;
  // The raw bytes of one token (may be part of a UTF-8 character). Out-of-range ids give "".
  virtual const std::string& TokenBytes(int id) const = 0;
  virtual int vocab_size() const = 0;
  virtual bool IsSpecial(int id) const = 0;
  int bos_id() const { return bos_id_; }
  int eos_id() const { return eos_id_; }
  bool add_bos() const { return add_bos_; }
  // The tokens that end generation, sorted (llama.cpp's end-of-generation set): EOS, the file's end-of-turn and
  // end-of-message tokens, and every token whose text is an end-of-turn marker ("<|im_end|>", "<|eot_id|>",
  // "<|endoftext|>", "<｜end▁of▁sentence｜>", …; docs/tokenizers.md). A chat model whose EOS is another token
  // still stops at the end of its turn.
  const std::vector<int>& eog_ids() const { return eog_ids_; }
  bool IsEndOfGeneration(int id) const;
  // Sets eog_ids from EOS, `extra` (ids inside the vocabulary) and the token texts; the loaders call it.
  void SetEndOfGeneration(const std::vector<int>& extra);
  // Concatenated token bytes (specials included).
  std::string Decode(std::span<const int> ids) const;

 protected:
  int bos_id_ = -1;
  int eos_id_ = -1;
  bool add_bos_ = false;
  std::vector<int> eog_ids_;
};

// From GGUF `tokenizer.ggml.*`: model gpt2 with llama.cpp's pre-tokenizer names (docs/tokenizers.md) or model
// llama (SentencePiece-style); end of generation also from `tokenizer.ggml.eot_token_id` / `eom_token_id`.
StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerFromGguf(const GgufFile& f);
// From a Hugging Face tokenizer.json: byte-level BPE with Split/Digits/ByteLevel pre-tokenizers in sequence,
// the NFC normalizer, added tokens (matched only with parse_special) and ignore_merges; or
// SentencePiece-style BPE (byte_fallback, Prepend/Replace "▁" normalizer) as Llama 2 uses. tokenizer_config.json
// beside it names BOS/EOS; generation_config.json beside it adds its eos_token_id (one or a list) to the
// end-of-generation set.
StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerFromJson(const std::string& path);

// A byte-level BPE vocabulary in GGUF form: token strings in GPT-2's byte-to-unicode alphabet, token
// types (1 normal, 3 control) and merges "a b" in rank order.
struct BpeVocab {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<std::string> merges;
  int eos_id = -1;
  void ToGguf(GgufWriter& w) const;
};

// A deterministic vocabulary of exactly vocab_size entries (>= 257): the 256 byte tokens, synthetic
// merges of letters and space-prefixed letters, and "<|endoftext|>" as the last id (EOS and BOS).
StatusOr<BpeVocab> MakeSyntheticByteBpe(int vocab_size, uint64_t seed);

// GPT-2's reversible map from bytes to printable code points (as UTF-8 strings).
const std::vector<std::string>& ByteToUnicode();

}  // namespace qkv
