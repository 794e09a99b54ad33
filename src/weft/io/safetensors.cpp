#include "weft/io/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "weft/core/error.h"

namespace weft::io {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian; big-endian hosts would need byte swaps");

using Json = nlohmann::ordered_json;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // same limit as the reference implementation
constexpr const char* kMetadataKey = "__metadata__";

// Safetensors dtype names <-> ScalarType, for the dtypes we read and write.
struct DtypeName {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16}, {"F64", at::kDouble},
    {"I64", at::kLong},  {"I32", at::kInt},   {"I16", at::kShort},     {"I8", at::kChar},
    {"U8", at::kByte},   {"BOOL", at::kBool},
};

// The safetensors name of `type`, or nullptr if unsupported.
const char* dtype_name(at::ScalarType type) {
  for (const auto& d : kDtypes) {
    if (d.type == type) return d.name;
  }
  return nullptr;
}

// The ScalarType for safetensors dtype `name`, or nullopt if unknown.
c10::optional<at::ScalarType> dtype_from_name(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.type;
  }
  return c10::nullopt;
}

// Message prefix naming the file and (if non-empty) the tensor.
std::string where(const std::string& path, const std::string& tensor = "") {
  std::string s = "safetensors file '" + path + "'";
  if (!tensor.empty()) s += ": tensor '" + tensor + "'";
  return s;
}

std::string errno_text() { return std::strerror(errno); }

// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Closes now, reporting failure (close can surface deferred write errors).
  bool close() {
    int fd = fd_;
    fd_ = -1;
    return ::close(fd) == 0;
  }

 private:
  int fd_;
};

// Read-only private mapping of a whole file; unmaps on destruction. Empty files map nothing.
class Mapping {
 public:
  explicit Mapping(const std::string& path) {
    Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    WEFT_CHECK(fd.get() >= 0, where(path), ": cannot open: ", errno_text());
    struct stat st;
    WEFT_CHECK(::fstat(fd.get(), &st) == 0, where(path), ": cannot stat: ", errno_text());
    WEFT_CHECK(S_ISREG(st.st_mode), where(path), ": not a regular file");
    size_ = static_cast<uint64_t>(st.st_size);
    if (size_ == 0) return;
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    WEFT_CHECK(p != MAP_FAILED, where(path), ": cannot mmap: ", errno_text());
    data_ = static_cast<const uint8_t*>(p);
  }
  ~Mapping() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  // Copies `n` bytes at `p` (inside the mapping) to `dst`, then drops the mapping's pages of
  // them from this process (they stay in the page cache; a later read faults them in again):
  // reading a checkpoint or a Hugging Face file a shard at a time leaves its pages resident only
  // while they are copied, not until the file is closed.
  void copy_out(void* dst, const uint8_t* p, size_t n) const {
    if (n == 0) return;
    std::memcpy(dst, p, n);
    release(p, n);
  }
  // Drops the mapping's pages of `n` bytes at `p` from this process (best effort).
  void release(const uint8_t* p, size_t n) const {
    if (n == 0) return;
    static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const uintptr_t begin = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
    const uintptr_t end = reinterpret_cast<uintptr_t>(p) + n;
    ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);  // best effort
  }

 private:
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// Writes all `n` bytes of `p` to `fd`, retrying on short writes and EINTR.
void write_all(int fd, const void* p, size_t n, const std::string& tmp_path) {
  const auto* b = static_cast<const uint8_t*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, b, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0 && errno == EINTR) continue;
    WEFT_CHECK(w > 0, where(tmp_path), ": write failed: ", errno_text());
    b += w;
    n -= static_cast<size_t>(w);
  }
}

