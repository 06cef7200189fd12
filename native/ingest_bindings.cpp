// Bindings of the ingest's native steps: stack hashing (stack_identity.h, `hash_raw_stacks`), distinct
// rows (distinct_rows.h), the combined order (combined_order.h), inline expansion (inline_rows.h) and
// Parquet page headers
// (parquet_pages.h), over the buffers of Arrow columns and numpy arrays (views, no copies).
// Registered into tbpipe._native by bindings.cpp through register_ingest_bindings().
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "buffer_args.h"
#include "combined_order.h"
#include "distinct_rows.h"
#include "inline_rows.h"
#include "md5.h"
#include "parquet_pages.h"
#include "stack_identity.h"

namespace py = pybind11;

namespace tbpipe {
namespace {

// The data of a column argument (its view kept in `info`, which holds its length).
template <typename T>
const T* column(const py::buffer& buffer, py::buffer_info& info, const char* what) {
  info = integer_buffer(buffer, sizeof(T), what, false);
  return static_cast<const T*>(info.ptr);
}

// `work()` run without the GIL. An `Error` it throws (what damaged input makes the step throw) comes
// back as a ValueError, raised once the GIL is held again.
template <typename Error, typename Work>
auto unlocked_or_value_error(Work&& work) -> decltype(work()) {
  decltype(work()) result;
  std::string problem;
  {
    py::gil_scoped_release unlocked;
    try {
      result = work();
    } catch (const Error& error) {
      problem = error.what();
    }
  }
  if (!problem.empty()) throw py::value_error(problem);
  return result;
}

// List offsets must rise and stay inside the frame columns: a damaged part must not read past them.
void check_offsets(const int32_t* offsets, ssize_t count, ssize_t frames, const char* what) {
  if (count < 1) throw py::value_error(std::string(what) + ": no offsets");
  if (offsets[0] < 0) throw py::value_error(std::string(what) + ": negative offset");
  for (ssize_t i = 1; i < count; ++i) {
    if (offsets[i] < offsets[i - 1]) throw py::value_error(std::string(what) + ": offsets go down");
  }
  if (offsets[count - 1] > frames) throw py::value_error(std::string(what) + ": offsets past the frames");
}

py::bytes hash_raw_stacks_binding(const py::buffer& status, const py::buffer& native_offsets,
                                  const py::buffer& native_module, const py::buffer& native_address,
                                  const py::buffer& native_flags, const py::buffer& python_offsets,
                                  const py::buffer& python_code, const py::buffer& python_line,
                                  const py::buffer& python_flags, const py::buffer& module_index,
                                  const py::buffer& module_hash, const py::buffer& code_id,
                                  const py::buffer& code_hash) {
  py::buffer_info infos[13];
  RawStackColumns columns;
  columns.status = column<uint32_t>(status, infos[0], "status");
  columns.native_offsets = column<int32_t>(native_offsets, infos[1], "native offsets");
  columns.native_module = column<int32_t>(native_module, infos[2], "native modules");
  columns.native_address = column<uint64_t>(native_address, infos[3], "native addresses");
  columns.native_flags = column<uint32_t>(native_flags, infos[4], "native flags");
  columns.python_offsets = column<int32_t>(python_offsets, infos[5], "python offsets");
  columns.python_code = column<uint64_t>(python_code, infos[6], "python code ids");
  columns.python_line = column<int32_t>(python_line, infos[7], "python lines");
  columns.python_flags = column<uint32_t>(python_flags, infos[8], "python flags");
  RawStackReferences references;
  references.module_index = column<int64_t>(module_index, infos[9], "module indices");
  references.module_hash = column<uint64_t>(module_hash, infos[10], "module hashes");
  references.code_id = column<uint64_t>(code_id, infos[11], "code ids");
  references.code_hash = column<uint64_t>(code_hash, infos[12], "code hashes");

  const ssize_t stacks = infos[0].size;
  if (infos[1].size != stacks + 1 || infos[5].size != stacks + 1) {
    throw py::value_error("native and python offsets: expected one more than the stacks");
  }
  const ssize_t native_frames = infos[2].size;
  if (infos[3].size != native_frames || infos[4].size != native_frames) {
    throw py::value_error("native frame columns differ in length");
  }
  const ssize_t python_frames = infos[6].size;
  if (infos[7].size != python_frames || infos[8].size != python_frames) {
    throw py::value_error("python frame columns differ in length");
  }
  if (infos[9].size != infos[10].size) throw py::value_error("module indices and hashes differ in length");
  if (infos[11].size != infos[12].size) throw py::value_error("code ids and hashes differ in length");
  check_offsets(columns.native_offsets, stacks + 1, native_frames, "native offsets");
  check_offsets(columns.python_offsets, stacks + 1, python_frames, "python offsets");
  columns.stacks = static_cast<size_t>(stacks);
  references.modules = static_cast<size_t>(infos[9].size);
  references.codes = static_cast<size_t>(infos[11].size);

  std::string out(static_cast<size_t>(stacks) * sizeof(uint64_t), '\0');
  {
    py::gil_scoped_release unlocked;
    hash_raw_stacks(columns, references, reinterpret_cast<uint64_t*>(out.data()));
  }
  return py::bytes(out);
}

py::tuple distinct_rows_binding(const py::buffer& rows, ssize_t width, bool exact_pass_only) {
  py::buffer_info info;
  const auto* bytes = column<uint8_t>(rows, info, "rows");
  if (width <= 0) throw py::value_error("rows: width must be positive");
  if (info.size % width != 0) throw py::value_error("rows: size is not a multiple of the width");
  const size_t count = static_cast<size_t>(info.size / width);
  std::string ids(count * sizeof(int64_t), '\0');
  std::vector<int64_t> first;
  {
    py::gil_scoped_release unlocked;
    first = distinct_rows(bytes, count, static_cast<size_t>(width), reinterpret_cast<int64_t*>(ids.data()),
                          exact_pass_only);
  }
  return py::make_tuple(py::bytes(ids),
                        py::bytes(reinterpret_cast<const char*>(first.data()), first.size() * sizeof(int64_t)));
}

template <typename T>
py::bytes vector_bytes(const std::vector<T>& values) {
  return py::bytes(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// A vector handed to numpy without a copy: the array owns it (for outputs of many megabytes).
template <typename T>
py::array_t<T> vector_array(std::vector<T>&& values) {
  auto* owned = new std::vector<T>(std::move(values));
  py::capsule release(owned, [](void* vector) { delete static_cast<std::vector<T>*>(vector); });
  return py::array_t<T>(static_cast<ssize_t>(owned->size()), owned->data(), release);
}

py::tuple combined_order_binding(const py::buffer& native_lengths, const py::buffer& python_lengths,
                                 const py::buffer& status, const py::buffer& native_flags,
                                 const py::buffer& python_flags, uint32_t no_native_bit, uint32_t marker_bit,
                                 uint32_t eval_bit, uint32_t entry_bit) {
  py::buffer_info infos[5];
  CombinedOrderInput input;
  input.native_lengths = column<int64_t>(native_lengths, infos[0], "native lengths");
  input.python_lengths = column<int64_t>(python_lengths, infos[1], "python lengths");
  input.status = column<uint32_t>(status, infos[2], "status");
  input.native_flags = column<uint32_t>(native_flags, infos[3], "native flags");
  input.python_flags = column<uint32_t>(python_flags, infos[4], "python flags");
  const ssize_t stacks = infos[2].size;
  if (infos[0].size != stacks || infos[1].size != stacks) {
    throw py::value_error("native and python lengths: expected one per stack");
  }
  // The frames each stack claims must lie inside the frame columns.
  // Each length is checked against what is left of its column before it is added: no sum can wrap.
  ssize_t native_frames = 0, python_frames = 0;
  for (ssize_t s = 0; s < stacks; ++s) {
    if (input.native_lengths[s] < 0 || input.python_lengths[s] < 0) throw py::value_error("negative length");
    if (input.native_lengths[s] > infos[3].size - native_frames ||
        input.python_lengths[s] > infos[4].size - python_frames) {
      throw py::value_error("lengths do not add up to the frame columns");
    }
    native_frames += input.native_lengths[s];
    python_frames += input.python_lengths[s];
  }
  if (native_frames != infos[3].size || python_frames != infos[4].size) {
    throw py::value_error("lengths do not add up to the frame columns");
  }
  input.stacks = static_cast<size_t>(stacks);
  input.no_native_bit = no_native_bit;
  input.marker_bit = marker_bit;
  input.eval_bit = eval_bit;
  input.entry_bit = entry_bit;
  CombinedOrder order;
  {
    py::gil_scoped_release unlocked;
    order = combined_order(input);
  }
  return py::make_tuple(vector_bytes(order.owner), vector_bytes(order.source), vector_bytes(order.is_python),
                        vector_bytes(order.slot), vector_bytes(order.has_native), vector_bytes(order.truncated),
                        vector_bytes(order.leftover));
}

py::tuple slot_columns_binding(const py::buffer& source, const py::buffer& is_python, const py::buffer& native_ref,
                               const py::buffer& native_address, const py::buffer& native_flags,
                               const py::buffer& python_ref, const py::buffer& python_line,
                               const py::buffer& python_flags, const py::buffer& code_first_line, uint32_t marker_bit,
                               uint32_t exact_bit, uint32_t origin_bit, int8_t python_kind, int8_t native_kind,
                               int8_t marker_kind) {
  py::buffer_info infos[9];
  SlotColumnsInput input;
  input.source = column<int64_t>(source, infos[0], "source");
  input.is_python = column<uint8_t>(is_python, infos[1], "is_python");
  input.native_ref = column<int64_t>(native_ref, infos[2], "native_ref");
  input.native_address = column<uint64_t>(native_address, infos[3], "native_address");
  input.native_flags = column<uint32_t>(native_flags, infos[4], "native_flags");
  input.python_ref = column<int64_t>(python_ref, infos[5], "python_ref");
  input.python_line = column<int32_t>(python_line, infos[6], "python_line");
  input.python_flags = column<uint32_t>(python_flags, infos[7], "python_flags");
  input.code_first_line = column<int32_t>(code_first_line, infos[8], "code_first_line");
  if (infos[1].size != infos[0].size) throw py::value_error("source and is_python: expected one each per slot");
  if (infos[3].size != infos[2].size || infos[4].size != infos[2].size) {
    throw py::value_error("native frame columns of different lengths");
  }
  if (infos[6].size != infos[5].size || infos[7].size != infos[5].size) {
    throw py::value_error("Python frame columns of different lengths");
  }
  input.slots = static_cast<size_t>(infos[0].size);
  input.native_frames = static_cast<size_t>(infos[2].size);
  input.python_frames = static_cast<size_t>(infos[5].size);
  input.code_rows = static_cast<size_t>(infos[8].size);
  input.marker_bit = marker_bit;
  input.exact_bit = exact_bit;
  input.origin_bit = origin_bit;
  input.python_kind = python_kind;
  input.native_kind = native_kind;
  input.marker_kind = marker_kind;
  const SlotColumns columns = unlocked_or_value_error<std::out_of_range>([&] { return slot_columns(input); });
  return py::make_tuple(vector_bytes(columns.kind), vector_bytes(columns.module_row), vector_bytes(columns.code_row),
                        vector_bytes(columns.address), vector_bytes(columns.exact), vector_bytes(columns.line),
                        vector_bytes(columns.inlined), vector_bytes(columns.first_line));
}

py::tuple inline_rows_binding(const py::buffer& stack_id, const py::buffer& slot, const py::buffer& kind,
                              const py::buffer& key_code, const py::buffer& address, const py::buffer& exact,
                              const py::buffer& module_code, const py::buffer& function_code,
                              const py::buffer& file_code, const py::buffer& line, const py::buffer& first_line,
                              const py::buffer& inlined, const py::buffer& symbol_key_code,
                              const py::buffer& symbol_address, const py::buffer& symbol_exact,
                              const py::buffer& symbol_depth, int8_t python_kind, int8_t native_kind) {
  py::buffer_info infos[16];
  InlineRowsInput input;
  input.stack_id = column<int64_t>(stack_id, infos[0], "stack_id");
  input.slot = column<int32_t>(slot, infos[1], "slot");
  input.kind = column<int8_t>(kind, infos[2], "kind");
  input.key_code = column<int64_t>(key_code, infos[3], "key_code");
  input.address = column<uint64_t>(address, infos[4], "address");
  input.exact = column<uint8_t>(exact, infos[5], "exact");
  input.module_code = column<int64_t>(module_code, infos[6], "module_code");
  input.function_code = column<int64_t>(function_code, infos[7], "function_code");
  input.file_code = column<int64_t>(file_code, infos[8], "file_code");
  input.line = column<int32_t>(line, infos[9], "line");
  input.first_line = column<int32_t>(first_line, infos[10], "first_line");
  input.inlined = column<uint8_t>(inlined, infos[11], "inlined");
  input.symbol_key_code = column<int64_t>(symbol_key_code, infos[12], "symbol_key_code");
  input.symbol_address = column<uint64_t>(symbol_address, infos[13], "symbol_address");
  input.symbol_exact = column<uint8_t>(symbol_exact, infos[14], "symbol_exact");
  input.symbol_depth = column<int32_t>(symbol_depth, infos[15], "symbol_depth");
  const ssize_t slots = infos[0].size;
  for (int i = 1; i <= 10; ++i) {
    if (infos[i].size != slots) throw py::value_error("slot columns of different lengths");
  }
  if (infos[11].size != 0 && infos[11].size != slots) {
    throw py::value_error("inlined: expected one per slot, or none when no slot is inlined");
  }
  if (infos[11].size == 0) input.inlined = nullptr;
  const ssize_t symbols = infos[12].size;
  if (infos[13].size != symbols || infos[14].size != symbols || infos[15].size != symbols) {
    throw py::value_error("symbols columns of different lengths");
  }
  input.slots = static_cast<size_t>(slots);
  input.symbols = static_cast<size_t>(symbols);
  input.python_kind = python_kind;
  input.native_kind = native_kind;
  InlineRows rows = unlocked_or_value_error<std::length_error>([&] { return inline_rows(input); });
  return py::make_tuple(vector_array(std::move(rows.stack_id)), vector_array(std::move(rows.depth)),
                        vector_array(std::move(rows.slot)), vector_array(std::move(rows.chain_depth)),
                        vector_array(std::move(rows.frame)), vector_array(std::move(rows.frame_slot)),
                        vector_array(std::move(rows.frame_symbol_row)));
}

// A walk over the Parquet column chunk data[start, end) (chunk_pages or chunk_checksums), without the GIL.
template <typename Walk>
auto walk_chunk(const py::buffer& data, int64_t start, int64_t end, bool has_dictionary, uint32_t encoding_mask,
                Walk walk) {
  const py::buffer_info info = integer_buffer(data, 1, "data", false);
  if (start < 0 || end < start || end > info.size) throw py::value_error("the column chunk lies outside the data");
  py::gil_scoped_release unlocked;
  return walk(static_cast<const uint8_t*>(info.ptr), static_cast<size_t>(start), static_cast<size_t>(end),
              has_dictionary, encoding_mask);
}

py::tuple parquet_chunk_pages_binding(const py::buffer& data, int64_t start, int64_t end, bool has_dictionary,
                                      uint32_t encoding_mask) {
  const ChunkPages pages = walk_chunk(data, start, end, has_dictionary, encoding_mask, chunk_pages);
  return py::make_tuple(vector_bytes(pages.pages), pages.values, pages.problem, pages.problem_at);
}

py::tuple parquet_chunk_checksums_binding(const py::buffer& data, int64_t start, int64_t end, bool has_dictionary,
                                          uint32_t encoding_mask) {
  const ChunkChecksums checked = walk_chunk(data, start, end, has_dictionary, encoding_mask, chunk_checksums);
  return py::make_tuple(static_cast<int>(checked.verdict), checked.page_at, checked.values, checked.problem,
                        checked.problem_at);
}

// Offsets of an Arrow string or large_string column (int32 or int64, one more than the texts) and
// its data: the offsets must rise from within the data and end inside it.
template <typename Offset>
py::bytes md5_of_texts(const py::buffer& offsets, const py::buffer& data) {
  py::buffer_info offsets_info, data_info;
  const auto* starts = column<Offset>(offsets, offsets_info, "text offsets");
  const auto* bytes = column<uint8_t>(data, data_info, "text data");
  if (offsets_info.size < 1) throw py::value_error("text offsets: expected one more than the texts");
  const size_t texts = static_cast<size_t>(offsets_info.size - 1);
  if (starts[0] < 0) throw py::value_error("text offsets: negative");
  for (size_t i = 0; i < texts; ++i) {
    if (starts[i + 1] < starts[i]) throw py::value_error("text offsets: not rising");
  }
  if (static_cast<int64_t>(starts[texts]) > static_cast<int64_t>(data_info.size)) {
    throw py::value_error("text offsets: past the data");
  }
  std::string out(texts * sizeof(uint64_t), '\0');
  {
    py::gil_scoped_release unlocked;
    md5_low64_texts(starts, texts, bytes, reinterpret_cast<uint64_t*>(out.data()));
  }
  return py::bytes(out);
}

py::bytes md5_low64_binding(const py::buffer& offsets, const py::buffer& data) {
  const ssize_t width = offsets.request().itemsize;
  if (width == 4) return md5_of_texts<int32_t>(offsets, data);
  if (width == 8) return md5_of_texts<int64_t>(offsets, data);
  throw py::value_error("text offsets: expected 4- or 8-byte integers");
}

}  // namespace

void register_ingest_bindings(py::module_& m) {
  m.def("hash_raw_stacks", &hash_raw_stacks_binding, py::arg("status"), py::arg("native_offsets"),
        py::arg("native_module"), py::arg("native_address"), py::arg("native_flags"), py::arg("python_offsets"),
        py::arg("python_code"), py::arg("python_line"), py::arg("python_flags"), py::arg("module_index"),
        py::arg("module_hash"), py::arg("code_id"), py::arg("code_hash"),
        "Portable hash of each raw stack (schemas/identity.py's), from Arrow list offsets and frame "
        "columns; uint64 bytes.");
  m.def("md5_low64", &md5_low64_binding, py::arg("offsets"), py::arg("data"),
        "Low 64 bits of each text's MD5 (DuckDB's md5_number_lower), from an Arrow string column's offsets "
        "(int32 or int64) and data; uint64 bytes.");
  m.def("distinct_rows", &distinct_rows_binding, py::arg("rows"), py::arg("width"), py::arg("exact_pass_only") = false,
        "Rows of `width` bytes: (id of each row's value, first row of each id), int64 bytes; ids in order of "
        "first appearance.");
  m.def("combined_order", &combined_order_binding, py::arg("native_lengths"), py::arg("python_lengths"),
        py::arg("status"), py::arg("native_flags"), py::arg("python_flags"), py::arg("no_native_bit"),
        py::arg("marker_bit"), py::arg("eval_bit"), py::arg("entry_bit"),
        "Combined order of a batch of stacks (pipeline/stacks/layout.py's combined_slots): bytes of per-slot "
        "owner (int64), source row (int64), is_python (uint8), slot (int32), and per-stack has_native (uint8), "
        "truncated (uint8), leftover (int64).");
  m.def("slot_columns", &slot_columns_binding, py::arg("source"), py::arg("is_python"), py::arg("native_ref"),
        py::arg("native_address"), py::arg("native_flags"), py::arg("python_ref"), py::arg("python_line"),
        py::arg("python_flags"), py::arg("code_first_line"), py::arg("marker_bit"), py::arg("exact_bit"),
        py::arg("origin_bit"), py::arg("python_kind"), py::arg("native_kind"), py::arg("marker_kind"),
        "The columns combined_slots shows of each slot of a combined order, in one pass: bytes of kind (int8), "
        "module row (int64), code row (int64), address (uint64), exact (uint8), line (int32), inlined (uint8), "
        "first line (int32).");
  m.def("inline_rows", &inline_rows_binding, py::arg("stack_id"), py::arg("slot"), py::arg("kind"), py::arg("key_code"),
        py::arg("address"), py::arg("exact"), py::arg("module_code"), py::arg("function_code"), py::arg("file_code"),
        py::arg("line"), py::arg("first_line"), py::arg("inlined"), py::arg("symbol_key_code"),
        py::arg("symbol_address"), py::arg("symbol_exact"), py::arg("symbol_depth"), py::arg("python_kind"),
        py::arg("native_kind"),
        "Inline expansion of slots (pipeline/stacks/layout.py's expand), integers only: numpy arrays of per-row "
        "stack id (int64), depth, slot, chain depth and frame id (int32), and per frame the slot of its first row "
        "and its symbols row (int64, -1 for a slot's own frame).");
  m.def("parquet_chunk_pages", &parquet_chunk_pages_binding, py::arg("data"), py::arg("start"), py::arg("end"),
        py::arg("has_dictionary"), py::arg("encoding_mask"),
        "The page headers of the Parquet column chunk data[start:end], checked against the footer's word on the "
        "chunk (a dictionary page first, bit e of encoding_mask per encoding listed): (bytes of int64 (header, "
        "body, end, crc or -1) per page, values of its data pages, problem ('' when none), offset of the damaged "
        "page's header).");
  m.def("parquet_chunk_checksums", &parquet_chunk_checksums_binding, py::arg("data"), py::arg("start"), py::arg("end"),
        py::arg("has_dictionary"), py::arg("encoding_mask"),
        "parquet_chunk_pages, then each page's bytes checked against its CRC-32, in file order: (verdict: 0 every "
        "page checked matches, 1 a page carries no CRC, 2 a page's CRC differs; the header offset of that page or "
        "-1; values of the data pages; problem ('' when none); offset of the damaged page's header).");
}

}  // namespace tbpipe
