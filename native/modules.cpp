// ModuleRegistry: the process's loaded ELF objects, their build-IDs and ranges.
//
// Readers (the unwinder, possibly on many threads at once) only ever touch an
// immutable snapshot published through an atomic pointer, and Module records
// that never change after they are published. Writers serialize on one mutex.
// Replaced snapshots are kept, never freed: a reader may still be searching one.

// Python.h first, as CPython asks: it declares _PyEval_EvalFrameDefault, whose
// address tells which loaded object is the interpreter.
#include "modules.h"

#include <Python.h>
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

namespace tbpipe {

struct ModuleRegistry::Snapshot {
  struct Entry {
    uintptr_t lo;
    uintptr_t hi;
    int32_t index;
  };
  std::vector<Entry> entries;  // sorted by lo, non-overlapping in practice
  std::vector<int32_t> live;   // sorted module indices present in this snapshot
};

namespace {

// Writer-side state. The registry is a process-wide singleton, so this lives
// here rather than in the header.
struct WriterState {
  std::mutex mu;
  // (path, load_bias, build_id) -> index: a different object mapped at a reused
  // address differs in path or build-ID and so gets a fresh index.
  std::map<std::tuple<std::string, uintptr_t, std::string>, int32_t> known;
  std::vector<const void*> retired;  // old snapshots, kept reachable on purpose
};

void remake_writer_lock_in_child();

WriterState& writer_state() {
  static WriterState* state = [] {
    // A fork while another thread refreshes would leave the child's copy of
    // the mutex locked forever; the child remakes it (only one thread exists there).
    pthread_atfork(nullptr, nullptr, remake_writer_lock_in_child);
    return new WriterState();
  }();
  return *state;
}

void remake_writer_lock_in_child() { new (&writer_state().mu) std::mutex(); }

// What dl_iterate_phdr reports for one object, copied while the loader lock is
// held so that nothing it points at can be unmapped under us.
struct ScannedObject {
  std::string name;
  bool is_main = false;
  uintptr_t bias = 0;
  std::string build_id;
  std::vector<AddressRange> exec;
  std::vector<AddressRange> readable;
  AddressRange image{UINTPTR_MAX, 0};
  const uint8_t* eh_frame_hdr = nullptr;
  size_t eh_frame_hdr_size = 0;
};

bool range_inside(const std::vector<AddressRange>& ranges, uintptr_t lo, uintptr_t hi) {
  for (const AddressRange& r : ranges) {
    if (lo >= r.lo && hi <= r.hi && lo <= hi) return true;
  }
  return false;
}

std::string to_hex(const uint8_t* p, size_t n) {
  static const char kDigits[] = "0123456789abcdef";
  std::string s;
  s.reserve(n * 2);
  for (size_t i = 0; i < n; ++i) {
    s.push_back(kDigits[p[i] >> 4]);
    s.push_back(kDigits[p[i] & 15]);
  }
  return s;
}

// Walks the notes of one PT_NOTE segment in memory. Note entries are padded to
// the segment's alignment (4 for classic notes, 8 for .note.gnu.property).
std::string build_id_from_notes(const uint8_t* p, size_t size, size_t align) {
  if (align != 8) align = 4;
  size_t off = 0;
  while (off <= size && size - off >= 12) {
    uint32_t namesz, descsz, type;
    memcpy(&namesz, p + off, 4);
    memcpy(&descsz, p + off + 4, 4);
    memcpy(&type, p + off + 8, 4);
    off += 12;
    size_t name_padded = (static_cast<size_t>(namesz) + align - 1) & ~(align - 1);
    size_t desc_padded = (static_cast<size_t>(descsz) + align - 1) & ~(align - 1);
    if (name_padded > size - off) break;
    const uint8_t* name = p + off;
    off += name_padded;
    if (descsz > size - off) break;
    const uint8_t* desc = p + off;
    if (type == NT_GNU_BUILD_ID && namesz == 4 && memcmp(name, "GNU", 4) == 0 && descsz > 0) {
      return to_hex(desc, descsz);
    }
    if (desc_padded > size - off) break;
    off += desc_padded;
  }
  return std::string();
}

std::string main_program_path() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return std::string();
  return std::string(buf, static_cast<size_t>(n));
}

int collect_object(struct dl_phdr_info* info, size_t /*size*/, void* data) {
  auto* out = static_cast<std::vector<ScannedObject>*>(data);
  ScannedObject obj;
  obj.bias = info->dlpi_addr;
  const char* name = info->dlpi_name ? info->dlpi_name : "";
  // glibc reports the main program first, with an empty name.
  obj.is_main = out->empty() && name[0] == '\0';
  obj.name = name;

  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr) & ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD || ph.p_memsz == 0) continue;
    AddressRange r{info->dlpi_addr + ph.p_vaddr, info->dlpi_addr + ph.p_vaddr + ph.p_memsz};
    if (r.hi < r.lo) continue;
    obj.image.lo = std::min(obj.image.lo, r.lo);
    obj.image.hi = std::max(obj.image.hi, r.hi);
    if (ph.p_flags & PF_X) obj.exec.push_back(r);
    if (ph.p_flags & PF_R) obj.readable.push_back(r);
  }
  if (obj.image.lo > obj.image.hi) obj.image = AddressRange{0, 0};

  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr) & ph = info->dlpi_phdr[i];
    uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
    uintptr_t hi = lo + ph.p_memsz;
    if (ph.p_type == PT_NOTE && obj.build_id.empty() && range_inside(obj.readable, lo, hi)) {
      obj.build_id =
          build_id_from_notes(reinterpret_cast<const uint8_t*>(lo), ph.p_memsz, static_cast<size_t>(ph.p_align));
    } else if (ph.p_type == PT_GNU_EH_FRAME && range_inside(obj.readable, lo, hi)) {
      obj.eh_frame_hdr = reinterpret_cast<const uint8_t*>(lo);
      obj.eh_frame_hdr_size = ph.p_memsz;
    }
  }
  out->push_back(std::move(obj));
  return 0;
}

