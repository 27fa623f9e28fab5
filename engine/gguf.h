// GGUF v3 files: a bounds-checked reader over an mmap'd file and a writer.
//
// Layout (little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64, the metadata
// key/values, the tensor infos (name, n_dims, ne[n_dims], ggml type, offset), padding to
// `general.alignment` (default 32), then the tensor data. ne[0] is the fastest-varying dimension, so a
// PyTorch weight of shape [out, in] is stored with ne = {in, out}.
//
// The reader never trusts the file: every length, count, shape and offset is checked against the bytes
// actually present before it is used, and a malformed file gives a DATA_LOSS / INVALID_ARGUMENT Status
// naming the problem.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/quant.h"
#include "engine/status.h"

namespace qkv {

enum class GgufType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

// One metadata value. Scalars live in the member for their kind; arrays hold their elements in
// `array` with `array_type` giving the element kind.
struct GgufValue {
  GgufType type = GgufType::kU32;
  uint64_t u = 0;  // unsigned integers and bool
  int64_t i = 0;   // signed integers (unsigned ones are mirrored here when they fit)
  double f = 0;    // floats
  std::string s;   // strings
  GgufType array_type = GgufType::kU32;
  std::vector<GgufValue> array;

  bool is_integer() const;
  bool is_float() const { return type == GgufType::kF32 || type == GgufType::kF64; }
};

struct GgufTensor {
  std::string name;
  std::vector<uint64_t> ne;  // ne[0] fastest
  GgmlType type = GgmlType::kF32;
  uint64_t offset = 0;  // relative to the data section
  const uint8_t* data = nullptr;
  uint64_t nbytes = 0;
  uint64_t n_elements() const;
};

class GgufFile {
 public:
  // Maps and parses the file. The mapping lives as long as the GgufFile.
  static StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses an in-memory image (the bytes must outlive the result). Used by tests and fuzzing.
  static StatusOr<std::unique_ptr<GgufFile>> Parse(std::span<const uint8_t> bytes);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  uint32_t version() const { return version_; }
  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufValue* Find(const std::string& key) const;
  const GgufTensor* FindTensor(const std::string& name) const;
  // FindTensor for a tensor the caller computes with: marks it used (UnusedTensors). Probes for a tensor's
  // presence use FindTensor.
  const GgufTensor* UseTensor(const std::string& name) const;
  // The tensors no UseTensor asked for, in file order: a model loader that leaves one unused would compute
  // something other than the model.
  std::vector<std::string> UnusedTensors() const;

  // Typed metadata accessors: NotFound if absent, InvalidArgument if of the wrong kind or range.
  StatusOr<int64_t> GetInt(const std::string& key) const;
  StatusOr<double> GetFloat(const std::string& key) const;
  StatusOr<bool> GetBool(const std::string& key) const;
  StatusOr<std::string> GetString(const std::string& key) const;
  int64_t GetIntOr(const std::string& key, int64_t dflt) const;
  double GetFloatOr(const std::string& key, double dflt) const;
  bool GetBoolOr(const std::string& key, bool dflt) const;
  std::string GetStringOr(const std::string& key, const std::string& dflt) const;

  uint64_t file_size() const { return size_; }

 private:
  GgufFile() = default;
  Status ParseImpl();

  void* map_ = nullptr;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  uint32_t version_ = 0;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t> tensor_index_;
  mutable std::vector<std::atomic<bool>> used_;  // [tensor]: asked for by UseTensor (loaders may be threaded)
};

// Builds a GGUF v3 file in memory and writes it out.
class GgufWriter {
 public:
  void SetU32(const std::string& key, uint32_t v);
  void SetI32(const std::string& key, int32_t v);
  void SetF32(const std::string& key, float v);
  void SetBool(const std::string& key, bool v);
  void SetString(const std::string& key, const std::string& v);
  void SetStringArray(const std::string& key, const std::vector<std::string>& v);
  void SetI32Array(const std::string& key, const std::vector<int32_t>& v);
  void SetF32Array(const std::string& key, const std::vector<float>& v);
  // Any value as read (copying metadata from one file to another).
  void SetValue(const std::string& key, const GgufValue& v);
  // Adds a tensor; `ne` is ggml order (fastest first) and `data` must hold exactly its bytes.
  void AddTensor(const std::string& name, GgmlType type, std::vector<uint64_t> ne, std::vector<uint8_t> data);
  // Adds a tensor whose bytes are made only when the file is written, one tensor at a time in the order they were
  // added: `fill` gets exactly the tensor's bytes (from its type and shape) to write. A model of any size is
  // then written holding one tensor, not the whole file twice.
  using Fill = std::function<Status(std::span<uint8_t> dst)>;
  void AddTensor(const std::string& name, GgmlType type, std::vector<uint64_t> ne, Fill fill);
  // The whole file in memory (fills run; a failing fill gives an empty vector): for tests and small files.
  std::vector<uint8_t> Serialize() const;
  // Streams the file to `path` through `path`.tmp, renamed into place once complete (a run cut short leaves no
  // file that looks whole). Runs the fills.
  Status WriteFile(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<uint64_t> ne;
    std::vector<uint8_t> data;
    Fill fill;  // when set, data is empty and the bytes come from it
    uint64_t nbytes = 0;
  };
  std::vector<uint8_t> Header() const;                            // metadata and tensor infos, padded to the alignment
  std::vector<std::pair<std::string, std::vector<uint8_t>>> kv_;  // key and encoded (type + value)
  std::vector<Tensor> tensors_;
};

// Converts a tensor of any supported type to f32 (dst must hold n_elements()).
Status DequantizeToF32(const GgufTensor& t, float* dst);
// Encodes f32 values as `type` (for the writer).
std::vector<uint8_t> EncodeFromF32(const float* src, uint64_t n, GgmlType type);
// Encodes rows x cols f32 values as `type` into dst (rows x GgmlRowBytes(type, cols)), rows split over `threads`
// threads (each row is encoded alone, so the bytes do not depend on the thread count).
void EncodeRowsFromF32(const float* src, uint64_t rows, uint64_t cols, GgmlType type, uint8_t* dst, int threads);

}  // namespace qkv
