// The page headers of a Parquet column chunk, read without decoding its pages
// (pipeline/parquet_pages.py checks each page's CRC-32 with them).
//
// A page header is parquet.thrift's `PageHeader` in the Thrift compact protocol. It lies outside the
// page's checksum, so each header is also checked against what the footer says of its chunk: page
// types and their order, encodings, level encodings, counts of values. Every read stays inside the
// chunk's bytes; damage is reported, never read past.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tbpipe {

struct PageSpanRecord {
  int64_t header = 0;  // where the page header starts
  int64_t body = 0;    // where the page's bytes start (after the header)
  int64_t end = 0;     // where they end
  int64_t crc = -1;    // the CRC-32 the writer stored (unsigned), -1 when it stored none
};

struct ChunkPages {
  std::vector<PageSpanRecord> pages;  // in file order, up to the first damaged one
  int64_t values = 0;                 // values of the data pages (the footer's count, when undamaged)
  std::string problem;                // empty when every header parsed and agreed with the footer
  int64_t problem_at = -1;            // the damaged page's header offset
};

// The pages of the chunk in data[start, end). `has_dictionary`: the footer says a dictionary page
// comes first; `encoding_mask`: bit e set for each encoding e the footer lists for the chunk.
ChunkPages chunk_pages(const uint8_t* data, size_t start, size_t end, bool has_dictionary, uint32_t encoding_mask);

// What checking a chunk's pages against their CRC-32s found, page by page in file order.
enum class ChecksumVerdict : int {
  kMatch = 0,      // every page up to the damaged one (if any) carries a CRC-32, and it matches
  kUnchecked = 1,  // a page carries none (`page_at`): only decoding can check the chunk
  kMismatch = 2,   // a page's bytes do not match the CRC-32 its header gives (`page_at`)
};

struct ChunkChecksums {
  ChecksumVerdict verdict = ChecksumVerdict::kMatch;
  int64_t page_at = -1;  // the header offset of the page the verdict is about
  int64_t values = 0;    // as ChunkPages
  std::string problem;   // as ChunkPages: a damaged header after the pages checked
  int64_t problem_at = -1;
};

// `chunk_pages`, each page's bytes then checked against the CRC-32 in its header, stopping at the
// first page that carries none or does not match.
ChunkChecksums chunk_checksums(const uint8_t* data, size_t start, size_t end, bool has_dictionary,
                               uint32_t encoding_mask);

// The CRC-32 (ISO-HDLC, as zlib and Parquet's page checksums compute it) of size bytes. Computed
// here rather than by zlib: linking zlib would make its headers a build requirement of the
// extension, for twenty lines.
uint32_t crc32(const uint8_t* bytes, size_t size);

}  // namespace tbpipe
