#include "line_table.h"

#include <algorithm>

namespace tbpipe {
namespace {

// DW_LNS_* standard opcodes, DW_LNE_* extended ones.
constexpr uint8_t kCopy = 1, kAdvancePc = 2, kAdvanceLine = 3, kSetFile = 4, kConstAddPc = 8, kFixedAdvancePc = 9;
constexpr uint8_t kEndSequence = 1, kSetAddress = 2;
// DW_LNCT_* content types and the DW_FORM_* codes a DWARF 5 file table uses.
constexpr uint64_t kContentPath = 1, kContentDirectoryIndex = 2;
constexpr uint64_t kFormBlock = 0x09, kFormBlock1 = 0x0a, kFormData1 = 0x0b, kFormData2 = 0x05, kFormData4 = 0x06,
                   kFormData8 = 0x07, kFormData16 = 0x1e, kFormString = 0x08, kFormStrp = 0x0e, kFormLineStrp = 0x1f,
                   kFormUdata = 0x0f, kFormSdata = 0x0d, kFormStrpSup = 0x1d, kFormGnuStrpAlt = 0x1f21;

// A bounds-checked reader: past the end, reads return 0 and `ok` turns false.
class Cursor {
 public:
  Cursor(std::string_view data, size_t pos, bool little_endian) : data_(data), pos_(pos), little_(little_endian) {
    if (pos > data.size()) ok = false;
  }

  bool ok = true;
  size_t pos() const { return pos_; }
  size_t limit() const { return limit_; }
  void set_limit(size_t limit) { limit_ = std::min(limit, data_.size()); }
  bool at_end() const { return pos_ >= limit_; }

  // An unsigned integer of 1..8 bytes.
  uint64_t fixed(size_t bytes) {
    if (bytes > 8 || !take(bytes)) return 0;
    uint64_t value = 0;
    for (size_t i = 0; i < bytes; ++i) {
      const auto byte = static_cast<uint64_t>(static_cast<uint8_t>(data_[pos_ - bytes + i]));
      value = little_ ? value | (byte << (8 * i)) : (value << 8) | byte;
    }
    return value;
  }
  uint8_t u8() { return static_cast<uint8_t>(fixed(1)); }

  uint64_t uleb() {
    unsigned bits = 0;
    uint8_t last = 0;
    return leb128(&bits, &last);
  }

  int64_t sleb() {
    unsigned bits = 0;
    uint8_t last = 0;
    uint64_t value = leb128(&bits, &last);
    if ((last & 0x40) && bits < 64) value |= ~uint64_t{0} << bits;  // sign-extend
    return static_cast<int64_t>(value);
  }

  std::string_view cstring() {
    const size_t end = data_.find('\0', pos_);
    if (end == std::string_view::npos || end >= limit_) {
      ok = false;
      pos_ = limit_;
      return {};
    }
    std::string_view text = data_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return text;
  }

  void skip(uint64_t bytes) { take(bytes); }

 private:
  // The low 64 bits of a LEB128 number; `bits` read and the `last` byte, for sleb().
  uint64_t leb128(unsigned* bits, uint8_t* last) {
    uint64_t value = 0;
    unsigned shift = 0;
    while (take(1)) {
      const auto byte = static_cast<uint8_t>(data_[pos_ - 1]);
      if (shift < 64) value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      shift += 7;
      if (byte < 0x80) {
        *bits = shift;
        *last = byte;
        return value;
      }
    }
    return 0;
  }

  bool take(uint64_t bytes) {
    if (!ok || bytes > limit_ - std::min(pos_, limit_)) {
      ok = false;
      pos_ = limit_;
      return false;
    }
    pos_ += static_cast<size_t>(bytes);
    return true;
  }

