// .eh_frame_hdr lookup, CIE/FDE parsing and the recipe compiler (x86-64).
//
// This runs only on a recipe-cache miss, so it favours plain, checked code over
// speed: the FDE is found by binary search in .eh_frame_hdr (no up-front index
// of the module), then the CIE and FDE programs are interpreted from scratch.
// References: LSB Core "Exception Frames" (.eh_frame, .eh_frame_hdr, DW_EH_PE
// encodings) and DWARF 5 section 6.4 (call frame instructions).

#include "cfi.h"

#include <cstring>

namespace tbpipe {
namespace cfi {
namespace {

// x86-64 DWARF register numbers.
constexpr uint64_t kRegRbp = 6;
constexpr uint64_t kRegRsp = 7;
constexpr uint64_t kRegRip = 16;

// DW_EH_PE pointer encodings.
constexpr uint8_t kPeOmit = 0xff;
constexpr uint8_t kPeAbsptr = 0x00;
constexpr uint8_t kPeUleb128 = 0x01;
constexpr uint8_t kPeUdata2 = 0x02;
constexpr uint8_t kPeUdata4 = 0x03;
constexpr uint8_t kPeUdata8 = 0x04;
constexpr uint8_t kPeSleb128 = 0x09;
constexpr uint8_t kPeSdata2 = 0x0a;
constexpr uint8_t kPeSdata4 = 0x0b;
constexpr uint8_t kPeSdata8 = 0x0c;
constexpr uint8_t kPePcrel = 0x10;
constexpr uint8_t kPeDatarel = 0x30;
constexpr uint8_t kPeIndirect = 0x80;

// DWARF expression opcodes the recipe patterns use.
constexpr uint8_t kOpDeref = 0x06;
constexpr uint8_t kOpAnd = 0x1a;
constexpr uint8_t kOpPlus = 0x22;
constexpr uint8_t kOpPlusUconst = 0x23;
constexpr uint8_t kOpShl = 0x24;
constexpr uint8_t kOpGe = 0x2a;
constexpr uint8_t kOpLit0 = 0x30;
constexpr uint8_t kOpBreg0 = 0x70;

// A byte range of module memory already known to be mapped and readable.
// Reads past `end` fail (ok = false) instead of touching memory.
struct Cursor {
  const uint8_t* p = nullptr;
  const uint8_t* end = nullptr;
  bool ok = true;

  size_t left() const { return ok && p <= end ? static_cast<size_t>(end - p) : 0; }

  template <typename T>
  T read() {
    T v{};
    if (left() < sizeof(T)) {
      ok = false;
      return v;
    }
    memcpy(&v, p, sizeof(T));
    p += sizeof(T);
    return v;
  }

  void skip(uint64_t n) {
    if (left() < n) {
      ok = false;
      return;
    }
    p += n;
  }

  uint64_t uleb() {
    uint64_t v = 0;
    unsigned shift = 0;
    for (;;) {
      if (left() < 1) {
        ok = false;
        return 0;
      }
      uint8_t b = *p++;
      if (shift < 64) v |= static_cast<uint64_t>(b & 0x7f) << shift;
      shift += 7;
      if (!(b & 0x80)) return v;
      if (shift > 70) {  // longer than any 64-bit value: corrupt
        ok = false;
        return 0;
      }
    }
  }

