#include "engine/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <thread>

#include "engine/bf16.h"

namespace qkv {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF"
constexpr uint64_t kMaxDims = 4;
constexpr uint64_t kMaxStringBytes = 1ull << 30;
constexpr int kMaxArrayDepth = 2;

// A cursor that refuses to read past the end.
class Cursor {
 public:
  Cursor(const uint8_t* p, uint64_t n) : p_(p), n_(n) {}
  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return n_ - pos_; }
  template <typename T>
  bool Read(T* out) {
    if (remaining() < sizeof(T)) return false;
    std::memcpy(out, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool ReadString(std::string* out) {
    uint64_t len;
    if (!Read(&len) || len > remaining() || len > kMaxStringBytes) return false;
    out->assign(reinterpret_cast<const char*>(p_ + pos_), len);
    pos_ += len;
    return true;
  }

 private:
  const uint8_t* p_;
  uint64_t n_;
  uint64_t pos_ = 0;
};

uint64_t ScalarSize(GgufType t) {
  switch (t) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kBool: return 1;
    case GgufType::kU16:
    case GgufType::kI16: return 2;
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kF32: return 4;
    case GgufType::kU64:
    case GgufType::kI64:
    case GgufType::kF64: return 8;
    case GgufType::kString: return 8;  // at least the length prefix
    case GgufType::kArray: return 12;  // at least type + count
  }
  return 0;
}

bool ValidType(uint32_t t) { return t <= static_cast<uint32_t>(GgufType::kF64); }

Status ReadValue(Cursor& c, GgufType type, GgufValue* v, int depth, const std::string& key) {
  v->type = type;
  auto fail = [&](const char* what) {
    return DataLoss("gguf: metadata '" + key + "': " + what + " at byte " + std::to_string(c.pos()));
  };
  switch (type) {
    case GgufType::kU8: {
      uint8_t x;
      if (!c.Read(&x)) return fail("truncated");
      v->u = x;
      v->i = x;
      return {};
    }
    case GgufType::kI8: {
      int8_t x;
      if (!c.Read(&x)) return fail("truncated");
      v->i = x;
      return {};
    }
    case GgufType::kU16: {
      uint16_t x;
      if (!c.Read(&x)) return fail("truncated");
      v->u = x;
      v->i = x;
      return {};
    }
    case GgufType::kI16: {
      int16_t x;
      if (!c.Read(&x)) return fail("truncated");
      v->i = x;
      return {};
    }
    case GgufType::kU32: {
      uint32_t x;
      if (!c.Read(&x)) return fail("truncated");
      v->u = x;
      v->i = x;
      return {};
    }
    case GgufType::kI32: {
      int32_t x;
      if (!c.Read(&x)) return fail("truncated");
      v->i = x;
      return {};
    }
    case GgufType::kU64: {
      uint64_t x;
      if (!c.Read(&x)) return fail("truncated");
      v->u = x;
      v->i = x > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? -1 : static_cast<int64_t>(x);
      return {};
    }
    case GgufType::kI64: {
      int64_t x;
      if (!c.Read(&x)) return fail("truncated");
      v->i = x;
      return {};
    }
    case GgufType::kF32: {
      float x;
      if (!c.Read(&x)) return fail("truncated");
      v->f = x;
      return {};
    }
    case GgufType::kF64: {
      double x;
      if (!c.Read(&x)) return fail("truncated");
      v->f = x;
      return {};
    }
    case GgufType::kBool: {
      uint8_t x;
      if (!c.Read(&x)) return fail("truncated");
      if (x > 1) return fail("bool is neither 0 nor 1");
      v->u = x;
      return {};
    }
    case GgufType::kString:
      if (!c.ReadString(&v->s)) return fail("bad or truncated string");
      return {};
    case GgufType::kArray: {
      if (depth >= kMaxArrayDepth) return fail("arrays nested too deeply");
      uint32_t et;
      uint64_t n;
      if (!c.Read(&et) || !c.Read(&n)) return fail("truncated array header");
      if (!ValidType(et)) return fail("unknown array element type");
      const auto etype = static_cast<GgufType>(et);
      if (n > c.remaining() / ScalarSize(etype)) return fail("array count larger than the file");
      v->array_type = etype;
      v->array.resize(n);
      for (uint64_t k = 0; k < n; ++k) QKV_RETURN_IF_ERROR(ReadValue(c, etype, &v->array[k], depth + 1, key));
      return {};
    }
  }
  return fail("unknown value type");
}

}  // namespace

