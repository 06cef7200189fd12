// Bindings of the offline symbolizer's native helpers (symcache_lookup.h),
// registered into tbpipe._native by bindings.cpp through
// register_symbolize_bindings(). Columns travel as bytes in the layout of
// the `array` typecodes the Python side uses ('Q', 'I', 'i', 'B').
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "buffer_args.h"
#include "line_table.h"
#include "symcache_lookup.h"

namespace py = pybind11;

namespace tbpipe {
namespace {

template <typename T>
py::bytes as_bytes(const std::vector<T>& values) {
  return py::bytes(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// Text as Python str. "surrogatepass" first: a string that came from Python
// with lone surrogates (a file name that is not UTF-8, decoded with
// surrogateescape) comes back as it was; other invalid bytes read as U+FFFD.
py::str decode_utf8(const std::string& text) {
  const auto size = static_cast<Py_ssize_t>(text.size());
  PyObject* decoded = PyUnicode_DecodeUTF8(text.data(), size, "surrogatepass");
  if (decoded == nullptr) {
    PyErr_Clear();
    decoded = PyUnicode_DecodeUTF8(text.data(), size, "replace");
  }
  if (decoded == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(decoded);
}

// The UTF-8 bytes of a str, lone surrogates included (encoded as they are).
std::string utf8_of(PyObject* text) {
  Py_ssize_t size = 0;
  if (const char* data = PyUnicode_AsUTF8AndSize(text, &size)) return std::string(data, static_cast<size_t>(size));
  PyErr_Clear();
  PyObject* encoded = PyUnicode_AsEncodedString(text, "utf-8", "surrogatepass");
  if (encoded == nullptr) throw py::error_already_set();
  std::string bytes(PyBytes_AS_STRING(encoded), static_cast<size_t>(PyBytes_GET_SIZE(encoded)));
  Py_DECREF(encoded);
  return bytes;
}

// The bytes of a Python bytes object (valid while it lives).
std::string_view bytes_view(const py::bytes& data) {
  char* buffer = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(data.ptr(), &buffer, &size) != 0) throw py::error_already_set();
  return std::string_view(buffer, static_cast<size_t>(size));
}

std::vector<uint64_t> u64_vector(const py::buffer& buffer, const char* what) {
  py::buffer_info info = integer_buffer(buffer, 8, what, false);
  const auto* data = static_cast<const uint64_t*>(info.ptr);
  return std::vector<uint64_t>(data, data + info.size);
}

// symbolic's structures as cffi sees them in the installed library must be
// the ones this file was compiled for; a silent mismatch would read garbage.
void check_layout(const py::dict& layout) {
  const std::pair<const char*, size_t> expected[] = {
      {"location_size", sizeof(SymbolicSourceLocationAbi)},
      {"line", offsetof(SymbolicSourceLocationAbi, line)},
      {"symbol", offsetof(SymbolicSourceLocationAbi, symbol)},
      {"full_path", offsetof(SymbolicSourceLocationAbi, full_path)},
      {"str_size", sizeof(SymbolicStrAbi)},
      {"str_len", offsetof(SymbolicStrAbi, len)},
      {"str_owned", offsetof(SymbolicStrAbi, owned)},
      {"result_size", sizeof(SymbolicLookupResultAbi)},
      {"result_len", offsetof(SymbolicLookupResultAbi, len)},
  };
  for (const auto& [name, value] : expected) {
    if (!layout.contains(name) || layout[name].cast<size_t>() != value) {
      throw py::value_error(std::string("the installed symbolic's C ABI differs from the one tbpipe was built for (") +
                            name + ")");
    }
  }
}

class PySymCacheLookup {
 public:
  PySymCacheLookup(py::object owner, uintptr_t symcache, uintptr_t lookup, uintptr_t free_result, uintptr_t free_str,
                   const py::dict& layout)
      : owner_(std::move(owner)) {
    check_layout(layout);
    if (symcache == 0 || lookup == 0 || free_result == 0 || free_str == 0) {
      throw py::value_error("null SymCache handle or symbolic function");
    }
    SymbolicFunctions functions;
    functions.lookup = reinterpret_cast<decltype(functions.lookup)>(lookup);
    functions.free_result = reinterpret_cast<decltype(functions.free_result)>(free_result);
    functions.free_str = reinterpret_cast<decltype(functions.free_str)>(free_str);
    py::list strings = strings_;
    lookup_ = std::make_unique<SymCacheBatchLookup>(
        functions, reinterpret_cast<void*>(symcache),
        [strings](int32_t, const std::string& text) mutable { strings.append(decode_utf8(text)); });
  }

  py::list strings() const { return strings_; }

  int32_t intern(const py::object& text) {
    if (text.is_none()) return -1;
    if (!PyUnicode_Check(text.ptr())) throw py::type_error("intern() takes a str or None");
    return lookup_->intern(utf8_of(text.ptr()));
  }

  void set_symbols(const py::buffer& starts, const py::buffer& ends, py::object name_of) {
    auto start_values = u64_vector(starts, "starts");
    auto end_values = u64_vector(ends, "ends");
    if (start_values.size() != end_values.size()) throw py::value_error("starts and ends differ in length");
    name_of_ = std::move(name_of);
    py::object callback = name_of_;
    lookup_->set_symbols(std::move(start_values), std::move(end_values), [callback](size_t index) -> std::string {
      py::object name = callback(index);
      if (!PyUnicode_Check(name.ptr())) return std::string();  // None: the SymCache's name stays
      return utf8_of(name.ptr());
    });
  }

  void set_code_ranges(const std::vector<std::pair<uint64_t, uint64_t>>& ranges) { lookup_->set_code_ranges(ranges); }

  py::tuple resolve(const py::buffer& keys, int32_t reason, unsigned threads) {
    py::buffer_info info = integer_buffer(keys, 8, "keys", false);
    LookupColumns out;
    lookup_->resolve(static_cast<const uint64_t*>(info.ptr), static_cast<size_t>(info.size), reason, &out,
                     std::max(1u, std::min(threads, 64u)));
    py::list without_line;
    for (const auto& [entry, position] : out.without_line) without_line.append(py::make_tuple(entry, position));
    return py::make_tuple(as_bytes(out.keys), as_bytes(out.counts), as_bytes(out.reasons), as_bytes(out.functions),
                          as_bytes(out.files), as_bytes(out.lines), as_bytes(out.inlined), without_line,
                          py::cast(out.outside), py::cast(out.empty));
  }

  int32_t symbol_id(uint64_t address) { return lookup_->symbol_name_id(address); }

  py::tuple lookup_flat(const py::buffer& keys) {
    py::buffer_info info = integer_buffer(keys, 8, "keys", false);
    std::vector<uint32_t> counts, lines;
    std::vector<int32_t> functions, files;
    lookup_->lookup_flat(static_cast<const uint64_t*>(info.ptr), static_cast<size_t>(info.size), &counts, &functions,
                         &files, &lines);
    return py::make_tuple(py::cast(counts), py::cast(functions), py::cast(files), py::cast(lines));
  }

 private:
  py::object owner_;  // keeps the SymCache, and so the handle, alive
  py::list strings_;  // the interned strings by id, mirrored as Python str
  py::object name_of_;
  std::unique_ptr<SymCacheBatchLookup> lookup_;
};

std::vector<int32_t> compact_ids(const py::args& columns) {
  std::vector<py::buffer_info> infos;
  std::vector<std::pair<int32_t*, size_t>> views;
  infos.reserve(columns.size());
  for (const py::handle& column : columns) {
    infos.push_back(integer_buffer(py::reinterpret_borrow<py::buffer>(column), 4, "string id column", true));
    views.emplace_back(static_cast<int32_t*>(infos.back().ptr), static_cast<size_t>(infos.back().size));
  }
  return compact_string_ids(views);
}

class PyLineTable {
 public:
  PyLineTable(py::bytes debug_line, py::bytes debug_line_str, py::bytes debug_str, bool little_endian)
      : debug_line_(std::move(debug_line)),
        debug_line_str_(std::move(debug_line_str)),
        debug_str_(std::move(debug_str)),
        index_(bytes_view(debug_line_), bytes_view(debug_line_str_), bytes_view(debug_str_), little_endian) {}

  void build() {
    py::gil_scoped_release released;  // pure C++ over bytes this object keeps alive
    std::lock_guard<std::mutex> guard(mutex_);
    index_.build();
  }

  py::object row(uint64_t address) {
    uint32_t unit = 0, file = 0, line = 0;
    bool found = false;
    {
      std::lock_guard<std::mutex> guard(mutex_);  // against a build() on another thread
      found = index_.row(address, &unit, &file, &line);
    }
    if (!found) return py::none();
    return py::make_tuple(unit, file, line);
  }

  py::tuple unit(size_t index) {
    std::lock_guard<std::mutex> guard(mutex_);
    if (index >= index_.units().size()) throw py::index_error("no such line-table unit");
    const LineUnitHeader& header = index_.units()[index];
    py::list directories, files;
    for (const std::string& directory : header.directories) directories.append(decode_utf8(directory));
    for (const auto& [name, directory] : header.files) files.append(py::make_tuple(decode_utf8(name), directory));
    return py::make_tuple(header.version, header.offset, directories, files);
  }

  size_t unit_count() {
    std::lock_guard<std::mutex> guard(mutex_);
    return index_.units().size();
  }
  size_t sequence_count() {
    std::lock_guard<std::mutex> guard(mutex_);
    return index_.sequence_count();
  }
  std::string problem() {
    std::lock_guard<std::mutex> guard(mutex_);
    return index_.problem();
  }

 private:
  py::bytes debug_line_;
  py::bytes debug_line_str_;
  py::bytes debug_str_;
  std::mutex mutex_;  // build() runs without the GIL
  LineTableIndex index_;
};

// UTF-8 views of a list of str, made on first use (the list keeps them alive).
class TextColumn {
 public:
  explicit TextColumn(const py::list& texts) : texts_(texts), views_(texts.size()), made_(texts.size(), false) {}

  // Id -1 (none) reads "??", as binutils prints unknowns.
  std::string_view at(int32_t id) {
    if (id < 0 || static_cast<size_t>(id) >= views_.size()) return "??";
    const auto index = static_cast<size_t>(id);
    if (!made_[index]) {
      PyObject* text = PyList_GET_ITEM(texts_.ptr(), static_cast<Py_ssize_t>(index));
      if (!PyUnicode_Check(text)) throw py::type_error("text columns hold str");
      Py_ssize_t size = 0;
      if (const char* data = PyUnicode_AsUTF8AndSize(text, &size)) {
        views_[index] = std::string_view(data, static_cast<size_t>(size));
      } else {
        PyErr_Clear();  // lone surrogates: printed as the bytes they stand for
        views_[index] = owned_.emplace_back(utf8_of(text));
      }
      made_[index] = true;
    }
    return views_[index];
  }

 private:
  py::list texts_;
  std::vector<std::string_view> views_;
  std::vector<bool> made_;
  std::deque<std::string> owned_;  // UTF-8 made here (a deque keeps views into it valid)
};

// binutils addr2line's text for each (address, table entry): what `tbpipe addr2line`
// prints. Entry -1 is an address nothing is known of.
py::bytes format_addr2line(const py::buffer& addresses, const py::buffer& entries, const py::buffer& starts,
                           const py::buffer& counts, const py::buffer& functions, const py::buffer& files,
                           const py::buffer& lines, const py::list& name_texts, const py::list& file_texts,
                           bool show_addresses, bool show_functions, bool inlines, bool pretty) {
  py::buffer_info address_info = integer_buffer(addresses, 8, "addresses", false);
  py::buffer_info entry_info = integer_buffer(entries, 8, "entries", false);
  py::buffer_info start_info = integer_buffer(starts, 8, "starts", false);
  py::buffer_info count_info = integer_buffer(counts, 4, "counts", false);
  py::buffer_info function_info = integer_buffer(functions, 4, "functions", false);
  py::buffer_info file_info = integer_buffer(files, 4, "files", false);
  py::buffer_info line_info = integer_buffer(lines, 4, "lines", false);
  if (address_info.size != entry_info.size) throw py::value_error("addresses and entries differ in length");
  if (start_info.size != count_info.size) throw py::value_error("starts and counts differ in length");
  if (function_info.size != file_info.size || function_info.size != line_info.size) {
    throw py::value_error("frame columns differ in length");
  }
  const auto* address_of = static_cast<const uint64_t*>(address_info.ptr);
  const auto* entry_of = static_cast<const int64_t*>(entry_info.ptr);
  const auto* start_of = static_cast<const uint64_t*>(start_info.ptr);
  const auto* count_of = static_cast<const uint32_t*>(count_info.ptr);
  const auto* function_of = static_cast<const int32_t*>(function_info.ptr);
  const auto* file_of = static_cast<const int32_t*>(file_info.ptr);
  const auto* line_of = static_cast<const uint32_t*>(line_info.ptr);
  const auto entry_count = static_cast<int64_t>(count_info.size);
  const auto frame_count = static_cast<uint64_t>(function_info.size);
  TextColumn names(name_texts);
  TextColumn paths(file_texts);
  const std::string_view separator = pretty ? " at " : "\n";
  std::string out;
  out.reserve(static_cast<size_t>(address_info.size) * 160);
  static constexpr char kHex[] = "0123456789abcdef";
  for (ssize_t i = 0; i < address_info.size; ++i) {
    if (show_addresses) {
      char text[20] = {'0', 'x'};
      for (int digit = 0; digit < 16; ++digit) text[2 + digit] = kHex[(address_of[i] >> (60 - 4 * digit)) & 0xf];
      out.append(text, 18);
      out.append(pretty ? ": " : "\n");
    }
    const int64_t entry = entry_of[i];
    uint64_t start = 0;
    uint32_t count = 0;
    if (entry >= 0 && entry < entry_count) {
      start = start_of[entry];
      count = count_of[entry];
      if (start > frame_count || count > frame_count - start) throw py::value_error("entry frames out of range");
    }
    if (count == 0) {
      if (show_functions) out.append(pretty ? "?? " : "??\n");
      out.append("??:0\n");
      continue;
    }
    if (!inlines) count = 1;  // the innermost frame only, as binutils without -i
    for (uint64_t frame = start; frame < start + count; ++frame) {
      if (frame != start && pretty) out.append(" (inlined by) ");
      if (show_functions) {
        out.append(names.at(function_of[frame]));
        out.append(separator);
      }
      out.append(paths.at(file_of[frame]));
      out.push_back(':');
      if (line_of[frame] != 0) {
        char digits[10];
        size_t count_digits = 0;
        for (uint32_t value = line_of[frame]; value != 0; value /= 10) digits[count_digits++] = char('0' + value % 10);
        while (count_digits > 0) out.push_back(digits[--count_digits]);
      } else {
        out.push_back('?');
      }
      out.push_back('\n');
    }
  }
  return py::bytes(out);
}

// One address per line, read as binutils 2.40 addr2line reads them: leading
// blanks, an optional 0x, hex digits up to the first other character; no
// digits (a sign included) -> 0, more than 64 bits -> all ones.
std::vector<uint64_t> parse_addresses(std::string_view text) {
  std::vector<uint64_t> out;
  out.reserve(static_cast<size_t>(std::count(text.begin(), text.end(), '\n')) + 1);
  auto hex_value = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  size_t pos = 0;
  while (true) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    size_t at = pos;
    while (at < end && (text[at] == ' ' || (text[at] >= '\t' && text[at] <= '\r'))) ++at;
    if (at + 2 < end && text[at] == '0' && (text[at + 1] == 'x' || text[at + 1] == 'X') &&
        hex_value(text[at + 2]) >= 0) {
      at += 2;
    }
    uint64_t value = 0;
    bool overflow = false;
    for (; at < end && hex_value(text[at]) >= 0; ++at) {
      if (value >> 60) overflow = true;
      value = (value << 4) | static_cast<uint64_t>(hex_value(text[at]));
    }
    out.push_back(overflow ? ~uint64_t{0} : value);
    if (end == text.size()) break;
    pos = end + 1;
  }
  return out;
}

}  // namespace

void register_symbolize_bindings(py::module_& m) {
  py::class_<PySymCacheLookup>(m, "SymCacheLookup",
                               "Batched lookups in one symbolic SymCache through its C ABI (see symcache_lookup.h).")
      .def(py::init<py::object, uintptr_t, uintptr_t, uintptr_t, uintptr_t, const py::dict&>(), py::arg("owner"),
           py::arg("symcache"), py::arg("lookup"), py::arg("free_result"), py::arg("free_str"), py::arg("layout"))
      .def_property_readonly("strings", &PySymCacheLookup::strings, "interned strings by id (a live list)")
      .def("intern", &PySymCacheLookup::intern, py::arg("text"), "id of a string (None -> -1)")
      .def("set_symbols", &PySymCacheLookup::set_symbols, py::arg("starts"), py::arg("ends"), py::arg("name_of"),
           "function symbols sorted by start (uint64 buffers) and a callable giving symbol i's name")
      .def("set_code_ranges", &PySymCacheLookup::set_code_ranges, py::arg("ranges"),
           "executable [start, end) ranges; other addresses are reported outside")
      .def("resolve", &PySymCacheLookup::resolve, py::arg("keys"), py::arg("reason"), py::arg("threads") = 1,
           "(keys, counts, reasons, functions, files, lines, inlined) as bytes, then (entry, frame) "
           "pairs without a line, keys outside the code ranges, keys without frames")
      .def("symbol_id", &PySymCacheLookup::symbol_id, py::arg("address"),
           "string id of the function symbol containing an address, as set_symbols gave them (-1: none)")
      .def("lookup_flat", &PySymCacheLookup::lookup_flat, py::arg("keys"),
           "(frame count per key, function id, file id and line per frame) as lists");
  py::class_<PyLineTable>(m, "LineTable", "A DWARF .debug_line section indexed by sequence (see line_table.h).")
      .def(py::init<py::bytes, py::bytes, py::bytes, bool>(), py::arg("debug_line"), py::arg("debug_line_str"),
           py::arg("debug_str"), py::arg("little_endian") = true)
      .def("build", &PyLineTable::build, "index every unit (the GIL is released meanwhile)")
      .def("row", &PyLineTable::row, py::arg("address"),
           "(unit, file index as the unit numbers files, line) of the row covering the address, or None")
      .def("unit", &PyLineTable::unit, py::arg("index"),
           "(version, offset, directories, [(file name, directory index)]) of one unit")
      .def_property_readonly("unit_count", &PyLineTable::unit_count)
      .def_property_readonly("sequence_count", &PyLineTable::sequence_count)
      .def_property_readonly("problem", &PyLineTable::problem, "the first unit that could not be read, and why");
  m.def("format_addr2line", &format_addr2line, py::arg("addresses"), py::arg("entries"), py::arg("starts"),
        py::arg("counts"), py::arg("functions"), py::arg("files"), py::arg("lines"), py::arg("name_texts"),
        py::arg("file_texts"), py::arg("show_addresses"), py::arg("show_functions"), py::arg("inlines"),
        py::arg("pretty"),
        "binutils addr2line output (bytes) for addresses and their result-table entries (int64, -1: unknown).");
  m.def(
      "remap_string_ids",
      [](const py::buffer& values, const py::buffer& remap) {
        py::buffer_info value_info = integer_buffer(values, 4, "values", false);
        py::buffer_info remap_info = integer_buffer(remap, 4, "remap", false);
        const auto* value_of = static_cast<const int32_t*>(value_info.ptr);
        const auto* remap_of = static_cast<const int32_t*>(remap_info.ptr);
        std::vector<int32_t> out(static_cast<size_t>(value_info.size));
        for (size_t i = 0; i < out.size(); ++i) {
          const int32_t value = value_of[i];
          if (value >= remap_info.size) throw py::value_error("string id out of range");
          out[i] = value >= 0 ? remap_of[value] : -1;
        }
        return as_bytes(out);
      },
      py::arg("values"), py::arg("remap"), "int32 string ids through a table of new ids (-1 stays -1), as bytes.");
  m.def(
      "parse_addresses", [](const py::bytes& text) { return as_bytes(parse_addresses(bytes_view(text))); },
      py::arg("text"), "Addresses, one per line, read like binutils addr2line (strtoul base 16), as uint64 bytes.");
  m.def("compact_string_ids", &compact_ids,
        "Renumber the string ids in int32 buffers (in place) densely; returns the old id of each new id.");
}

}  // namespace tbpipe