  std::string_view data_;
  size_t pos_;
  size_t limit_ = data_.size();
  bool little_;
};

}  // namespace

LineTableIndex::LineTableIndex(std::string_view debug_line, std::string_view debug_line_str, std::string_view debug_str,
                               bool little_endian)
    : line_(debug_line), line_str_(debug_line_str), str_(debug_str), little_endian_(little_endian) {}

std::string_view LineTableIndex::string_at(std::string_view section, uint64_t offset) const {
  if (offset >= section.size()) return {};
  const size_t end = section.find('\0', static_cast<size_t>(offset));
  if (end == std::string_view::npos) return {};
  return section.substr(static_cast<size_t>(offset), end - static_cast<size_t>(offset));
}

bool LineTableIndex::parse_header(size_t offset, LineUnitHeader* header, size_t* next, std::string* error) const {
  Cursor in(line_, offset, little_endian_);
  uint64_t length = in.fixed(4);
  header->offset = offset;
  header->offset_size = 4;
  if (length == 0xffffffffu) {
    length = in.fixed(8);
    header->offset_size = 8;
  }
  if (!in.ok || length > line_.size() - in.pos()) {
    *error = "unit at " + std::to_string(offset) + " runs past the end of .debug_line";
    *next = line_.size();
    return false;
  }
  const size_t unit_end = in.pos() + static_cast<size_t>(length);
  *next = unit_end;
  in.set_limit(unit_end);
  header->version = static_cast<uint16_t>(in.fixed(2));
  if (header->version < 2 || header->version > 5) {
    *error = "unit at " + std::to_string(offset) + " has unsupported version " + std::to_string(header->version);
    return false;
  }
  if (header->version >= 5) {
    header->address_size = in.u8();
    in.u8();  // segment selector size
  }
  const uint64_t header_length = in.fixed(header->offset_size);
  const size_t program_begin = in.pos() + static_cast<size_t>(std::min<uint64_t>(header_length, unit_end));
  header->min_instruction_length = in.u8();
  if (header->version >= 4 && in.u8() != 1) {
    *error = "unit at " + std::to_string(offset) + " is a VLIW line program (several operations per instruction)";
    return false;
  }
  in.u8();  // default_is_stmt: every row counts, as in llvm-symbolizer's lookups
  header->line_base = static_cast<int8_t>(in.u8());
  header->line_range = in.u8();
  header->opcode_base = in.u8();
  if (header->line_range == 0 || header->opcode_base == 0) {
    *error = "unit at " + std::to_string(offset) + " has line_range or opcode_base 0";
    return false;
  }
  header->standard_opcode_lengths.resize(header->opcode_base - 1);
  for (uint8_t& length_of : header->standard_opcode_lengths) length_of = in.u8();

  if (header->version < 5) {
    for (std::string_view dir = in.cstring(); in.ok && !dir.empty(); dir = in.cstring())
      header->directories.emplace_back(dir);
    for (std::string_view name = in.cstring(); in.ok && !name.empty(); name = in.cstring()) {
      const uint64_t dir = in.uleb();
      in.uleb();  // modification time
      in.uleb();  // length
      header->files.emplace_back(std::string(name), dir);
    }
  } else {
    // Directory and file tables described by (content type, form) pairs.
    for (int table = 0; table < 2 && in.ok; ++table) {
      const uint8_t format_count = in.u8();
      std::vector<std::pair<uint64_t, uint64_t>> formats;
      for (uint8_t i = 0; i < format_count && in.ok; ++i) {
        const uint64_t content = in.uleb();
        formats.emplace_back(content, in.uleb());
      }
      const uint64_t count = in.uleb();
      // Every entry takes at least one byte per format: a count the unit cannot hold is damage
      // (and would otherwise grow the tables without reading anything).
      if (count > 0 && (formats.empty() || count > in.limit() - in.pos())) {
        *error = "unit at " + std::to_string(offset) + " has an impossible directory or file count";
        return false;
      }
      for (uint64_t entry = 0; entry < count && in.ok; ++entry) {
        std::string_view path;
        uint64_t directory = 0;
        for (const auto& [content, form] : formats) {
          std::string_view text;
          uint64_t number = 0;
          switch (form) {
            case kFormString:
              text = in.cstring();
              break;
            case kFormLineStrp:
              text = string_at(line_str_, in.fixed(header->offset_size));
              break;
            case kFormStrp:
              text = string_at(str_, in.fixed(header->offset_size));
              break;
            case kFormStrpSup:
            case kFormGnuStrpAlt:
              in.fixed(header->offset_size);
              break;  // in a supplementary file
            case kFormUdata:
              number = in.uleb();
              break;
            case kFormSdata:
              number = static_cast<uint64_t>(in.sleb());
              break;
            case kFormData1:
              number = in.fixed(1);
              break;
            case kFormData2:
              number = in.fixed(2);
              break;
            case kFormData4:
              number = in.fixed(4);
              break;
            case kFormData8:
              number = in.fixed(8);
              break;
            case kFormData16:
              in.skip(16);
              break;
            case kFormBlock:
              in.skip(in.uleb());
              break;
            case kFormBlock1:
              in.skip(in.u8());
              break;
            default:
              *error =
                  "unit at " + std::to_string(offset) + " uses form " + std::to_string(form) + " in its file table";
              return false;
          }
          if (content == kContentPath) path = text;
          if (content == kContentDirectoryIndex) directory = number;
        }
        if (table == 0) {
          header->directories.emplace_back(path);
        } else {
          header->files.emplace_back(std::string(path), directory);
        }
      }
    }
  }
  if (!in.ok) {
    *error = "unit at " + std::to_string(offset) + " has a truncated header";
    return false;
  }
  header->program_begin = std::max(program_begin, in.pos());
  header->program_end = unit_end;
  return header->program_begin <= unit_end;
}

template <typename OnSequence>
bool LineTableIndex::run(const LineUnitHeader& header, size_t begin, std::vector<LineRow>* rows,
                         OnSequence on_sequence) const {
  Cursor in(line_, begin, little_endian_);
  in.set_limit(header.program_end);
  const uint8_t opcode_base = header.opcode_base;
  const uint8_t line_range = header.line_range;
  const uint64_t min_length = header.min_instruction_length;
  const uint64_t const_add = static_cast<uint64_t>((255 - opcode_base) / line_range) * min_length;
  uint64_t address = 0;
  int64_t line = 1;
  uint64_t file = 1;
  bool any_row = false;
  uint64_t first_address = 0;
  size_t sequence_begin = begin;
  auto emit = [&]() {
    if (!any_row) first_address = address;
    any_row = true;
    if (rows != nullptr) {
      const int64_t shown = line < 0 ? 0 : std::min<int64_t>(line, UINT32_MAX);
      rows->push_back({address, static_cast<uint32_t>(file), static_cast<uint32_t>(shown)});
    }
  };
  while (in.ok && !in.at_end()) {
    const uint8_t op = in.u8();
    if (op >= opcode_base) {
      const uint8_t adjusted = op - opcode_base;
      address += (adjusted / line_range) * min_length;
      line = static_cast<int64_t>(static_cast<uint64_t>(line) +
                                  static_cast<uint64_t>(int64_t{header.line_base} + adjusted % line_range));
      emit();
    } else if (op == 0) {
      const uint64_t length = in.uleb();
      if (length == 0) continue;
      const size_t operands_end = in.pos() + static_cast<size_t>(std::min<uint64_t>(length, in.limit() - in.pos()));
      const uint8_t sub = in.u8();
      if (sub == kEndSequence) {
        if (any_row) on_sequence(first_address, address, sequence_begin);
        if (rows != nullptr) return in.ok;
        address = 0, line = 1, file = 1, any_row = false;
        in.skip(operands_end - in.pos());
        sequence_begin = in.pos();
        continue;
      }
      if (sub == kSetAddress) {
        const size_t bytes = length - 1;
        address = bytes <= 8 ? in.fixed(bytes) : 0;
      }
      if (in.pos() < operands_end) in.skip(operands_end - in.pos());
    } else if (op == kCopy) {
      emit();
    } else if (op == kAdvancePc) {
      address += in.uleb() * min_length;
    } else if (op == kAdvanceLine) {
      // Wrapping arithmetic: damaged operands must not overflow a signed integer.
      line = static_cast<int64_t>(static_cast<uint64_t>(line) + static_cast<uint64_t>(in.sleb()));
    } else if (op == kSetFile) {
      file = in.uleb();
    } else if (op == kConstAddPc) {
      address += const_add;
    } else if (op == kFixedAdvancePc) {
      address += in.fixed(2);
    } else {
      // set_column, negate_stmt, basic_block, prologue_end, ... : skip their ULEB operands.
      const uint8_t operands = header.standard_opcode_lengths[op - 1];
      for (uint8_t i = 0; i < operands; ++i) in.uleb();
    }
  }
  return in.ok;
}

void LineTableIndex::build() {
  units_.clear();
  sequences_.clear();
  decoded_.clear();
  size_t offset = 0;
  while (offset + 4 <= line_.size()) {
    LineUnitHeader header;
    size_t next = line_.size();
    std::string error;
    if (!parse_header(offset, &header, &next, &error)) {
      if (problem_.empty()) problem_ = error;
    } else {
      const auto unit = static_cast<uint32_t>(units_.size());
      const bool ok = run(header, header.program_begin, nullptr, [&](uint64_t start, uint64_t end, size_t begin) {
        if (end > start) sequences_.push_back({start, end, unit, begin});
      });
      if (!ok && problem_.empty()) problem_ = "unit at " + std::to_string(offset) + " has a truncated line program";
      units_.push_back(std::move(header));
    }
    if (next <= offset) break;
    offset = next;
  }
  if (offset < line_.size() && problem_.empty() && line_.find_first_not_of('\0', offset) != std::string_view::npos) {
    problem_ = "a truncated unit at " + std::to_string(offset) + " ends .debug_line";
  }
  std::stable_sort(sequences_.begin(), sequences_.end(),
                   [](const Sequence& a, const Sequence& b) { return a.start < b.start; });
  // The linker relocates the line programs of code it discarded (--gc-sections, duplicate
  // COMDAT groups) to address 0, where they would shadow nothing real but answer for low
  // addresses. In a linked module no code starts at 0 (the ELF header is there); only when
  // everything starts at 0 (a relocatable object) are such sequences kept.
  if (!sequences_.empty() && sequences_.back().start > 0) {
    const auto at_zero = [](const Sequence& sequence) { return sequence.start == 0; };
    sequences_.erase(std::remove_if(sequences_.begin(), sequences_.end(), at_zero), sequences_.end());
  }
}

bool LineTableIndex::row(uint64_t address, uint32_t* unit, uint32_t* file, uint32_t* line) {
  const auto after = std::upper_bound(sequences_.begin(), sequences_.end(), address,
                                      [](uint64_t value, const Sequence& s) { return value < s.start; });
  const auto index = static_cast<ptrdiff_t>(after - sequences_.begin()) - 1;
  // Sequences can nest in broken inputs; look back a little for one that ends later.
  for (ptrdiff_t candidate = index; candidate >= 0 && candidate > index - 4; --candidate) {
    const Sequence& sequence = sequences_[static_cast<size_t>(candidate)];
    if (address < sequence.start || address >= sequence.end) continue;
    auto found = decoded_.find(static_cast<size_t>(candidate));
    if (found == decoded_.end()) {
      std::vector<LineRow> rows;
      run(units_[sequence.unit], sequence.program_offset, &rows, [](uint64_t, uint64_t, size_t) {});
      found = decoded_.emplace(static_cast<size_t>(candidate), std::move(rows)).first;
    }
    const std::vector<LineRow>& rows = found->second;
    // The last row at or below the address (of several at one address, the
    // last, as llvm-symbolizer picks).
    const auto above = std::upper_bound(rows.begin(), rows.end(), address,
                                        [](uint64_t value, const LineRow& r) { return value < r.address; });
    if (above == rows.begin()) return false;
    const LineRow& row_found = *std::prev(above);
    *unit = sequence.unit;
    *file = row_found.file;
    *line = row_found.line;
    return true;
  }
  return false;
}

}  // namespace tbpipe