bool GgufValue::is_integer() const {
  switch (type) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kU16:
    case GgufType::kI16:
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kU64:
    case GgufType::kI64: return true;
    default: return false;
  }
}

uint64_t GgufTensor::n_elements() const {
  uint64_t n = 1;
  for (uint64_t d : ne) n *= d;
  return n;
}

StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NotFound("gguf: cannot open '" + path + "': " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgument("gguf: '" + path + "' is not a regular file");
  }
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->size_ = static_cast<uint64_t>(st.st_size);
  if (f->size_ > 0) {
    void* m = mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      ::close(fd);
      return Internal("gguf: mmap of '" + path + "' failed: " + std::strerror(errno));
    }
    f->map_ = m;
    f->base_ = static_cast<const uint8_t*>(m);
  }
  ::close(fd);
  Status s = f->ParseImpl();
  if (!s.ok()) return Status(s.code(), s.message() + " (file '" + path + "')");
  return f;
}

StatusOr<std::unique_ptr<GgufFile>> GgufFile::Parse(std::span<const uint8_t> bytes) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->base_ = bytes.data();
  f->size_ = bytes.size();
  QKV_RETURN_IF_ERROR(f->ParseImpl());
  return f;
}

GgufFile::~GgufFile() {
  if (map_) munmap(map_, size_);
}

