// DWARF line tables (.debug_line, versions 2-5) for the addresses a SymCache
// cannot place on a line: code without a DWARF function, alignment padding.
//
// symbolic's SymCache keeps line records only inside DWARF functions, and no
// library at hand exposes the raw line-table rows cheaply (pyelftools builds
// an object per opcode: seconds for libpython). One pass over .debug_line
// indexes every sequence (address range, where its opcodes start); a lookup
// decodes just the sequence that covers the address, once. Every read is
// bounds-checked: a damaged section ends that unit with an error, never a
// crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tbpipe {

struct LineUnitHeader {
  uint64_t offset = 0;  // of the unit in .debug_line
  uint16_t version = 0;
  uint8_t address_size = 8;
  uint8_t offset_size = 4;
  uint8_t min_instruction_length = 1;
  int8_t line_base = 0;
  uint8_t line_range = 1;
  uint8_t opcode_base = 1;
  std::vector<uint8_t> standard_opcode_lengths;
  size_t program_begin = 0;  // opcodes, as offsets into .debug_line
  size_t program_end = 0;
  std::vector<std::string> directories;
  // (name, directory index) as the unit numbers them: from 0 in DWARF 5, from 1 before.
  std::vector<std::pair<std::string, uint64_t>> files;
};

struct LineRow {
  uint64_t address;
  uint32_t file;
  uint32_t line;
};

class LineTableIndex {
 public:
  // The sections stay owned by the caller and must outlive the index.
  LineTableIndex(std::string_view debug_line, std::string_view debug_line_str, std::string_view debug_str,
                 bool little_endian);

  // Indexes every unit; units that cannot be read are skipped, the first such
  // problem is kept in `problem()`.
  void build();

  // The row covering `address`: (unit index, file index as the unit numbers
  // files, line); false when no sequence covers it.
  bool row(uint64_t address, uint32_t* unit, uint32_t* file, uint32_t* line);

  const std::vector<LineUnitHeader>& units() const { return units_; }
  size_t sequence_count() const { return sequences_.size(); }
  const std::string& problem() const { return problem_; }

 private:
  struct Sequence {
    uint64_t start;
    uint64_t end;  // exclusive: the DW_LNE_end_sequence address
    uint32_t unit;
    size_t program_offset;  // where its first opcode is
  };

  bool parse_header(size_t offset, LineUnitHeader* header, size_t* next, std::string* error) const;
  // Runs a unit's state machine from `begin`; calls on_sequence(start, end,
  // offset of its first opcode) at each end_sequence, or, with `rows`, stops
  // after the first sequence and leaves its rows there.
  template <typename OnSequence>
  bool run(const LineUnitHeader& header, size_t begin, std::vector<LineRow>* rows, OnSequence on_sequence) const;
  std::string_view string_at(std::string_view section, uint64_t offset) const;

  std::string_view line_;
  std::string_view line_str_;
  std::string_view str_;
  bool little_endian_;
  std::vector<LineUnitHeader> units_;
  std::vector<Sequence> sequences_;                           // sorted by start after build()
  std::unordered_map<size_t, std::vector<LineRow>> decoded_;  // sequence index -> rows
  std::string problem_;
};

}  // namespace tbpipe