// Best-effort fsync of the directory holding `path`, so the rename itself is durable.
void sync_parent_dir(const std::string& path) {
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// A non-negative JSON integer as u64; `what` names it for the error.
uint64_t json_u64(const Json& j, const std::string& ctx, const char* what) {
  WEFT_CHECK(j.is_number_integer(), ctx, ": ", what, " must be an integer, got ", j.dump());
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  int64_t v = j.get<int64_t>();
  WEFT_CHECK(v >= 0, ctx, ": ", what, " must be non-negative, got ", v);
  return static_cast<uint64_t>(v);
}

// One validated header entry.
struct Entry {
  std::string name;
  at::ScalarType type;
  std::vector<int64_t> shape;
  uint64_t begin;
  uint64_t end;
};

// Validates header entry `name` -> `j` against a data buffer of `data_size` bytes.
Entry parse_entry(const std::string& path, const std::string& name, const Json& j,
                  uint64_t data_size) {
  const std::string ctx = where(path, name);
  WEFT_CHECK(!name.empty(), where(path), ": empty tensor name in header");
  WEFT_CHECK(j.is_object(), ctx, ": header entry must be an object, got ", j.type_name());
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    WEFT_CHECK(j.contains(key), ctx, ": header entry is missing \"", key, "\"");
  }
  Entry e;
  e.name = name;

  const Json& dtype = j.at("dtype");
  WEFT_CHECK(dtype.is_string(), ctx, ": \"dtype\" must be a string, got ", dtype.dump());
  auto type = dtype_from_name(dtype.get<std::string>());
  WEFT_CHECK(type.has_value(), ctx, ": unknown or unsupported dtype ", dtype.dump());
  e.type = *type;

  const Json& shape = j.at("shape");
  WEFT_CHECK(shape.is_array(), ctx, ": \"shape\" must be an array, got ", shape.dump());
  uint64_t numel = 1;
  bool overflow = false;
  for (const Json& d : shape) {
    WEFT_CHECK(d.is_number_integer(), ctx, ": shape dims must be integers, got ", shape.dump());
    WEFT_CHECK(d.is_number_unsigned() || d.get<int64_t>() >= 0, ctx, ": negative dim in shape ",
               shape.dump());
    uint64_t dim = d.get<uint64_t>();
    WEFT_CHECK(dim <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), ctx,
               ": dim too large in shape ", shape.dump());
    e.shape.push_back(static_cast<int64_t>(dim));
    overflow = overflow || __builtin_mul_overflow(numel, dim, &numel);
  }
  uint64_t nbytes = 0;
  overflow = overflow || __builtin_mul_overflow(numel, uint64_t{c10::elementSize(e.type)}, &nbytes);
  WEFT_CHECK(!overflow, ctx, ": byte size of shape ", shape.dump(), " overflows");

  const Json& offsets = j.at("data_offsets");
  WEFT_CHECK(offsets.is_array() && offsets.size() == 2, ctx,
             ": \"data_offsets\" must be an array [begin, end], got ", offsets.dump());
  e.begin = json_u64(offsets[0], ctx, "data_offsets begin");
  e.end = json_u64(offsets[1], ctx, "data_offsets end");
  WEFT_CHECK(e.begin <= e.end, ctx, ": data_offsets [", e.begin, ", ", e.end, "] have begin > end");
  WEFT_CHECK(e.end <= data_size, ctx, ": data_offsets end ", e.end,
             " is past the end of the data buffer (", data_size, " bytes): file truncated?");
  WEFT_CHECK(e.end - e.begin == nbytes, ctx, ": data_offsets span ", e.end - e.begin,
             " bytes but shape ", shape.dump(), " of ", dtype.get<std::string>(), " needs ",
             nbytes);
  return e;
}

}  // namespace

