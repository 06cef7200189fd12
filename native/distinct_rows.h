// Distinct fixed-width rows, found by hashing their bytes: what the ingest's layout uses to give each
// distinct frame (a row of several integer columns packed together) one id, exactly (no 64-bit
// fingerprints that could collide) and without sorting.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tbpipe {

// ids[i] = id of row i's value, ids numbered in order of first appearance; returns each id's first
// row. `rows` holds count * width bytes. `exact_pass_only` takes the path that two rows with one
// 64-bit hash send the work through (for the tests: such rows are too rare to make).
std::vector<int64_t> distinct_rows(const uint8_t* rows, size_t count, size_t width, int64_t* ids,
                                   bool exact_pass_only = false);

}  // namespace tbpipe
