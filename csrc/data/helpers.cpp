// Index builders for the GPT-2 / blended datasets (megatron/data/helpers.py has NumPy twins
// that must return identical arrays; tests/test_data_helpers.py checks that they do).
// Plain pybind11, no torch headers, so it compiles in seconds with g++ alone.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;
using ConstI32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using ConstI64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using ConstF64 = py::array_t<double, py::array::c_style | py::array::forcecast>;

// sample_idx[i] = (position in doc_idx, token offset in that document) of global token
// i * seq_length of the stream made by concatenating the documents in doc_idx order.
// Sample i spans tokens [i * seq_length, (i + 1) * seq_length], i.e. seq_length + 1 tokens:
// consecutive samples share their boundary token (the last input is the next label).
// One pass over doc_idx. The walk is bound by random reads of the size table (doc_idx is
// shuffled), so the size kAhead documents ahead is prefetched: the loads overlap instead of
// waiting on each other. Returns int64 [num_samples + 1, 2].
py::array_t<int64_t> build_sample_idx(ConstI32 sizes, ConstI64 doc_idx, int64_t seq_length,
                                      int64_t num_samples) {
  constexpr int64_t kAhead = 32;
  if (seq_length <= 0 || num_samples < 0) throw std::invalid_argument("seq_length must be > 0");
  const int32_t* sz = sizes.data();
  const int64_t* docs = doc_idx.data();
  const int64_t n_sizes = sizes.size(), n_docs = doc_idx.size();
  py::array_t<int64_t> out({num_samples + 1, static_cast<int64_t>(2)});
  int64_t* o = out.mutable_data();
  bool bad_doc = false;
  int64_t i = 0;  // next sample to place
  {
    py::gil_scoped_release release;
    int64_t target = 0, doc_start = 0;  // first token of sample i; of the current document
    for (int64_t pos = 0; pos < n_docs && i <= num_samples; ++pos) {
      if (pos + kAhead < n_docs) {
        const int64_t ahead = docs[pos + kAhead];
        if (ahead >= 0 && ahead < n_sizes) __builtin_prefetch(sz + ahead);
      }
      const int64_t doc = docs[pos];
      if (doc < 0 || doc >= n_sizes) {  // checked on the fly: one pass over doc_idx
        bad_doc = true;
        break;
      }
      const int64_t doc_end = doc_start + sz[doc];
      for (; i <= num_samples && target < doc_end; ++i, target += seq_length) {
        o[2 * i] = pos;
        o[2 * i + 1] = target - doc_start;
      }
      doc_start = doc_end;
    }
  }
  if (bad_doc) throw std::out_of_range("doc_idx entry out of range");
  if (i <= num_samples) throw std::out_of_range("not enough tokens for num_samples samples");
  return out;
}

// Stride scheduling: dataset d's k-th sample is due at time (k + 0.5) / weights[d]; samples
// are taken in order of due time (ties: lower dataset first), so after n samples each dataset
// has had within one sample of n * weights[d]. Returns (dataset_index int32 [size],
// dataset_sample_index int64 [size]).
py::tuple build_blending_indices(ConstF64 weights, int64_t size) {
  const int64_t k = weights.size();
  if (k == 0) throw std::invalid_argument("no datasets to blend");
  const double* w = weights.data();
  for (int64_t d = 0; d < k; ++d)
    if (!(w[d] > 0.0)) throw std::invalid_argument("blending weights must be > 0");
  py::array_t<int32_t> dataset_index(size);
  py::array_t<int64_t> sample_index(size);
  int32_t* di = dataset_index.mutable_data();
  int64_t* si = sample_index.mutable_data();
  {
    py::gil_scoped_release release;
    std::vector<int64_t> taken(k, 0);
    std::vector<double> due(k);
    for (int64_t d = 0; d < k; ++d) due[d] = 0.5 / w[d];
    for (int64_t i = 0; i < size; ++i) {
      int64_t best = 0;
      for (int64_t d = 1; d < k; ++d)
        if (due[d] < due[best]) best = d;
      di[i] = static_cast<int32_t>(best);
      si[i] = taken[best]++;
      due[best] = (static_cast<double>(taken[best]) + 0.5) / w[best];
    }
  }
  return py::make_tuple(dataset_index, sample_index);
}

PYBIND11_MODULE(megatron_data_helpers, m) {
  m.doc() = "megatron-tds data index builders";
  m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_samples"));
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"));
}
