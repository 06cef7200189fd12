#include "parquet_pages.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>

namespace tbpipe {
namespace {

// Thrift compact protocol type codes (1 and 2 are booleans whose value is the code itself).
enum : uint8_t {
  kBoolTrue = 1,
  kBoolFalse = 2,
  kByte = 3,
  kI16 = 4,
  kI32 = 5,
  kI64 = 6,
  kDouble = 7,
  kBinary = 8,
  kList = 9,
  kSet = 10,
  kMap = 11,
  kStruct = 12,
};
constexpr int kMaxNesting = 16;  // PageHeader nests two levels; deeper is damage, not a reason to recurse
// parquet.thrift's PageType, and the PageHeader field holding each type's own header.
constexpr int64_t kDataPage = 0, kDictionaryPage = 2, kDataPageV2 = 3;
constexpr int16_t kDataHeaderField = 5, kDictionaryHeaderField = 7, kDataV2HeaderField = 8;
constexpr int64_t kRle = 3, kBitPacked = 4;  // the encodings levels may be in

struct Damage : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr int64_t kAbsent = INT64_MIN;

// What one page header says (fields a page header may leave out are kAbsent).
struct Header {
  int64_t type = kAbsent, uncompressed = kAbsent, size = kAbsent, crc = -1, values = kAbsent;
  int sub_headers = 0;
  int16_t sub_header = -1;  // the field of the first type-specific header
  int encodings = 0;
  int64_t encoding = kAbsent;  // the first
  bool levels_known = true;    // every level encoding RLE or BIT_PACKED
  int64_t level_bytes_min = 0, level_bytes_sum = 0;
};

class CompactReader {
 public:
  CompactReader(const uint8_t* data, size_t pos, size_t end) : data_(data), pos_(pos), end_(end) {}

  size_t pos() const { return pos_; }
  bool done() const { return pos_ >= end_; }

  uint8_t byte() {
    if (pos_ >= end_) throw Damage("a page header runs past its column chunk");
    return data_[pos_++];
  }

  uint64_t varint() {
    uint64_t result = 0;
    for (int shift = 0;; shift += 7) {
      if (shift > 63) throw Damage("a page header holds a malformed number");
      const uint8_t next = byte();
      if (shift == 63 && next > 1) throw Damage("a page header holds a malformed number");
      result |= static_cast<uint64_t>(next & 0x7F) << shift;
      if (next < 0x80) return result;
    }
  }

  int64_t zigzag() {
    const uint64_t value = varint();
    return static_cast<int64_t>(value >> 1) ^ -static_cast<int64_t>(value & 1);
  }

  void advance(int64_t count) {
    if (count < 0 || static_cast<uint64_t>(count) > end_ - pos_) {
      throw Damage("a page header runs past its column chunk");
    }
    pos_ += static_cast<size_t>(count);
  }

  // The next field of a struct: false at its stop byte; else its id and type.
  bool field(int16_t& id, uint8_t& type) {
    const uint8_t header = byte();
    if (header == 0) return false;
    const uint8_t delta = header >> 4;
    id = delta ? static_cast<int16_t>(id + delta) : static_cast<int16_t>(zigzag());
    type = header & 0x0F;
    return true;
  }

  void skip(uint8_t type, int depth, bool in_collection = false) {
    if (depth > kMaxNesting) throw Damage("a page header nests too deep");
    switch (type) {
      case kBoolTrue:
      case kBoolFalse:
        if (in_collection) advance(1);  // a collection's booleans take a byte each; a field's is in its header
        return;
      case kByte:
        advance(1);
        return;
      case kI16:
      case kI32:
      case kI64:
        varint();
        return;
      case kDouble:
        advance(8);
        return;
      case kBinary:
        advance(static_cast<int64_t>(varint() & INT64_MAX));
        return;
      case kList:
      case kSet: {
        const uint8_t header = byte();
        uint64_t size = header >> 4;
        if (size == 15) size = varint();
        // Each element takes at least a byte: a damaged size ends at the chunk's end.
        for (uint64_t i = 0; i < size; ++i) skip(header & 0x0F, depth + 1, true);
        return;
      }
      case kMap: {
        const uint64_t size = varint();
        if (size == 0) return;
        const uint8_t types = byte();
        for (uint64_t i = 0; i < size; ++i) {
          skip(types >> 4, depth + 1, true);
          skip(types & 0x0F, depth + 1, true);
        }
        return;
      }
      case kStruct: {
        int16_t id = 0;
        uint8_t field_type = 0;
        while (field(id, field_type)) skip(field_type, depth + 1);
        return;
      }
      default:
        throw Damage("a page header holds an unknown field type " + std::to_string(type));
    }
  }