void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata, const WriteTap& tap) {
  WEFT_CHECK(!path.empty(), "save_safetensors: empty path");
  // Validate everything and build the header before touching the file system.
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header[kMetadataKey] = std::move(meta);
  }
  std::set<std::string> seen;
  std::vector<at::Tensor> data;
  data.reserve(tensors.size());
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    WEFT_CHECK(!name.empty(), where(path), ": cannot save a tensor with an empty name");
    const std::string ctx = where(path, name);
    WEFT_CHECK(name != kMetadataKey, ctx, ": name is reserved for metadata");
    WEFT_CHECK(seen.insert(name).second, ctx, ": duplicate tensor name");
    WEFT_CHECK(t.defined(), ctx, ": tensor is undefined");
    WEFT_CHECK(t.device().is_cpu(), ctx, ": tensor must be on CPU, is on ", t.device());
    WEFT_CHECK(t.layout() == at::kStrided, ctx, ": tensor must be strided (dense), has layout ",
               t.layout());
    const char* dname = dtype_name(t.scalar_type());
    WEFT_CHECK(dname != nullptr, ctx, ": unsupported dtype ", t.scalar_type());
    at::Tensor c = t.detach().contiguous();
    const uint64_t nbytes = c.nbytes();
    header[name] = Json{
        {"dtype", dname}, {"shape", c.sizes().vec()}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    data.push_back(std::move(c));
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    WEFT_FAIL(where(path), ": cannot encode header (names and metadata must be UTF-8): ", e.what());
  }
  // Pad with spaces so the data buffer starts 8-byte aligned, like the reference writer.
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * i));

  const std::string tmp = path + ".tmp";
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  WEFT_CHECK(fd.get() >= 0, where(tmp), ": cannot create: ", errno_text());
  const uint64_t file_bytes = sizeof(prefix) + text.size() + offset;
  // Shown to the tap a piece at a time, each just before it is written (still in cache).
  auto write = [&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    constexpr size_t kPiece = size_t{4} << 20;
    for (size_t done = 0; done < n;) {
      const size_t take = tap ? std::min(kPiece, n - done) : n - done;
      if (tap) tap(b + done, take, file_bytes);
      write_all(fd.get(), b + done, take, tmp);
      done += take;
    }
  };
  try {
    write(prefix, sizeof(prefix));
    write(text.data(), text.size());
    for (const at::Tensor& c : data) write(c.data_ptr(), c.nbytes());
    WEFT_CHECK(::fsync(fd.get()) == 0, where(tmp), ": fsync failed: ", errno_text());
    WEFT_CHECK(fd.close(), where(tmp), ": close failed: ", errno_text());
    WEFT_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, where(path), ": cannot rename ", tmp,
               " over it: ", errno_text());
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  sync_parent_dir(path);
}

struct SafetensorsReader::Impl {
  Impl(const std::string& p) : path(p), map(p) {}
  std::string path;
  Mapping map;
  const uint8_t* buffer = nullptr;
  std::vector<Entry> entries;  // data-buffer order
  std::map<std::string, size_t> index;
  std::map<std::string, std::string> metadata;

  // The entry named `name`, after checking the requested float dtype is one.
  const Entry& entry(const std::string& name, c10::optional<at::ScalarType> float_dtype) const {
    WEFT_CHECK(!float_dtype || at::isFloatingType(*float_dtype), where(path),
               ": float_dtype must be a floating type, got ", *float_dtype);
    auto it = index.find(name);
    WEFT_CHECK(it != index.end(), where(path, name), ": no such tensor");
    return entries[it->second];
  }
  // `bytes` as a tensor of the entry's dtype and `shape`, converted to float_dtype when floating.
  at::Tensor tensor(const Entry& e, std::vector<int64_t> shape, const uint8_t* bytes,
                    c10::optional<at::ScalarType> float_dtype) const {
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(e.type));
    map.copy_out(t.data_ptr(), bytes, t.nbytes());
    if (float_dtype && t.is_floating_point() && t.scalar_type() != *float_dtype)
      t = t.to(*float_dtype);
    return t;
  }
};

