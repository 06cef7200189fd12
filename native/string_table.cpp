#include "string_table.h"

#include <mutex>
#include <unordered_map>

#include "pointer_map.h"

namespace tbpipe {

constexpr size_t kMaxPinnedObjects = 1u << 16;

struct StringTable::Impl {
  PointerIdMap by_object;    // writers hold the GIL
  mutable std::mutex mutex;  // guards the two members below
  std::unordered_map<std::string, uint32_t> by_text;
  std::vector<std::string> texts;  // index = id - 1
};

StringTable::StringTable() : impl_(new Impl) {}

StringTable& StringTable::instance() {
  static StringTable* table = new StringTable();  // never destroyed: used until exit
  return *table;
}

uint32_t StringTable::intern_utf8(const char* data, size_t size) {
  std::lock_guard<std::mutex> guard(impl_->mutex);
  auto [it, inserted] = impl_->by_text.try_emplace(std::string(data, size), 0);
  if (inserted) {
    impl_->texts.push_back(it->first);
    it->second = static_cast<uint32_t>(impl_->texts.size());
  }
  return it->second;
}

uint32_t StringTable::intern_python(PyObject* text) {
  uint64_t id = impl_->by_object.find(reinterpret_cast<uintptr_t>(text));
  if (id != 0) return static_cast<uint32_t>(id);
  if (!PyUnicode_Check(text)) return 0;
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(text, &size);
  if (data == nullptr) {
    PyErr_Clear();
    return 0;
  }
  uint32_t interned = intern_utf8(data, static_cast<size_t>(size));
  // Programs that build a fresh name per event would make this table grow
  // without bound; past the cap they take the content path only.
  if (impl_->by_object.size() >= kMaxPinnedObjects) return interned;
  Py_INCREF(text);  // kept alive so its address cannot be reused by another str
  impl_->by_object.insert(reinterpret_cast<uintptr_t>(text), interned);
  return interned;
}

std::vector<std::string> StringTable::since(uint32_t first_id) const {
  std::lock_guard<std::mutex> guard(impl_->mutex);
  if (first_id == 0) first_id = 1;
  if (first_id > impl_->texts.size()) return {};
  return std::vector<std::string>(impl_->texts.begin() + (first_id - 1), impl_->texts.end());
}

void StringTable::reset_after_fork() { new (&impl_->mutex) std::mutex(); }

}  // namespace tbpipe