  // PageHeader: 1 type, 2 uncompressed size, 3 compressed size, 4 CRC, then one of 5 (data page),
  // 7 (dictionary page) or 8 (data page v2) headers.
  Header page_header() {
    Header header;
    int16_t id = 0;
    uint8_t type = 0;
    while (field(id, type)) {
      if (type == kI32 && id >= 1 && id <= 4) {
        const int64_t value = zigzag();
        if (id == 1) {
          header.type = value;
        } else if (id == 2) {
          header.uncompressed = value;
        } else if (id == 3) {
          header.size = value;
        } else {
          header.crc = value & 0xFFFFFFFF;
        }
      } else if (type == kStruct &&
                 (id == kDataHeaderField || id == kDictionaryHeaderField || id == kDataV2HeaderField)) {
        if (header.sub_headers++ == 0) header.sub_header = id;
        type_header(header, id);
      } else {
        skip(type, 1);
      }
    }
    if (header.size == kAbsent || header.size < 0 || header.uncompressed == kAbsent || header.uncompressed < 0) {
      throw Damage("a page header gives no page size");
    }
    return header;
  }

 private:
  // DataPageHeader (5: 1 values, 2 encoding, 3/4 level encodings), DictionaryPageHeader (7: 1 values,
  // 2 encoding) or DataPageHeaderV2 (8: 1 values, 4 encoding, 5/6 level byte lengths).
  void type_header(Header& header, int16_t which) {
    const int16_t encoding_field = which == kDataV2HeaderField ? 4 : 2;
    int16_t id = 0;
    uint8_t type = 0;
    while (field(id, type)) {
      if (type != kI32) {
        skip(type, 2);
        continue;
      }
      const int64_t value = zigzag();
      if (id == 1) {
        header.values = value;
      } else if (id == encoding_field) {
        if (header.encodings++ == 0) header.encoding = value;
      } else if (which == kDataHeaderField && (id == 3 || id == 4)) {
        header.levels_known = header.levels_known && (value == kRle || value == kBitPacked);
      } else if (which == kDataV2HeaderField && (id == 5 || id == 6)) {
        header.level_bytes_min = std::min(header.level_bytes_min, value);
        if (__builtin_add_overflow(header.level_bytes_sum, value, &header.level_bytes_sum)) {
          header.level_bytes_sum = INT64_MAX;  // longer than any page
        }
      }
    }
  }