SafetensorsReader::SafetensorsReader(const std::string& path)
    : impl_(std::make_unique<Impl>(path)) {
  const Mapping& map = impl_->map;
  const uint64_t size = map.size();
  WEFT_CHECK(size >= 8, where(path), ": file is ", size,
             " bytes, too small for the 8-byte header size");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{map.data()[i]} << (8 * i);
  WEFT_CHECK(n <= kMaxHeaderBytes, where(path), ": header size ", n, " exceeds the ",
             kMaxHeaderBytes, "-byte limit");
  WEFT_CHECK(n <= size - 8, where(path), ": header size ", n, " is larger than the rest of the ",
             size, "-byte file (truncated?)");
  const char* text = reinterpret_cast<const char*>(map.data() + 8);
  impl_->buffer = map.data() + 8 + n;
  const uint64_t data_size = size - 8 - n;

  // Parse, noting duplicate top-level keys (JSON allows them; the parser would keep only one).
  std::string duplicate;
  std::set<std::string> keys;
  auto callback = [&](int depth, nlohmann::json::parse_event_t event, Json& parsed) {
    if (depth == 1 && event == nlohmann::json::parse_event_t::key && parsed.is_string()) {
      if (!keys.insert(parsed.get<std::string>()).second && duplicate.empty()) {
        duplicate = parsed.get<std::string>();
      }
    }
    return true;
  };
  Json header = Json::parse(text, text + n, callback, /*allow_exceptions=*/false);
  WEFT_CHECK(!header.is_discarded(), where(path), ": header is not valid JSON");
  WEFT_CHECK(header.is_object(), where(path), ": header must be a JSON object, got ",
             header.type_name());
  WEFT_CHECK(duplicate.empty(), where(path, duplicate), ": duplicate name in header");

  std::vector<Entry>& entries = impl_->entries;
  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey) {
      WEFT_CHECK(value.is_object(), where(path), ": \"__metadata__\" must be an object, got ",
                 value.type_name());
      for (const auto& [k, v] : value.items()) {
        WEFT_CHECK(v.is_string(), where(path), ": metadata value for key '", k,
                   "' must be a string, got ", v.dump());
        impl_->metadata[k] = v.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, name, value, data_size));
  }

  // Data-buffer order; ties (empty tensors) keep header order. Then no two ranges may overlap.
  std::stable_sort(entries.begin(), entries.end(),
                   [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  const Entry* last = nullptr;  // the non-empty entry reaching furthest so far
  for (const Entry& e : entries) {
    if (e.begin == e.end) continue;
    if (last != nullptr) {
      WEFT_CHECK(e.begin >= last->end, where(path, e.name), ": data range [", e.begin, ", ", e.end,
                 ") overlaps tensor '", last->name, "' [", last->begin, ", ", last->end, ")");
    }
    if (last == nullptr || e.end > last->end) last = &e;
  }
  for (size_t k = 0; k < entries.size(); ++k) impl_->index[entries[k].name] = k;
}

SafetensorsReader::~SafetensorsReader() = default;

const std::string& SafetensorsReader::path() const { return impl_->path; }

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  for (const Entry& e : impl_->entries) out.push_back(e.name);
  return out;
}

bool SafetensorsReader::contains(const std::string& name) const {
  return impl_->index.count(name) > 0;
}

std::vector<int64_t> SafetensorsReader::shape(const std::string& name) const {
  auto it = impl_->index.find(name);
  WEFT_CHECK(it != impl_->index.end(), where(impl_->path, name), ": no such tensor");
  return impl_->entries[it->second].shape;
}

at::ScalarType SafetensorsReader::dtype(const std::string& name) const {
  return impl_->entry(name, c10::nullopt).type;
}

const std::map<std::string, std::string>& SafetensorsReader::metadata() const {
  return impl_->metadata;
}

at::Tensor SafetensorsReader::read(const std::string& name,
                                   c10::optional<at::ScalarType> float_dtype) const {
  const Entry& e = impl_->entry(name, float_dtype);
  const uint8_t* src = impl_->buffer + e.begin;
  if (e.type == at::kBool) {
    bool ok = std::all_of(src, src + (e.end - e.begin), [](uint8_t v) { return v <= 1; });
    WEFT_CHECK(ok, where(impl_->path, e.name), ": BOOL tensor holds bytes other than 0 and 1");
  }
  return impl_->tensor(e, e.shape, src, float_dtype);
}