Status GgufFile::ParseImpl() {
  Cursor c(base_, size_);
  uint32_t magic;
  if (!c.Read(&magic)) return DataLoss("gguf: file too short for a header");
  if (magic != kMagic) return DataLoss("gguf: bad magic (not a GGUF file)");
  if (!c.Read(&version_)) return DataLoss("gguf: truncated header");
  if (version_ != 2 && version_ != 3) {
    return DataLoss("gguf: unsupported version " + std::to_string(version_) + " (expected 3)");
  }
  uint64_t n_tensors, n_kv;
  if (!c.Read(&n_tensors) || !c.Read(&n_kv)) return DataLoss("gguf: truncated header");
  // Each key/value needs >= 8 (key length) + 4 (type) + 1 bytes; each tensor info >= 8 + 4 + 4 + 8.
  if (n_kv > c.remaining() / 13)
    return DataLoss("gguf: metadata count " + std::to_string(n_kv) + " is absurd for the file size");
  if (n_tensors > c.remaining() / 24)
    return DataLoss("gguf: tensor count " + std::to_string(n_tensors) + " is absurd for the file size");

  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key;
    if (!c.ReadString(&key)) return DataLoss("gguf: truncated metadata key #" + std::to_string(k));
    uint32_t t;
    if (!c.Read(&t)) return DataLoss("gguf: truncated metadata '" + key + "'");
    if (!ValidType(t)) return DataLoss("gguf: metadata '" + key + "' has unknown type " + std::to_string(t));
    GgufValue v;
    QKV_RETURN_IF_ERROR(ReadValue(c, static_cast<GgufType>(t), &v, 0, key));
    if (kv_.count(key)) return DataLoss("gguf: duplicate metadata key '" + key + "'");
    kv_.emplace(std::move(key), std::move(v));
  }

  uint64_t alignment = 32;
  if (const GgufValue* a = Find("general.alignment")) {
    if (!a->is_integer() || a->i <= 0 || (a->i & (a->i - 1)) != 0 || a->i > 65536) {
      return DataLoss("gguf: general.alignment must be a power of two");
    }
    alignment = static_cast<uint64_t>(a->i);
  }

  tensors_.resize(n_tensors);
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensor& t = tensors_[k];
    const std::string which = "tensor #" + std::to_string(k);
    if (!c.ReadString(&t.name)) return DataLoss("gguf: truncated name of " + which);
    uint32_t n_dims;
    if (!c.Read(&n_dims)) return DataLoss("gguf: truncated " + which + " ('" + t.name + "')");
    if (n_dims == 0 || n_dims > kMaxDims) {
      return DataLoss("gguf: tensor '" + t.name + "' has " + std::to_string(n_dims) + " dimensions (1-4 allowed)");
    }
    t.ne.resize(n_dims);
    uint64_t n_el = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      if (!c.Read(&t.ne[d])) return DataLoss("gguf: truncated shape of tensor '" + t.name + "'");
      if (t.ne[d] == 0 || t.ne[d] > (1ull << 40) || n_el > (1ull << 42) / t.ne[d]) {
        return DataLoss("gguf: tensor '" + t.name + "' has an absurd shape");
      }
      n_el *= t.ne[d];
    }
    uint32_t type;
    if (!c.Read(&type) || !c.Read(&t.offset)) return DataLoss("gguf: truncated info of tensor '" + t.name + "'");
    t.type = static_cast<GgmlType>(type);
    if (!GgmlTypeKnown(type)) {
      return DataLoss("gguf: tensor '" + t.name + "' has unsupported ggml type " + std::to_string(type) +
                      " (supported: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, "
                      "q6_k, iq4_nl, iq4_xs)");
    }
    if (t.ne[0] % GgmlBlockSize(t.type) != 0) {
      return DataLoss("gguf: tensor '" + t.name + "' row length is not a multiple of its block size");
    }
    t.nbytes = GgmlRowBytes(t.type, t.ne[0]) * (n_el / t.ne[0]);
    if (t.offset % alignment != 0) return DataLoss("gguf: tensor '" + t.name + "' data is misaligned");
    if (tensor_index_.count(t.name)) return DataLoss("gguf: duplicate tensor '" + t.name + "'");
    tensor_index_[t.name] = k;
  }
  used_ = std::vector<std::atomic<bool>>(tensors_.size());
  const uint64_t data_start = (c.pos() + alignment - 1) / alignment * alignment;
  if (data_start > size_ && n_tensors > 0) return DataLoss("gguf: file truncated before the tensor data");
  for (GgufTensor& t : tensors_) {
    if (t.offset > size_ || t.nbytes > size_ - data_start || t.offset > size_ - data_start - t.nbytes) {
      return DataLoss("gguf: tensor '" + t.name + "' data lies beyond the end of the file (truncated?)");
    }
    t.data = base_ + data_start + t.offset;
  }
  return {};
}

const GgufValue* GgufFile::Find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

const GgufTensor* GgufFile::FindTensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufTensor* GgufFile::UseTensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  if (it == tensor_index_.end()) return nullptr;
  used_[it->second].store(true, std::memory_order_relaxed);
  return &tensors_[it->second];
}

std::vector<std::string> GgufFile::UnusedTensors() const {
  std::vector<std::string> out;
  for (size_t k = 0; k < tensors_.size(); ++k) {
    if (!used_[k].load(std::memory_order_relaxed)) out.push_back(tensors_[k].name);
  }
  return out;
}

StatusOr<int64_t> GgufFile::GetInt(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (!v) return NotFound("gguf: missing metadata '" + key + "'");
  if (!v->is_integer()) return InvalidArgument("gguf: metadata '" + key + "' is not an integer");
  if (v->type == GgufType::kU64 && v->i < 0) return InvalidArgument("gguf: metadata '" + key + "' is out of range");
  return v->i;
}

