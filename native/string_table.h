// Interned event kinds and names: events carry 32-bit ids, the run's string
// table maps them back. Python str objects are looked up by address without a
// lock (the table keeps them alive, so an address is never reused); text from
// native sources (kernel names) goes through a content map under a mutex.
#pragma once

#include <Python.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tbpipe {

class StringTable {
 public:
  static StringTable& instance();
  // The GIL must be held. Returns 0 when `text` is not a str.
  uint32_t intern_python(PyObject* text);
  // Any thread, with or without the GIL.
  uint32_t intern_utf8(const char* data, size_t size);
  // Strings with ids in [first_id, first_id + returned size), for the flusher.
  std::vector<std::string> since(uint32_t first_id) const;
  void reset_after_fork();

 private:
  StringTable();
  struct Impl;
  Impl* impl_;
};

}  // namespace tbpipe