// ---------------------------------------------------------------------------
// Eval-loop ranges from the interpreter's ELF file.

bool is_eval_symbol_name(const char* name, size_t max_len) {
  static const char kName[] = "_PyEval_EvalFrameDefault";
  constexpr size_t kLen = sizeof(kName) - 1;
  size_t len = strnlen(name, max_len);
  if (len == max_len) return false;  // unterminated inside the string table
  if (len < kLen || memcmp(name, kName, kLen) != 0) return false;
  return len == kLen || name[kLen] == '.';
}

// A read-only view of a whole file with checked access to its parts.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
      void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
      if (p != MAP_FAILED) {
        data_ = static_cast<const uint8_t*>(p);
        size_ = static_cast<size_t>(st.st_size);
      }
    }
    close(fd);
  }
  ~MappedFile() {
    if (data_) munmap(const_cast<uint8_t*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // Pointer to [off, off + len) or null when that is not inside the file.
  const uint8_t* at(uint64_t off, uint64_t len) const {
    if (!data_ || off > size_ || len > size_ - off) return nullptr;
    return data_ + off;
  }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Symbols of one symbol table (SHT_SYMTAB or SHT_DYNSYM) named like the eval
// loop, as runtime ranges.
void eval_ranges_from_table(const MappedFile& f, const ElfW(Shdr) * shdrs, size_t shnum, const ElfW(Shdr) & table,
                            uintptr_t bias, std::vector<AddressRange>* out) {
  if (table.sh_entsize != sizeof(ElfW(Sym)) || table.sh_link >= shnum) return;
  const ElfW(Shdr) & strtab = shdrs[table.sh_link];
  if (strtab.sh_type != SHT_STRTAB) return;
  const uint8_t* syms = f.at(table.sh_offset, table.sh_size);
  const uint8_t* strs = f.at(strtab.sh_offset, strtab.sh_size);
  if (!syms || !strs) return;
  size_t count = table.sh_size / sizeof(ElfW(Sym));
  for (size_t i = 0; i < count; ++i) {
    ElfW(Sym) sym;
    memcpy(&sym, syms + i * sizeof(sym), sizeof(sym));
    if (ELF64_ST_TYPE(sym.st_info) != STT_FUNC || sym.st_shndx == SHN_UNDEF) continue;
    if (sym.st_name >= strtab.sh_size || sym.st_size == 0) continue;
    const char* name = reinterpret_cast<const char*>(strs + sym.st_name);
    if (!is_eval_symbol_name(name, strtab.sh_size - sym.st_name)) continue;
    out->push_back(AddressRange{bias + sym.st_value, bias + sym.st_value + sym.st_size});
  }
}

std::vector<AddressRange> eval_ranges_from_file(const std::string& path, uintptr_t bias) {
  std::vector<AddressRange> ranges;
  if (path.empty()) return ranges;
  MappedFile f(path);
  const uint8_t* eh = f.at(0, sizeof(ElfW(Ehdr)));
  if (!eh) return ranges;
  ElfW(Ehdr) ehdr;
  memcpy(&ehdr, eh, sizeof(ehdr));
  if (memcmp(ehdr.e_ident, ELFMAG, SELFMAG) != 0) return ranges;
#if UINTPTR_MAX > 0xffffffffu
  if (ehdr.e_ident[EI_CLASS] != ELFCLASS64) return ranges;
#else
  if (ehdr.e_ident[EI_CLASS] != ELFCLASS32) return ranges;
#endif
  if (ehdr.e_shoff == 0 || ehdr.e_shentsize != sizeof(ElfW(Shdr))) return ranges;
  size_t shnum = ehdr.e_shnum;
  if (shnum == 0) {
    // More than SHN_LORESERVE sections: the real count is in section 0.
    const uint8_t* s0 = f.at(ehdr.e_shoff, sizeof(ElfW(Shdr)));
    if (!s0) return ranges;
    ElfW(Shdr) first;
    memcpy(&first, s0, sizeof(first));
    shnum = static_cast<size_t>(first.sh_size);
  }
  if (shnum == 0 || shnum > (1u << 24)) return ranges;
  const uint8_t* sh = f.at(ehdr.e_shoff, static_cast<uint64_t>(shnum) * sizeof(ElfW(Shdr)));
  if (!sh) return ranges;
  std::vector<ElfW(Shdr)> shdrs(shnum);
  memcpy(shdrs.data(), sh, shnum * sizeof(ElfW(Shdr)));

  // .symtab has the local .cold/.part clones; .dynsym only the exported entry.
  for (uint32_t type : {static_cast<uint32_t>(SHT_SYMTAB), static_cast<uint32_t>(SHT_DYNSYM)}) {
    for (size_t i = 0; i < shnum; ++i) {
      if (shdrs[i].sh_type == type) {
        eval_ranges_from_table(f, shdrs.data(), shnum, shdrs[i], bias, &ranges);
      }
    }
    if (!ranges.empty()) break;
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const AddressRange& a, const AddressRange& b) { return a.lo < b.lo || (a.lo == b.lo && a.hi < b.hi); });
  ranges.erase(std::unique(ranges.begin(), ranges.end(),
                           [](const AddressRange& a, const AddressRange& b) { return a.lo == b.lo && a.hi == b.hi; }),
               ranges.end());
  return ranges;
}

uintptr_t eval_loop_address() { return reinterpret_cast<uintptr_t>(&_PyEval_EvalFrameDefault); }

// When the file cannot be read (deleted, stripped of both tables), the dynamic
// symbol in memory still gives the main body with its size.
std::vector<AddressRange> eval_ranges_from_memory(uintptr_t addr) {
  std::vector<AddressRange> ranges;
  Dl_info info;
  void* extra = nullptr;
  if (dladdr1(reinterpret_cast<void*>(addr), &info, &extra, RTLD_DL_SYMENT) == 0) return ranges;
  const auto* sym = static_cast<const ElfW(Sym)*>(extra);
  if (sym != nullptr && info.dli_saddr != nullptr && sym->st_size > 0) {
    uintptr_t lo = reinterpret_cast<uintptr_t>(info.dli_saddr);
    ranges.push_back(AddressRange{lo, lo + sym->st_size});
  }
  return ranges;
}

}  // namespace