StatusOr<double> GgufFile::GetFloat(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (!v) return NotFound("gguf: missing metadata '" + key + "'");
  if (v->is_float()) return v->f;
  if (v->is_integer()) return static_cast<double>(v->i);
  return InvalidArgument("gguf: metadata '" + key + "' is not a number");
}

StatusOr<bool> GgufFile::GetBool(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (!v) return NotFound("gguf: missing metadata '" + key + "'");
  if (v->type != GgufType::kBool) return InvalidArgument("gguf: metadata '" + key + "' is not a bool");
  return v->u != 0;
}

StatusOr<std::string> GgufFile::GetString(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (!v) return NotFound("gguf: missing metadata '" + key + "'");
  if (v->type != GgufType::kString) return InvalidArgument("gguf: metadata '" + key + "' is not a string");
  return v->s;
}

int64_t GgufFile::GetIntOr(const std::string& key, int64_t dflt) const {
  auto r = GetInt(key);
  return r.ok() ? *r : dflt;
}
double GgufFile::GetFloatOr(const std::string& key, double dflt) const {
  auto r = GetFloat(key);
  return r.ok() ? *r : dflt;
}
bool GgufFile::GetBoolOr(const std::string& key, bool dflt) const {
  auto r = GetBool(key);
  return r.ok() ? *r : dflt;
}
std::string GgufFile::GetStringOr(const std::string& key, const std::string& dflt) const {
  auto r = GetString(key);
  return r.ok() ? *r : dflt;
}

// ---------------------------------------------------------------- writer

namespace {
template <typename T>
void Put(std::vector<uint8_t>& b, T v) {
  const size_t at = b.size();
  b.resize(at + sizeof(T));
  std::memcpy(b.data() + at, &v, sizeof(T));
}
void PutString(std::vector<uint8_t>& b, const std::string& s) {
  Put<uint64_t>(b, s.size());
  b.insert(b.end(), s.begin(), s.end());
}
void PutValue(std::vector<uint8_t>& b, GgufType t, const GgufValue& v) {
  switch (t) {
    case GgufType::kU8: Put<uint8_t>(b, static_cast<uint8_t>(v.u)); return;
    case GgufType::kI8: Put<int8_t>(b, static_cast<int8_t>(v.i)); return;
    case GgufType::kU16: Put<uint16_t>(b, static_cast<uint16_t>(v.u)); return;
    case GgufType::kI16: Put<int16_t>(b, static_cast<int16_t>(v.i)); return;
    case GgufType::kU32: Put<uint32_t>(b, static_cast<uint32_t>(v.u)); return;
    case GgufType::kI32: Put<int32_t>(b, static_cast<int32_t>(v.i)); return;
    case GgufType::kU64: Put<uint64_t>(b, v.u); return;
    case GgufType::kI64: Put<int64_t>(b, v.i); return;
    case GgufType::kF32: Put<float>(b, static_cast<float>(v.f)); return;
    case GgufType::kF64: Put<double>(b, v.f); return;
    case GgufType::kBool: Put<uint8_t>(b, static_cast<uint8_t>(v.u)); return;
    case GgufType::kString: PutString(b, v.s); return;
    case GgufType::kArray:
      Put<uint32_t>(b, static_cast<uint32_t>(v.array_type));
      Put<uint64_t>(b, v.array.size());
      for (const GgufValue& e : v.array) PutValue(b, v.array_type, e);
      return;
  }
}
}  // namespace

void GgufWriter::SetValue(const std::string& key, const GgufValue& v) {
  std::vector<uint8_t> b;
  Put<uint32_t>(b, static_cast<uint32_t>(v.type));
  PutValue(b, v.type, v);
  for (auto& [k, val] : kv_) {
    if (k == key) {
      val = std::move(b);
      return;
    }
  }
  kv_.emplace_back(key, std::move(b));
}

