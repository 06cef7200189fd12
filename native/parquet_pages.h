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

}  // namespace tbpipe