  int64_t sleb() {
    uint64_t v = 0;
    unsigned shift = 0;
    uint8_t b = 0;
    for (;;) {
      if (left() < 1) {
        ok = false;
        return 0;
      }
      b = *p++;
      if (shift < 64) v |= static_cast<uint64_t>(b & 0x7f) << shift;
      shift += 7;
      if (!(b & 0x80)) break;
      if (shift > 70) {
        ok = false;
        return 0;
      }
    }
    if (shift < 64 && (b & 0x40)) v |= ~uint64_t{0} << shift;
    return static_cast<int64_t>(v);
  }
};

// The readable segment of `m` that contains `addr`, as a cursor positioned at
// addr and ending where the segment (clipped to the image) ends.
bool cursor_at(const Module& m, uintptr_t addr, Cursor* c) {
  for (const AddressRange& r : m.readable_ranges) {
    if (addr >= r.lo && addr < r.hi) {
      uintptr_t hi = r.hi < m.image.hi ? r.hi : m.image.hi;
      if (addr < m.image.lo || addr >= hi) return false;
      c->p = reinterpret_cast<const uint8_t*>(addr);
      c->end = reinterpret_cast<const uint8_t*>(hi);
      c->ok = true;
      return true;
    }
  }
  return false;
}

// Reads the value part of an encoded pointer (no base applied).
bool read_encoded_value(Cursor& c, uint8_t enc, uint64_t* out) {
  switch (enc & 0x0f) {
    case kPeAbsptr:
      *out = c.read<uint64_t>();
      break;
    case kPeUleb128:
      *out = c.uleb();
      break;
    case kPeUdata2:
      *out = c.read<uint16_t>();
      break;
    case kPeUdata4:
      *out = c.read<uint32_t>();
      break;
    case kPeUdata8:
      *out = c.read<uint64_t>();
      break;
    case kPeSleb128:
      *out = static_cast<uint64_t>(c.sleb());
      break;
    case kPeSdata2:
      *out = static_cast<uint64_t>(static_cast<int64_t>(c.read<int16_t>()));
      break;
    case kPeSdata4:
      *out = static_cast<uint64_t>(static_cast<int64_t>(c.read<int32_t>()));
      break;
    case kPeSdata8:
      *out = static_cast<uint64_t>(c.read<int64_t>());
      break;
    default:
      return false;
  }
  return c.ok;
}

// Reads an encoded pointer and applies its base. `datarel_base` is the start of
// .eh_frame_hdr when reading the header, 0 (unsupported) inside .eh_frame.
// Indirect pointers are refused: nothing the unwinder needs uses them.
bool read_encoded_pointer(Cursor& c, uint8_t enc, uintptr_t datarel_base, uint64_t* out) {
  if (enc == kPeOmit || (enc & kPeIndirect)) return false;
  const uintptr_t field = reinterpret_cast<uintptr_t>(c.p);
  uint64_t v;
  if (!read_encoded_value(c, enc, &v)) return false;
  switch (enc & 0x70) {
    case 0x00:
      break;
    case kPePcrel:
      v += field;
      break;
    case kPeDatarel:
      if (!datarel_base) return false;
      v += datarel_base;
      break;
    default:
      return false;  // textrel, funcrel, aligned: not produced for these tables
  }
  *out = v;
  return true;
}

// Size of a fixed-size encoding, 0 for variable-size ones.
size_t encoded_size(uint8_t enc) {
  switch (enc & 0x0f) {
    case kPeAbsptr:
      return sizeof(uint64_t);
    case kPeUdata2:
    case kPeSdata2:
      return 2;
    case kPeUdata4:
    case kPeSdata4:
      return 4;
    case kPeUdata8:
    case kPeSdata8:
      return 8;
    default:
      return 0;
  }
}

// Address of the FDE that may cover `pc`, via the .eh_frame_hdr search table.
bool find_fde_address(const Module& m, uintptr_t pc, uintptr_t* fde) {
  if (!m.eh_frame_hdr) return false;
  const uintptr_t hdr = reinterpret_cast<uintptr_t>(m.eh_frame_hdr);
  Cursor c;
  if (!cursor_at(m, hdr, &c)) return false;
  const uint8_t version = c.read<uint8_t>();
  const uint8_t eh_frame_ptr_enc = c.read<uint8_t>();
  const uint8_t fde_count_enc = c.read<uint8_t>();
  const uint8_t table_enc = c.read<uint8_t>();
  if (!c.ok || version != 1) return false;
  uint64_t eh_frame_ptr, fde_count;
  if (!read_encoded_pointer(c, eh_frame_ptr_enc, hdr, &eh_frame_ptr)) return false;
  if (fde_count_enc == kPeOmit || table_enc == kPeOmit) return false;
  if (!read_encoded_pointer(c, fde_count_enc, hdr, &fde_count)) return false;
  const size_t field = encoded_size(table_enc);
  if (field == 0 || fde_count == 0) return false;
  // Whole table must be readable before the search touches any entry.
  if (fde_count > c.left() / (2 * field)) return false;
  const uint8_t* table = c.p;

  auto entry = [&](uint64_t i, uint64_t* loc, uint64_t* addr) {
    Cursor e{table + i * 2 * field, table + (i + 1) * 2 * field, true};
    return read_encoded_pointer(e, table_enc, hdr, loc) && read_encoded_pointer(e, table_enc, hdr, addr);
  };

  // Largest initial location <= pc.
  uint64_t lo = 0, hi = fde_count;
  while (lo < hi) {
    uint64_t mid = lo + (hi - lo) / 2;
    uint64_t loc, addr;
    if (!entry(mid, &loc, &addr)) return false;
    if (loc <= pc) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo == 0) return false;
  uint64_t loc, addr;
  if (!entry(lo - 1, &loc, &addr)) return false;
  *fde = static_cast<uintptr_t>(addr);
  return true;
}

struct Cie {
  uint64_t code_align = 1;
  int64_t data_align = 1;
  uint64_t ra_reg = kRegRip;
  uint8_t fde_enc = kPeAbsptr;
  bool has_z = false;
  bool signal = false;
  Cursor insns;
};

struct Fde {
  uint64_t pc_begin = 0;
  uint64_t pc_end = 0;
  Cursor insns;
};

// Reads the initial length of a CIE/FDE and returns a cursor over its body.
bool read_entry(const Module& m, uintptr_t addr, Cursor* body, bool* is_64) {
  Cursor c;
  if (!cursor_at(m, addr, &c)) return false;
  uint64_t len = c.read<uint32_t>();
  *is_64 = false;
  if (len == 0xffffffffu) {
    len = c.read<uint64_t>();
    *is_64 = true;
  }
  if (!c.ok || len == 0 || len > c.left()) return false;
  *body = Cursor{c.p, c.p + len, true};
  return true;
}

bool parse_cie(const Module& m, uintptr_t addr, Cie* cie) {
  Cursor c;
  bool is_64;
  if (!read_entry(m, addr, &c, &is_64)) return false;
  uint64_t id = is_64 ? c.read<uint64_t>() : c.read<uint32_t>();
  if (!c.ok || id != 0) return false;  // .eh_frame CIEs have id 0
  uint8_t version = c.read<uint8_t>();
  if (version != 1 && version != 3 && version != 4) return false;
  const char* aug = reinterpret_cast<const char*>(c.p);
  size_t aug_len = strnlen(aug, c.left());
  if (aug_len == c.left()) return false;
  c.skip(aug_len + 1);
  if (version == 4) {
    uint8_t address_size = c.read<uint8_t>();
    uint8_t segment_size = c.read<uint8_t>();
    if (address_size != 8 || segment_size != 0) return false;
  }
  cie->code_align = c.uleb();
  cie->data_align = c.sleb();
  cie->ra_reg = version == 1 ? c.read<uint8_t>() : c.uleb();
  if (!c.ok) return false;
  if (aug_len > 0) {
    // Without 'z' first the augmentation data has no length and cannot be skipped.
    if (aug[0] != 'z') return false;
    cie->has_z = true;
    uint64_t data_len = c.uleb();
    if (!c.ok || data_len > c.left()) return false;
    Cursor d{c.p, c.p + data_len, true};
    c.skip(data_len);
    for (size_t i = 1; i < aug_len && d.ok; ++i) {
      switch (aug[i]) {
        case 'L':
          d.read<uint8_t>();
          break;
        case 'R':
          cie->fde_enc = d.read<uint8_t>();
          break;
        case 'P': {
          uint8_t enc = d.read<uint8_t>();
          uint64_t ignored;
          if (!read_encoded_value(d, enc, &ignored)) return false;
          break;
        }
        case 'S':
          cie->signal = true;
          break;
        case 'B':  // aarch64 BTI
        case 'G':  // MTE-tagged frames
          break;
        default:
          i = aug_len;  // unknown: the rest is skipped by data_len
          break;
      }
    }
    if (!d.ok) return false;
  }
  cie->insns = c;
  return c.ok;
}

bool parse_fde(const Module& m, uintptr_t addr, Cie* cie, Fde* fde) {
  Cursor c;
  bool is_64;
  if (!read_entry(m, addr, &c, &is_64)) return false;
  const uintptr_t id_field = reinterpret_cast<uintptr_t>(c.p);
  uint64_t cie_off = is_64 ? c.read<uint64_t>() : c.read<uint32_t>();
  if (!c.ok || cie_off == 0 || cie_off > id_field) return false;  // 0 would be a CIE
  if (!parse_cie(m, id_field - cie_off, cie)) return false;
  uint64_t begin, range;
  if (!read_encoded_pointer(c, cie->fde_enc, 0, &begin)) return false;
  if (!read_encoded_value(c, cie->fde_enc & 0x0f, &range)) return false;
  if (cie->has_z) c.skip(c.uleb());
  if (!c.ok) return false;
  fde->pc_begin = begin;
  fde->pc_end = begin + range;
  fde->insns = c;
  return true;
}

// ---------------------------------------------------------------------------
// CFA program interpreter, tracking only the CFA, rbp and the return address.

enum class RuleKind : uint8_t {
  kUnset,  // never mentioned: same value, except for the return address
  kUndefined,
  kSame,
  kOffset,     // saved at CFA + off
  kValOffset,  // value is CFA + off
  kRegister,   // value in register `reg`
  kExpr,       // saved at address computed by expr (CFA pushed first)
  kValExpr,    // value computed by expr
};

struct RegRule {
  RuleKind kind = RuleKind::kUnset;
  int64_t off = 0;
  uint64_t reg = 0;
  const uint8_t* expr = nullptr;
  uint64_t expr_len = 0;
};

struct Row {
  bool cfa_is_expr = false;
  uint64_t cfa_reg = kRegRsp;
  int64_t cfa_off = 0;
  const uint8_t* cfa_expr = nullptr;
  uint64_t cfa_expr_len = 0;
  RegRule rbp;
  RegRule ra;
};

enum class RunResult { kOk, kBad };

constexpr int kMaxRememberDepth = 16;

struct Interpreter {
  const Cie& cie;
  uintptr_t target;              // run rows with loc <= target
  const Row* initial = nullptr;  // row after the CIE program, for DW_CFA_restore
  Row stack[kMaxRememberDepth];
  int depth = 0;