void GgufWriter::SetU32(const std::string& key, uint32_t v) {
  std::vector<uint8_t> b;
  Put<uint32_t>(b, static_cast<uint32_t>(GgufType::kU32));
  Put(b, v);
  kv_.emplace_back(key, std::move(b));
}
void GgufWriter::SetI32(const std::string& key, int32_t v) {
  std::vector<uint8_t> b;
  Put<uint32_t>(b, static_cast<uint32_t>(GgufType::kI32));
  Put(b, v);
  kv_.emplace_back(key, std::move(b));
}
void GgufWriter::SetF32(const std::string& key, float v) {
  std::vector<uint8_t> b;
  Put<uint32_t>(b, static_cast<uint32_t>(GgufType::kF32));
  Put(b, v);
  kv_.emplace_back(key, std::move(b));
}
void GgufWriter::SetBool(const std::string& key, bool v) {
  std::vector<uint8_t> b;
  Put<uint32_t>(b, static_cast<uint32_t>(GgufType::kBool));
  Put<uint8_t>(b, v ? 1 : 0);
  kv_.emplace_back(key, std::move(b));
}
void GgufWriter::SetString(const std::string& key, const std::string& v) {
  std::vector<uint8_t> b;
  Put<uint32_t>(b, static_cast<uint32_t>(GgufType::kString));
  PutString(b, v);
  kv_.emplace_back(key, std::move(b));
}
void GgufWriter::SetStringArray(const std::string& key, const std::vector<std::string>& v) {
  std::vector<uint8_t> b;
  Put<uint32_t>(b, static_cast<uint32_t>(GgufType::kArray));
  Put<uint32_t>(b, static_cast<uint32_t>(GgufType::kString));
  Put<uint64_t>(b, v.size());
  for (const auto& s : v) PutString(b, s);
  kv_.emplace_back(key, std::move(b));
}
void GgufWriter::SetI32Array(const std::string& key, const std::vector<int32_t>& v) {
  std::vector<uint8_t> b;
  Put<uint32_t>(b, static_cast<uint32_t>(GgufType::kArray));
  Put<uint32_t>(b, static_cast<uint32_t>(GgufType::kI32));
  Put<uint64_t>(b, v.size());
  for (int32_t x : v) Put(b, x);
  kv_.emplace_back(key, std::move(b));
}
void GgufWriter::SetF32Array(const std::string& key, const std::vector<float>& v) {
  std::vector<uint8_t> b;
  Put<uint32_t>(b, static_cast<uint32_t>(GgufType::kArray));
  Put<uint32_t>(b, static_cast<uint32_t>(GgufType::kF32));
  Put<uint64_t>(b, v.size());
  for (float x : v) Put(b, x);
  kv_.emplace_back(key, std::move(b));
}
void GgufWriter::AddTensor(const std::string& name, GgmlType type, std::vector<uint64_t> ne,
                           std::vector<uint8_t> data) {
  const uint64_t n = data.size();
  tensors_.push_back({name, type, std::move(ne), std::move(data), nullptr, n});
}

void GgufWriter::AddTensor(const std::string& name, GgmlType type, std::vector<uint64_t> ne, Fill fill) {
  uint64_t rows = 1;
  for (size_t i = 1; i < ne.size(); ++i) rows *= ne[i];
  const uint64_t n = ne.empty() ? 0 : GgmlRowBytes(type, ne[0]) * rows;
  tensors_.push_back({name, type, std::move(ne), {}, std::move(fill), n});
}

namespace {
constexpr uint64_t kWriterAlign = 32;
uint64_t AlignUp(uint64_t n) { return (n + kWriterAlign - 1) / kWriterAlign * kWriterAlign; }
}  // namespace