  const uint8_t* data_;
  size_t pos_;
  size_t end_;
};

// What a page header says that cannot be; empty when nothing.
std::string header_problem(const Header& header, bool dictionary_expected, uint32_t encoding_mask) {
  int16_t sub_header = -1;
  if (header.type == kDataPage) sub_header = kDataHeaderField;
  if (header.type == kDictionaryPage) sub_header = kDictionaryHeaderField;
  if (header.type == kDataPageV2) sub_header = kDataV2HeaderField;
  if (sub_header < 0 || header.sub_headers != 1 || header.sub_header != sub_header) {
    return "a page of unknown type " + (header.type == kAbsent ? std::string("None") : std::to_string(header.type));
  }
  if ((header.type == kDictionaryPage) != dictionary_expected) {
    return dictionary_expected ? "no dictionary page first" : "a dictionary page where a data page belongs";
  }
  // (num_values is a Thrift i32: a larger count is damage too, and could not be summed safely.)
  if (header.values == kAbsent || header.values < 0 || header.values > INT32_MAX)
    return "a page without its count of values";
  if (header.encodings != 1 || header.encoding < 0 || header.encoding > 31 ||
      !(encoding_mask & (uint32_t{1} << header.encoding))) {
    return "a page in an encoding its column chunk does not list";
  }
  if (!header.levels_known) return "levels in an unknown encoding";
  if (header.type == kDataPageV2 && (header.level_bytes_min < 0 || header.level_bytes_sum > header.size)) {
    return "levels longer than their page";
  }
  return {};
}

// CRC-32 by eight bytes at a time ("slicing by 8"): table[k][b] is the CRC of byte b followed by k
// zero bytes. Built at compile time from the reflected polynomial.
struct Crc32Tables {
  uint32_t table[8][256];
  constexpr Crc32Tables() : table{} {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t crc = b;
      for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
      table[0][b] = crc;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      for (int k = 1; k < 8; ++k) table[k][b] = (table[k - 1][b] >> 8) ^ table[0][table[k - 1][b] & 0xFF];
    }
  }
};
constexpr Crc32Tables kCrc32;

}  // namespace

uint32_t crc32(const uint8_t* bytes, size_t size) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the eight-byte steps load little-endian words");
  const auto& t = kCrc32.table;
  uint32_t crc = 0xFFFFFFFFu;
  for (; size >= 8; bytes += 8, size -= 8) {
    uint32_t low = 0, high = 0;
    std::memcpy(&low, bytes, 4);  // little-endian loads (x86-64, aarch64)
    std::memcpy(&high, bytes + 4, 4);
    low ^= crc;
    crc = t[7][low & 0xFF] ^ t[6][(low >> 8) & 0xFF] ^ t[5][(low >> 16) & 0xFF] ^ t[4][low >> 24] ^ t[3][high & 0xFF] ^
          t[2][(high >> 8) & 0xFF] ^ t[1][(high >> 16) & 0xFF] ^ t[0][high >> 24];
  }
  for (; size > 0; ++bytes, --size) crc = (crc >> 8) ^ t[0][(crc ^ *bytes) & 0xFF];
  return crc ^ 0xFFFFFFFFu;
}

ChunkChecksums chunk_checksums(const uint8_t* data, size_t start, size_t end, bool has_dictionary,
                               uint32_t encoding_mask) {
  ChunkPages pages = chunk_pages(data, start, end, has_dictionary, encoding_mask);
  ChunkChecksums out;
  out.values = pages.values;
  out.problem = std::move(pages.problem);
  out.problem_at = pages.problem_at;
  for (const PageSpanRecord& page : pages.pages) {
    // chunk_pages keeps every page inside [start, end): body <= end <= the chunk's end.
    if (page.crc < 0) {
      out.verdict = ChecksumVerdict::kUnchecked;
    } else if (crc32(data + page.body, static_cast<size_t>(page.end - page.body)) != page.crc) {
      out.verdict = ChecksumVerdict::kMismatch;
    } else {
      continue;
    }
    out.page_at = page.header;
    return out;
  }
  return out;
}

ChunkPages chunk_pages(const uint8_t* data, size_t start, size_t end, bool has_dictionary, uint32_t encoding_mask) {
  ChunkPages out;
  CompactReader reader(data, start, end);
  bool first = true;
  while (!reader.done()) {
    const size_t at = reader.pos();
    try {
      const Header header = reader.page_header();
      const size_t body = reader.pos();
      reader.advance(header.size);
      std::string problem = header_problem(header, first && has_dictionary, encoding_mask);
      if (!problem.empty()) throw Damage(problem);
      if (header.type != kDictionaryPage) out.values += header.values;
      out.pages.push_back(
          {static_cast<int64_t>(at), static_cast<int64_t>(body), static_cast<int64_t>(reader.pos()), header.crc});
    } catch (const Damage& damage) {
      out.problem = damage.what();
      out.problem_at = static_cast<int64_t>(at);
      return out;
    }
    first = false;
  }
  return out;
}

}  // namespace tbpipe
