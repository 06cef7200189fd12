// A map from object address to a small id that readers probe without locks.
//
// Writers are serialized by the caller (the GIL or a mutex). A slot's value is
// stored before its key is published, so a reader that sees the key sees the
// value. Growing publishes a new table and retires the old one without freeing
// it: a reader may still be probing it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace tbpipe {

class PointerIdMap {
 public:
  explicit PointerIdMap(size_t initial_capacity = 1024) {
    table_.store(new_table(initial_capacity), std::memory_order_release);
  }
  PointerIdMap(const PointerIdMap&) = delete;
  PointerIdMap& operator=(const PointerIdMap&) = delete;

  // Id stored for `key`, or 0 when absent.
  uint64_t find(uintptr_t key) const {
    const Table* table = table_.load(std::memory_order_acquire);
    for (size_t i = mix(key) & table->mask;; i = (i + 1) & table->mask) {
      uintptr_t slot_key = table->slots[i].key.load(std::memory_order_acquire);
      if (slot_key == key) return table->slots[i].value.load(std::memory_order_relaxed);
      if (slot_key == 0) return 0;
    }
  }

  // Writers only, one at a time. Overwrites an existing entry.
  void insert(uintptr_t key, uint64_t value) {
    Table* table = table_.load(std::memory_order_relaxed);
    if ((count_ + 1) * 2 > table->mask + 1) table = grow(table);
    if (place(table, key, value)) ++count_;
  }

  // Forget everything (after fork, or when a session starts afresh).
  void clear() {
    Table* old = table_.load(std::memory_order_relaxed);
    table_.store(new_table(old->mask + 1), std::memory_order_release);
    retired_.emplace_back(old);
    count_ = 0;
  }

  size_t size() const { return count_; }

 private:
  struct Slot {
    std::atomic<uintptr_t> key{0};
    std::atomic<uint64_t> value{0};
  };
  struct Table {
    size_t mask = 0;
    std::unique_ptr<Slot[]> slots;
  };

  static size_t mix(uintptr_t key) {
    uint64_t x = static_cast<uint64_t>(key);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return static_cast<size_t>(x);
  }

  static Table* new_table(size_t capacity) {
    size_t rounded = 16;
    while (rounded < capacity) rounded <<= 1;
    Table* table = new Table;
    table->mask = rounded - 1;
    table->slots.reset(new Slot[rounded]);
    return table;
  }

  // Returns true when a new key was added.
  static bool place(Table* table, uintptr_t key, uint64_t value) {
    for (size_t i = mix(key) & table->mask;; i = (i + 1) & table->mask) {
      uintptr_t slot_key = table->slots[i].key.load(std::memory_order_relaxed);
      if (slot_key == key) {
        table->slots[i].value.store(value, std::memory_order_relaxed);
        return false;
      }
      if (slot_key == 0) {
        table->slots[i].value.store(value, std::memory_order_relaxed);
        table->slots[i].key.store(key, std::memory_order_release);
        return true;
      }
    }
  }

  Table* grow(Table* old) {
    Table* bigger = new_table((old->mask + 1) * 2);
    for (size_t i = 0; i <= old->mask; ++i) {
      uintptr_t key = old->slots[i].key.load(std::memory_order_relaxed);
      if (key != 0) place(bigger, key, old->slots[i].value.load(std::memory_order_relaxed));
    }
    table_.store(bigger, std::memory_order_release);
    retired_.emplace_back(old);
    return bigger;
  }

  std::atomic<Table*> table_{nullptr};
  size_t count_ = 0;
  std::vector<std::unique_ptr<Table>> retired_;
};

}  // namespace tbpipe