ModuleRegistry& ModuleRegistry::instance() {
  // Leaked on purpose: threads may still unwind while the process exits.
  static ModuleRegistry* registry = new ModuleRegistry();
  return *registry;
}

ModuleRegistry::ModuleRegistry() : slots_(new std::atomic<Module*>[kMaxModules]()) {
  snapshot_.store(new Snapshot(), std::memory_order_release);
  refresh();
}

int32_t ModuleRegistry::lookup(uintptr_t pc) const {
  const Snapshot* snap = snapshot_.load(std::memory_order_acquire);
  const auto& e = snap->entries;
  size_t lo = 0, hi = e.size();
  while (lo < hi) {  // first entry with entry.lo > pc
    size_t mid = (lo + hi) / 2;
    if (e[mid].lo <= pc) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo == 0) return -1;
  const Snapshot::Entry& cand = e[lo - 1];
  return pc < cand.hi ? cand.index : -1;
}

const Module* ModuleRegistry::module(int32_t index) const {
  if (index < 0 || static_cast<size_t>(index) >= size()) return nullptr;
  return slots_[index].load(std::memory_order_acquire);
}

bool ModuleRegistry::is_eval_pc(int32_t module_index, uintptr_t pc) const {
  const Module* m = module(module_index);
  if (!m) return false;
  for (const AddressRange& r : m->eval_ranges) {
    if (pc >= r.lo && pc < r.hi) return true;
  }
  return false;
}

