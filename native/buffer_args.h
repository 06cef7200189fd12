// Column arguments of the bindings: contiguous 1-d buffers of fixed-size integers (array.array,
// bytes, numpy arrays, views of Arrow buffers), checked before the native code reads them.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

namespace tbpipe {

// A contiguous buffer of `itemsize`-byte integers; a ValueError naming `what` otherwise.
inline pybind11::buffer_info integer_buffer(const pybind11::buffer& buffer, ssize_t itemsize, const char* what,
                                            bool writable) {
  pybind11::buffer_info info = buffer.request(writable);
  if (info.ndim != 1 || info.itemsize != itemsize || (info.strides.size() == 1 && info.strides[0] != itemsize)) {
    throw pybind11::value_error(std::string(what) + ": expected a contiguous 1-d buffer of " +
                                std::to_string(itemsize) + "-byte integers");
  }
  return info;
}

}  // namespace tbpipe
