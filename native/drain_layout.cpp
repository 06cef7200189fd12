#include "drain_layout.h"

#include <algorithm>

namespace tbpipe {

void fill_dictionary(const std::vector<uint32_t>& ids, bool zero_is_null, DictionaryColumn* column) {
  column->indices.resize(ids.size());
  column->strings.clear();
  column->validity.clear();
  if (ids.empty()) return;
  // Ids are dense (the string table's), so an array maps each to its place in the dictionary.
  std::vector<int32_t> place(static_cast<size_t>(*std::max_element(ids.begin(), ids.end())) + 1, -1);
  for (size_t i = 0; i < ids.size(); ++i) {
    const uint32_t id = ids[i];
    if (id == 0 && zero_is_null) {
      column->indices[i] = 0;
      continue;
    }
    int32_t& index = place[id];
    if (index < 0) {
      index = static_cast<int32_t>(column->strings.size());
      column->strings.push_back(id);
    }
    column->indices[i] = index;
  }
  if (zero_is_null) fill_validity(&column->validity, ids.size(), [&](size_t i) { return ids[i] != 0; });
}

}  // namespace tbpipe
