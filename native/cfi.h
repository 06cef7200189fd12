// DWARF call-frame information (.eh_frame_hdr / .eh_frame) for x86-64, reduced
// to what a stack walk needs.
//
// compile_recipe() finds the FDE covering one PC, runs the CIE's and FDE's CFA
// programs up to that PC and turns the resulting row into a Recipe: a few bytes
// that say how to get the caller's rsp (= CFA), return address and rbp from the
// current rsp/rbp. Only rsp, rbp and the return address are tracked: every
// other register's rule is parsed and ignored. A row the recipe form cannot
// express compiles to CfaRule::kUnsupported rather than to a guess.
//
// Every byte read from a module's memory is checked against that module's
// readable PT_LOAD segments first, so a corrupt or truncated .eh_frame cannot
// make the parser fault.
#pragma once

#include <cstddef>
#include <cstdint>

#include "modules.h"

namespace tbpipe {
namespace cfi {

enum class CfaRule : uint8_t {
  kRspOffset,    // CFA = rsp + cfa_off
  kRbpOffset,    // CFA = rbp + cfa_off
  kDerefRsp,     // CFA = *(rsp + cfa_off)   (signal frames)
  kDerefRbp,     // CFA = *(rbp + cfa_off)   (stack-realigning prologues, DRAP)
  kPlt,          // CFA = rsp + cfa_off + ((rip & 15) >= plt_threshold ? 8 : 0)
  kNoInfo,       // the module has no FDE for this PC
  kUnsupported,  // an FDE exists but its rule has no recipe form
};

enum class RaRule : uint8_t {
  kAtCfa,      // ra = *(CFA + ra_off)
  kAtRsp,      // ra = *(rsp + ra_off)  (DW_CFA_expression DW_OP_breg7)
  kAtRbp,      // ra = *(rbp + ra_off)  (DW_CFA_expression DW_OP_breg6)
  kUndefined,  // outermost frame
};

enum class RbpRule : uint8_t {
  kSame,    // caller's rbp = rbp
  kAtCfa,   // caller's rbp = *(CFA + rbp_off)
  kAtRsp,   // caller's rbp = *(rsp + rbp_off)
  kAtRbp,   // caller's rbp = *(rbp + rbp_off)
  kValCfa,  // caller's rbp = CFA + rbp_off
  kLost,    // not recoverable with this recipe (undefined, in another register...)
};

enum RecipeFlags : uint8_t {
  // The CIE carries augmentation 'S': this frame is a signal trampoline, so the
  // caller's PC is the exact interrupted instruction, not a return address.
  kRecipeSignalFrame = 1u << 0,
  // CFA = rsp|rbp + k, return address at CFA + k, rbp same or at CFA + k, not
  // a signal frame: the common shape, which the walker handles on a short path.
  kRecipeSimple = 1u << 1,
};

struct Recipe {
  int32_t cfa_off = 0;
  int16_t ra_off = 0;
  int16_t rbp_off = 0;
  CfaRule cfa_rule = CfaRule::kNoInfo;
  RaRule ra_rule = RaRule::kAtCfa;
  RbpRule rbp_rule = RbpRule::kSame;
  uint8_t flags = 0;  // RecipeFlags
  uint8_t plt_threshold = 0;
  uint8_t reserved[3] = {0, 0, 0};
};
static_assert(sizeof(Recipe) == 16, "recipes are cached per PC; keep them small");

// Recipe for unwinding the frame whose lookup PC (pc, or pc - 1 for a return
// address) is `pc`, inside module `m`. Never faults; allocates nothing.
Recipe compile_recipe(const Module& m, uintptr_t pc);

// Human-readable form of a recipe, for diagnostics and tests.
const char* cfa_rule_name(CfaRule rule);

}  // namespace cfi
}  // namespace tbpipe