bool ModuleRegistry::refresh() {
  WriterState& ws = writer_state();
  std::lock_guard<std::mutex> lock(ws.mu);

  std::vector<ScannedObject> scanned;
  scanned.reserve(64);
  dl_iterate_phdr(collect_object, &scanned);

  const uintptr_t eval_addr = eval_loop_address();
  auto* snap = new Snapshot();
  size_t count = count_.load(std::memory_order_relaxed);
  for (ScannedObject& obj : scanned) {
    if (obj.exec.empty()) continue;
    std::string path = obj.is_main ? main_program_path() : obj.name;
    auto key = std::make_tuple(path, obj.bias, obj.build_id);
    auto it = ws.known.find(key);
    int32_t index;
    if (it != ws.known.end()) {
      index = it->second;
    } else {
      if (count >= kMaxModules) continue;
      auto* m = new Module();
      m->index = static_cast<int32_t>(count);
      m->path = path;
      m->build_id = obj.build_id;
      m->load_bias = obj.bias;
      m->exec_ranges = obj.exec;
      m->readable_ranges = obj.readable;
      m->image = obj.image;
      m->eh_frame_hdr = obj.eh_frame_hdr;
      m->eh_frame_hdr_size = obj.eh_frame_hdr_size;
      bool has_eval = false;
      for (const AddressRange& r : obj.exec) has_eval |= eval_addr >= r.lo && eval_addr < r.hi;
      if (has_eval) {
        m->eval_ranges = eval_ranges_from_file(path, obj.bias);
        if (m->eval_ranges.empty()) m->eval_ranges = eval_ranges_from_memory(eval_addr);
      }
      index = m->index;
      slots_[count].store(m, std::memory_order_release);
      ++count;
      ws.known.emplace(std::move(key), index);
    }
    snap->live.push_back(index);
    for (const AddressRange& r : obj.exec) snap->entries.push_back(Snapshot::Entry{r.lo, r.hi, index});
  }
  std::sort(snap->entries.begin(), snap->entries.end(),
            [](const Snapshot::Entry& a, const Snapshot::Entry& b) { return a.lo < b.lo; });
  std::sort(snap->live.begin(), snap->live.end());

  // Publish the slots before the count, and both before the snapshot naming them.
  count_.store(count, std::memory_order_release);
  const Snapshot* old = snapshot_.load(std::memory_order_relaxed);
  bool changed = old->live != snap->live || old->entries.size() != snap->entries.size();
  if (!changed) {
    delete snap;  // never published
    return false;
  }
  snapshot_.store(snap, std::memory_order_release);
  ws.retired.push_back(old);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  return true;
}

}  // namespace tbpipe