at::Tensor SafetensorsReader::read_rows(const std::string& name, int64_t begin, int64_t count,
                                        c10::optional<at::ScalarType> float_dtype) const {
  const Entry& e = impl_->entry(name, float_dtype);
  WEFT_CHECK(!e.shape.empty() && begin >= 0 && count >= 0 && begin + count <= e.shape[0],
             where(impl_->path, name), ": rows [", begin, ", ", begin + count,
             ") are outside its shape ", at::IntArrayRef(e.shape));
  WEFT_CHECK(e.type != at::kBool, where(impl_->path, name), ": read_rows of a BOOL tensor");
  std::vector<int64_t> shape = e.shape;
  shape[0] = count;
  const uint64_t row_bytes = e.shape[0] > 0 ? (e.end - e.begin) / e.shape[0] : 0;
  return impl_->tensor(e, shape, impl_->buffer + e.begin + begin * row_bytes, float_dtype);
}

void SafetensorsReader::copy_flat(const std::string& name, int64_t begin,
                                  const at::Tensor& dst) const {
  const Entry& e = impl_->entry(name, c10::nullopt);
  const int64_t count = dst.numel();
  const uint64_t elements = (e.end - e.begin) / c10::elementSize(e.type);
  WEFT_CHECK(begin >= 0 && static_cast<uint64_t>(begin + count) <= elements,
             where(impl_->path, name), ": elements [", begin, ", ", begin + count,
             ") are outside its ", elements);
  WEFT_CHECK(e.type != at::kBool && dst.scalar_type() == e.type && dst.device().is_cpu() &&
                 dst.is_contiguous(),
             where(impl_->path, name), ": copy_flat of a ", e.type, " tensor into a ",
             dst.scalar_type(), " one");
  impl_->map.copy_out(dst.data_ptr(), impl_->buffer + e.begin + begin * c10::elementSize(e.type),
                      static_cast<size_t>(count) * c10::elementSize(e.type));
}

uint64_t SafetensorsReader::file_offset(const std::string& name, int64_t element) const {
  const Entry& e = impl_->entry(name, c10::nullopt);
  const uint64_t size = c10::elementSize(e.type);
  WEFT_CHECK(element >= 0 && static_cast<uint64_t>(element) * size <= e.end - e.begin,
             where(impl_->path, name), ": element ", element, " is outside its ",
             (e.end - e.begin) / size);
  return header_bytes() + e.begin + static_cast<uint64_t>(element) * size;
}

uint64_t SafetensorsReader::header_bytes() const {
  return static_cast<uint64_t>(impl_->buffer - impl_->map.data());
}

uint64_t SafetensorsReader::file_bytes() const { return impl_->map.size(); }

void SafetensorsReader::visit_bytes(uint64_t offset, uint64_t n,
                                    const std::function<void(const uint8_t*, size_t)>& f) const {
  const Mapping& map = impl_->map;
  WEFT_CHECK(offset <= map.size() && n <= map.size() - offset, where(impl_->path), ": bytes [",
             offset, ", ", offset + n, ") are outside its ", map.size());
  constexpr uint64_t kPiece = uint64_t{4} << 20;
  for (uint64_t done = 0; done < n;) {
    const size_t take = static_cast<size_t>(std::min(kPiece, n - done));
    const uint8_t* p = map.data() + offset + done;
    f(p, take);
    map.release(p, take);
    done += take;
  }
}

SafetensorsFile load_safetensors(const std::string& path,
                                 c10::optional<at::ScalarType> float_dtype) {
  WEFT_CHECK(!float_dtype || at::isFloatingType(*float_dtype), where(path),
             ": float_dtype must be a floating type, got ", *float_dtype);
  SafetensorsReader reader(path);
  SafetensorsFile out;
  out.metadata = reader.metadata();
  for (const std::string& name : reader.names())
    out.tensors.emplace_back(name, reader.read(name, float_dtype));
  return out;
}

}  // namespace weft::io