  RegRule* rule_for(Row& row, uint64_t reg) {
    if (reg == kRegRbp) return &row.rbp;
    if (reg == cie.ra_reg) return &row.ra;
    return nullptr;
  }

  void set(Row& row, uint64_t reg, RuleKind kind, int64_t off = 0, uint64_t other = 0, const uint8_t* expr = nullptr,
           uint64_t len = 0) {
    RegRule* r = rule_for(row, reg);
    if (!r) return;
    r->kind = kind;
    r->off = off;
    r->reg = other;
    r->expr = expr;
    r->expr_len = len;
  }

  void restore(Row& row, uint64_t reg) {
    if (reg == kRegRbp) {
      row.rbp = initial ? initial->rbp : RegRule{};
    } else if (reg == cie.ra_reg) {
      row.ra = initial ? initial->ra : RegRule{};
    }
  }

  // Returns false when the program is malformed or uses something we cannot
  // follow; stops early (true) once the location passes the target.
  bool run(Cursor c, Row& row, uint64_t loc) {
    const int64_t daf = cie.data_align;
    const uint64_t caf = cie.code_align;
    auto advance = [&](uint64_t delta) {
      loc += delta * caf;
      return loc <= target;
    };
    while (c.left() > 0) {
      uint8_t op = c.read<uint8_t>();
      uint8_t low = op & 0x3f;
      switch (op & 0xc0) {
        case 0x40:
          if (!advance(low)) return true;
          continue;
        case 0x80:
          set(row, low, RuleKind::kOffset, static_cast<int64_t>(c.uleb()) * daf);
          if (!c.ok) return false;
          continue;
        case 0xc0:
          restore(row, low);
          continue;
        default:
          break;
      }
      switch (op) {
        case 0x00:
          break;      // nop
        case 0x01: {  // set_loc
          uint64_t v;
          if (!read_encoded_pointer(c, cie.fde_enc, 0, &v)) return false;
          loc = v;
          if (loc > target) return true;
          break;
        }
        case 0x02:
          if (!advance(c.read<uint8_t>())) return c.ok;
          break;
        case 0x03:
          if (!advance(c.read<uint16_t>())) return c.ok;
          break;
        case 0x04:
          if (!advance(c.read<uint32_t>())) return c.ok;
          break;
        case 0x1d:  // MIPS_advance_loc8
          if (!advance(c.read<uint64_t>())) return c.ok;
          break;
        case 0x05: {  // offset_extended
          uint64_t reg = c.uleb();
          set(row, reg, RuleKind::kOffset, static_cast<int64_t>(c.uleb()) * daf);
          break;
        }
        case 0x06:
          restore(row, c.uleb());
          break;  // restore_extended
        case 0x07:
          set(row, c.uleb(), RuleKind::kUndefined);
          break;
        case 0x08:
          set(row, c.uleb(), RuleKind::kSame);
          break;
        case 0x09: {  // register
          uint64_t reg = c.uleb();
          uint64_t other = c.uleb();
          set(row, reg, RuleKind::kRegister, 0, other);
          break;
        }
        case 0x0a:  // remember_state
          if (depth == kMaxRememberDepth) return false;
          stack[depth++] = row;
          break;
        case 0x0b:  // restore_state: rules and CFA, as GCC and LLVM produce it
          if (depth == 0) return false;
          row = stack[--depth];
          break;
        case 0x0c:  // def_cfa
          row.cfa_is_expr = false;
          row.cfa_reg = c.uleb();
          row.cfa_off = static_cast<int64_t>(c.uleb());
          break;
        case 0x0d:  // def_cfa_register
          if (row.cfa_is_expr) return false;
          row.cfa_reg = c.uleb();
          break;
        case 0x0e:  // def_cfa_offset
          if (row.cfa_is_expr) return false;
          row.cfa_off = static_cast<int64_t>(c.uleb());
          break;
        case 0x0f: {  // def_cfa_expression
          uint64_t len = c.uleb();
          row.cfa_is_expr = true;
          row.cfa_expr = c.p;
          row.cfa_expr_len = len;
          c.skip(len);
          break;
        }
        case 0x10:    // expression
        case 0x16: {  // val_expression
          uint64_t reg = c.uleb();
          uint64_t len = c.uleb();
          const uint8_t* expr = c.p;
          c.skip(len);
          set(row, reg, op == 0x10 ? RuleKind::kExpr : RuleKind::kValExpr, 0, 0, expr, len);
          break;
        }
        case 0x11: {  // offset_extended_sf
          uint64_t reg = c.uleb();
          set(row, reg, RuleKind::kOffset, c.sleb() * daf);
          break;
        }
        case 0x12:  // def_cfa_sf
          row.cfa_is_expr = false;
          row.cfa_reg = c.uleb();
          row.cfa_off = c.sleb() * daf;
          break;
        case 0x13:  // def_cfa_offset_sf
          if (row.cfa_is_expr) return false;
          row.cfa_off = c.sleb() * daf;
          break;
        case 0x14: {  // val_offset
          uint64_t reg = c.uleb();
          set(row, reg, RuleKind::kValOffset, static_cast<int64_t>(c.uleb()) * daf);
          break;
        }
        case 0x15: {  // val_offset_sf
          uint64_t reg = c.uleb();
          set(row, reg, RuleKind::kValOffset, c.sleb() * daf);
          break;
        }
        case 0x2e:
          c.uleb();
          break;      // GNU_args_size: only matters for EH landing pads
        case 0x2f: {  // GNU_negative_offset_extended
          uint64_t reg = c.uleb();
          set(row, reg, RuleKind::kOffset, -static_cast<int64_t>(c.uleb()) * daf);
          break;
        }
        default:
          return false;  // includes GNU_window_save (SPARC/aarch64 only)
      }
      if (!c.ok) return false;
    }
    return c.ok;
  }
};

// ---------------------------------------------------------------------------
// Expression patterns with a recipe form.

struct Op {
  uint8_t code = 0;
  int64_t arg = 0;
};

// Decodes up to `max` operations; false when an op outside the small set the
// patterns use appears, or the block is malformed.
bool decode_ops(const uint8_t* p, uint64_t len, Op* ops, int max, int* count) {
  Cursor c{p, p + len, true};
  int n = 0;
  while (c.left() > 0) {
    if (n == max) return false;
    Op op;
    op.code = c.read<uint8_t>();
    if (op.code >= kOpBreg0 && op.code < kOpBreg0 + 32) {
      op.arg = c.sleb();
    } else if (op.code == kOpPlusUconst) {
      op.arg = static_cast<int64_t>(c.uleb());
    } else if (!(op.code >= kOpLit0 && op.code < kOpLit0 + 32) && op.code != kOpDeref && op.code != kOpAnd &&
               op.code != kOpPlus && op.code != kOpShl && op.code != kOpGe) {
      return false;
    }
    if (!c.ok) return false;
    ops[n++] = op;
  }
  *count = n;
  return true;
}

bool is_breg(const Op& op, uint64_t reg) { return op.code == kOpBreg0 + reg; }

bool fits16(int64_t v) { return v >= INT16_MIN && v <= INT16_MAX; }
bool fits32(int64_t v) { return v >= INT32_MIN && v <= INT32_MAX; }

// DW_CFA_def_cfa_expression forms: breg{6,7} k [deref], and the .plt rule.
bool compile_cfa_expr(const Row& row, Recipe* r) {
  Op ops[12];
  int n = 0;
  if (!decode_ops(row.cfa_expr, row.cfa_expr_len, ops, 12, &n)) return false;
  if (n >= 1 && (is_breg(ops[0], kRegRsp) || is_breg(ops[0], kRegRbp)) && fits32(ops[0].arg)) {
    const bool rsp = is_breg(ops[0], kRegRsp);
    if (n == 2 && ops[1].code == kOpDeref) {
      r->cfa_rule = rsp ? CfaRule::kDerefRsp : CfaRule::kDerefRbp;
      r->cfa_off = static_cast<int32_t>(ops[0].arg);
      return true;
    }
    if (n == 1) {
      r->cfa_rule = rsp ? CfaRule::kRspOffset : CfaRule::kRbpOffset;
      r->cfa_off = static_cast<int32_t>(ops[0].arg);
      return true;
    }
    // PLT stubs: rsp + k, plus 8 once rip is past the stub's push.
    // breg7 k; breg16 0; lit15; and; litN; ge; lit3; shl; plus
    if (n == 9 && rsp && is_breg(ops[1], kRegRip) && ops[1].arg == 0 && ops[2].code == kOpLit0 + 15 &&
        ops[3].code == kOpAnd && ops[4].code >= kOpLit0 && ops[4].code < kOpLit0 + 16 && ops[5].code == kOpGe &&
        ops[6].code == kOpLit0 + 3 && ops[7].code == kOpShl && ops[8].code == kOpPlus) {
      r->cfa_rule = CfaRule::kPlt;
      r->cfa_off = static_cast<int32_t>(ops[0].arg);
      r->plt_threshold = static_cast<uint8_t>(ops[4].code - kOpLit0);
      return true;
    }
  }
  return false;
}

// DW_CFA_expression forms for a saved register: the address is breg{6,7} k, or
// CFA + k (the CFA is on the stack when the expression starts).
enum class SavedAt { kCfa, kRsp, kRbp };
bool compile_saved_at(const RegRule& rule, SavedAt* base, int16_t* off) {
  Op ops[4];
  int n = 0;
  if (!decode_ops(rule.expr, rule.expr_len, ops, 4, &n) || n != 1) return false;
  if ((is_breg(ops[0], kRegRsp) || is_breg(ops[0], kRegRbp)) && fits16(ops[0].arg)) {
    *base = is_breg(ops[0], kRegRsp) ? SavedAt::kRsp : SavedAt::kRbp;
    *off = static_cast<int16_t>(ops[0].arg);
    return true;
  }
  if (ops[0].code == kOpPlusUconst && fits16(ops[0].arg)) {
    *base = SavedAt::kCfa;
    *off = static_cast<int16_t>(ops[0].arg);
    return true;
  }
  return false;
}

Recipe unsupported(Recipe r) {
  r.cfa_rule = CfaRule::kUnsupported;
  return r;
}

Recipe compile_row(const Row& row, const Cie& cie) {
  Recipe r;
  if (cie.signal) r.flags |= kRecipeSignalFrame;
  if (cie.ra_reg != kRegRip) return unsupported(r);

  if (row.cfa_is_expr) {
    if (!compile_cfa_expr(row, &r)) return unsupported(r);
  } else {
    if (!fits32(row.cfa_off)) return unsupported(r);
    if (row.cfa_reg == kRegRsp) {
      r.cfa_rule = CfaRule::kRspOffset;
    } else if (row.cfa_reg == kRegRbp) {
      r.cfa_rule = CfaRule::kRbpOffset;
    } else {
      return unsupported(r);  // e.g. r10 inside a realigning prologue
    }
    r.cfa_off = static_cast<int32_t>(row.cfa_off);
  }

  switch (row.ra.kind) {
    case RuleKind::kUndefined:
      r.ra_rule = RaRule::kUndefined;
      break;
    case RuleKind::kOffset:
      if (!fits16(row.ra.off)) return unsupported(r);
      r.ra_rule = RaRule::kAtCfa;
      r.ra_off = static_cast<int16_t>(row.ra.off);
      break;
    case RuleKind::kExpr: {
      SavedAt base;
      int16_t off;
      if (!compile_saved_at(row.ra, &base, &off)) return unsupported(r);
      r.ra_rule = base == SavedAt::kCfa ? RaRule::kAtCfa : base == SavedAt::kRsp ? RaRule::kAtRsp : RaRule::kAtRbp;
      r.ra_off = off;
      break;
    }
    default:
      return unsupported(r);
  }

  switch (row.rbp.kind) {
    case RuleKind::kUnset:
    case RuleKind::kSame:
      r.rbp_rule = RbpRule::kSame;
      break;
    case RuleKind::kOffset:
      if (!fits16(row.rbp.off)) return unsupported(r);
      r.rbp_rule = RbpRule::kAtCfa;
      r.rbp_off = static_cast<int16_t>(row.rbp.off);
      break;
    case RuleKind::kValOffset:
      if (!fits16(row.rbp.off)) return unsupported(r);
      r.rbp_rule = RbpRule::kValCfa;
      r.rbp_off = static_cast<int16_t>(row.rbp.off);
      break;
    case RuleKind::kRegister:
      r.rbp_rule = row.rbp.reg == kRegRbp ? RbpRule::kSame : RbpRule::kLost;
      break;
    case RuleKind::kExpr: {
      SavedAt base;
      int16_t off;
      if (!compile_saved_at(row.rbp, &base, &off)) {
        r.rbp_rule = RbpRule::kLost;
        break;
      }
      r.rbp_rule = base == SavedAt::kCfa ? RbpRule::kAtCfa : base == SavedAt::kRsp ? RbpRule::kAtRsp : RbpRule::kAtRbp;
      r.rbp_off = off;
      break;
    }
    default:
      // Undefined or computed: the caller's rbp is unknown. The walk can still
      // go on through frames that do not need it.
      r.rbp_rule = RbpRule::kLost;
      break;
  }
  if ((r.cfa_rule == CfaRule::kRspOffset || r.cfa_rule == CfaRule::kRbpOffset) && r.ra_rule == RaRule::kAtCfa &&
      (r.rbp_rule == RbpRule::kSame || r.rbp_rule == RbpRule::kAtCfa) && !cie.signal) {
    r.flags |= kRecipeSimple;
  }
  return r;
}

}  // namespace

Recipe compile_recipe(const Module& m, uintptr_t pc) {
  Recipe none;
  none.cfa_rule = CfaRule::kNoInfo;
  uintptr_t fde_addr;
  if (!find_fde_address(m, pc, &fde_addr)) return none;
  Cie cie;
  Fde fde;
  if (!parse_fde(m, fde_addr, &cie, &fde)) return none;
  if (pc < fde.pc_begin || pc >= fde.pc_end) return none;

  Interpreter interp{cie, pc};
  Row row;
  // The CIE program sets the initial rules; its own locations do not matter.
  interp.target = UINTPTR_MAX;
  if (!interp.run(cie.insns, row, fde.pc_begin)) return unsupported(Recipe{});
  Row initial = row;
  interp.initial = &initial;
  interp.depth = 0;
  interp.target = pc;
  if (!interp.run(fde.insns, row, fde.pc_begin)) {
    Recipe r;
    if (cie.signal) r.flags |= kRecipeSignalFrame;
    return unsupported(r);
  }
  return compile_row(row, cie);
}

const char* cfa_rule_name(CfaRule rule) {
  switch (rule) {
    case CfaRule::kRspOffset:
      return "rsp+k";
    case CfaRule::kRbpOffset:
      return "rbp+k";
    case CfaRule::kDerefRsp:
      return "*(rsp+k)";
    case CfaRule::kDerefRbp:
      return "*(rbp+k)";
    case CfaRule::kPlt:
      return "plt";
    case CfaRule::kNoInfo:
      return "no-info";
    case CfaRule::kUnsupported:
      return "unsupported";
  }
  return "?";
}

}  // namespace cfi
}  // namespace tbpipe