std::vector<uint8_t> GgufWriter::Header() const {
  std::vector<uint8_t> b;
  Put<uint32_t>(b, kMagic);
  Put<uint32_t>(b, 3);
  Put<uint64_t>(b, tensors_.size());
  Put<uint64_t>(b, kv_.size());
  for (const auto& [key, val] : kv_) {
    PutString(b, key);
    b.insert(b.end(), val.begin(), val.end());
  }
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    PutString(b, t.name);
    Put<uint32_t>(b, static_cast<uint32_t>(t.ne.size()));
    for (uint64_t d : t.ne) Put<uint64_t>(b, d);
    Put<uint32_t>(b, static_cast<uint32_t>(t.type));
    Put<uint64_t>(b, offset);
    offset += AlignUp(t.nbytes);
  }
  b.resize(AlignUp(b.size()), 0);
  return b;
}

std::vector<uint8_t> GgufWriter::Serialize() const {
  std::vector<uint8_t> b = Header();
  for (const Tensor& t : tensors_) {
    const size_t at = b.size();
    if (t.fill) {
      b.resize(at + t.nbytes);
      if (!t.fill(std::span<uint8_t>(b.data() + at, t.nbytes)).ok()) return {};
    } else {
      b.insert(b.end(), t.data.begin(), t.data.end());
    }
    b.resize(AlignUp(b.size()), 0);
  }
  return b;
}

Status GgufWriter::WriteFile(const std::string& path) const {
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  if (!out) return InvalidArgument("cannot write '" + tmp + "'");
  auto fail = [&](Status s) {
    out.close();
    std::remove(tmp.c_str());
    return s;
  };
  auto put = [&](const uint8_t* p, uint64_t n) {
    out.write(reinterpret_cast<const char*>(p), static_cast<std::streamsize>(n));
    return static_cast<bool>(out);
  };
  const std::vector<uint8_t> header = Header();
  if (!put(header.data(), header.size())) return fail(Internal("short write to '" + tmp + "'"));
  static const uint8_t kZeros[kWriterAlign] = {};
  std::vector<uint8_t> buf;  // one tensor at a time
  for (const Tensor& t : tensors_) {
    const uint8_t* p = t.data.data();
    if (t.fill) {
      buf.assign(t.nbytes, 0);
      if (Status s = t.fill(std::span<uint8_t>(buf.data(), buf.size())); !s.ok()) return fail(s);
      p = buf.data();
    }
    if (!put(p, t.nbytes) || !put(kZeros, AlignUp(t.nbytes) - t.nbytes))
      return fail(Internal("short write to '" + tmp + "' (disk full?)"));
  }
  buf = {};
  out.close();
  if (!out) return fail(Internal("short write to '" + tmp + "'"));
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    return fail(Internal("cannot rename '" + tmp + "' to '" + path + "'"));
  return {};
}

// ---------------------------------------------------------------- conversions

Status DequantizeToF32(const GgufTensor& t, float* dst) {
  if (!GgmlTypeKnown(static_cast<uint32_t>(t.type)))
    return DataLoss("gguf: tensor '" + t.name + "' has an unsupported type");
  DequantizeRow(t.type, t.data, static_cast<int64_t>(t.n_elements()), dst);
  return {};
}

std::vector<uint8_t> EncodeFromF32(const float* src, uint64_t n, GgmlType type) {
  std::vector<uint8_t> out(GgmlRowBytes(type, n));
  QuantizeRow(type, src, static_cast<int64_t>(n), out.data());
  return out;
}

void EncodeRowsFromF32(const float* src, uint64_t rows, uint64_t cols, GgmlType type, uint8_t* dst, int threads) {
  const uint64_t rb = GgmlRowBytes(type, cols);
  threads = static_cast<int>(
      std::clamp<uint64_t>(static_cast<uint64_t>(std::max(1, threads)), 1, std::max<uint64_t>(rows, 1)));
  auto run = [&](int th) {
    for (uint64_t r = rows * th / threads; r < rows * (th + 1) / threads; ++r)
      QuantizeRow(type, src + r * cols, static_cast<int64_t>(cols), dst + r * rb);
  };
  std::vector<std::thread> pool;
  for (int th = 1; th < threads; ++th) pool.emplace_back(run, th);
  run(0);
  for (auto& t : pool) t.join();
}

}  // namespace qkv
