#include "combined_order.h"

#include <stdexcept>

namespace tbpipe {

CombinedOrder combined_order(const CombinedOrderInput& in) {
  CombinedOrder out;
  size_t native_total = 0, python_total = 0;
  for (size_t s = 0; s < in.stacks; ++s) {
    native_total += static_cast<size_t>(in.native_lengths[s]);
    python_total += static_cast<size_t>(in.python_lengths[s]);
  }
  const size_t most = native_total + python_total;
  out.owner.reserve(most);
  out.source.reserve(most);
  out.is_python.reserve(most);
  out.slot.reserve(most);
  out.has_native.resize(in.stacks);
  out.truncated.resize(in.stacks);
  out.leftover.resize(in.stacks);

  int64_t native_start = 0, python_start = 0;
  for (size_t s = 0; s < in.stacks; ++s) {
    const int64_t native_count = in.native_lengths[s], python_count = in.python_lengths[s];
    const uint32_t* native = in.native_flags + native_start;
    const uint32_t* python = in.python_flags + python_start;
    // Eval-loop frames (markers never count) and whether a marker says the walk stopped.
    int64_t evals = 0;
    bool truncated = false;
    for (int64_t i = 0; i < native_count; ++i) {
      if (native[i] & in.marker_bit) {
        truncated = true;
      } else if (native[i] & in.eval_bit) {
        ++evals;
      }
    }
    // Python frames fall into groups, each ended by an entry frame; group k goes to the k-th
    // eval-loop frame, and frames of groups past the last eval-loop frame are left over.
    int64_t entries = 0, leftover = 0, groups = 0;
    for (int64_t j = 0; j < python_count; ++j) {
      if (entries >= evals) ++leftover;
      groups = entries + 1;  // the group of this frame, counted
      if (python[j] & in.entry_bit) ++entries;
    }
    const bool has_native = (in.status[s] & in.no_native_bit) == 0 && native_count > 0;
    const bool python_only = !has_native || (leftover > 0 && !truncated);
    out.has_native[s] = has_native;
    out.truncated[s] = truncated;
    out.leftover[s] = leftover;

    int32_t slot = 0;
    auto put = [&](int64_t source, bool is_python) {
      out.owner.push_back(static_cast<int64_t>(s));
      out.source.push_back(source);
      out.is_python.push_back(is_python);
      out.slot.push_back(slot++);
    };
    int64_t next_python = 0;
    if (!python_only) {
      int64_t rank = 0, group = 0;  // eval-loop frames seen; group of the next Python frame
      for (int64_t i = 0; i < native_count; ++i) {
        const bool eval = (native[i] & in.eval_bit) && !(native[i] & in.marker_bit);
        if (eval && rank < groups) {
          // This eval-loop frame stands for its group of Python frames, in their order.
          while (next_python < python_count && group == rank) {
            if (python[next_python] & in.entry_bit) ++group;
            put(python_start + next_python++, true);
          }
        } else {
          put(native_start + i, false);
        }
        if (eval) ++rank;
      }
    }
    // Python frames no eval-loop frame took: after every native frame (the walk stopped early), or
    // the whole stack when it is shown as its Python frames alone.
    while (next_python < python_count) put(python_start + next_python++, true);
    native_start += native_count;
    python_start += python_count;
  }
  return out;
}

SlotColumns slot_columns(const SlotColumnsInput& in) {
  SlotColumns out;
  const size_t n = in.slots;
  out.kind.resize(n);
  out.module_row.resize(n);
  out.code_row.resize(n);
  out.address.resize(n);
  out.exact.resize(n);
  out.line.resize(n);
  out.inlined.resize(n);
  out.first_line.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t source = in.source[i];
    if (in.is_python[i]) {
      if (source < 0 || static_cast<size_t>(source) >= in.python_frames) {
        throw std::out_of_range("a slot's Python frame is outside the frame columns");
      }
      const int64_t code_row = in.python_ref[source];
      if (code_row >= 0 && static_cast<size_t>(code_row) >= in.code_rows) {
        throw std::out_of_range("a Python frame's code row is outside the code table");
      }
      out.kind[i] = in.python_kind;
      out.module_row[i] = -1;
      out.code_row[i] = code_row;
      out.address[i] = 0;
      out.exact[i] = 0;
      out.line[i] = in.python_line[source];
      out.inlined[i] = (in.python_flags[source] & in.origin_bit) != 0;
      out.first_line[i] = code_row >= 0 ? in.code_first_line[code_row] : -1;
    } else {
      if (source < 0 || static_cast<size_t>(source) >= in.native_frames) {
        throw std::out_of_range("a slot's native frame is outside the frame columns");
      }
      const uint32_t flags = in.native_flags[source];
      const bool marker = (flags & in.marker_bit) != 0;
      out.kind[i] = marker ? in.marker_kind : in.native_kind;
      out.module_row[i] = marker ? -1 : in.native_ref[source];
      out.code_row[i] = -1;
      out.address[i] = in.native_address[source];
      out.exact[i] = !marker && (flags & in.exact_bit) != 0;
      out.line[i] = -1;
      out.inlined[i] = 0;
      out.first_line[i] = -1;
    }
  }
  return out;
}

}  // namespace tbpipe
