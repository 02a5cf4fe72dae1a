// Index builders for the GPT-2 / blended datasets (megatron/data/helpers.py has NumPy twins
// that must return identical arrays; tests/test_data_helpers.py checks that they do).
// Plain pybind11, no torch headers, so it compiles in seconds with g++ alone.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;
using ConstI32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using ConstI64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using ConstF64 = py::array_t<double, py::array::c_style | py::array::forcecast>;

// Runs fn(0..blocks-1), block 0 on the calling thread and the others on their own threads.
template <typename Fn>
static void run_blocks(int64_t blocks, Fn fn) {
  std::vector<std::thread> threads;
  for (int64_t b = 1; b < blocks; ++b) threads.emplace_back(fn, b);
  fn(0);
  for (auto& t : threads) t.join();
}

// Gathers sizes[doc_idx[p]] for p in [begin, end) into g, returning their sum. The loads
// are independent (the sum is not needed to issue them) and prefetched ahead, so they
// overlap instead of waiting on each other: the table is read in random order.
static int64_t gather_sizes(const int32_t* sz, const int64_t* docs, int64_t n_sizes,
                            int64_t begin, int64_t end, int32_t* g, bool* bad_doc) {
  constexpr int64_t kAhead = 32;
  int64_t sum = 0;
  for (int64_t p = begin; p < end; ++p) {
    if (p + kAhead < end) {
      const int64_t ahead = docs[p + kAhead];
      if (ahead >= 0 && ahead < n_sizes) __builtin_prefetch(sz + ahead);
    }
    const int64_t doc = docs[p];
    if (doc < 0 || doc >= n_sizes) {
      *bad_doc = true;
      return sum;
    }
    g[p] = sz[doc];
    sum += g[p];
  }
  return sum;
}

// Writes the samples whose first token falls in documents [begin, end); `start` is the
// global index of document `begin`'s first token.
static void emit_samples(const int32_t* g, int64_t begin, int64_t end, int64_t start,
                         int64_t seq_length, int64_t num_samples, int64_t* o) {
  int64_t i = (start + seq_length - 1) / seq_length;
  int64_t target = i * seq_length;
  for (int64_t pos = begin; pos < end && i <= num_samples; ++pos) {
    const int64_t size = g[pos];
    while (i <= num_samples && target < start + size) {
      o[2 * i] = pos;
      o[2 * i + 1] = target - start;
      ++i;
      target += seq_length;
    }
    start += size;
  }
}

// sample_idx[i] = (position in doc_idx, token offset in that document) of global token
// i * seq_length of the stream made by concatenating the documents in doc_idx order.
// Sample i spans tokens [i * seq_length, (i + 1) * seq_length], i.e. seq_length + 1 tokens:
// consecutive samples share their boundary token (the last input is the next label).
// Two passes over contiguous blocks of doc_idx, each block on its own thread: gather the
// block's sizes (and total), then emit the samples that start in it.
// Returns int64 [num_samples + 1, 2].
py::array_t<int64_t> build_sample_idx(ConstI32 sizes, ConstI64 doc_idx, int64_t seq_length,
                                      int64_t num_samples) {
  if (seq_length <= 0 || num_samples < 0) throw std::invalid_argument("seq_length must be > 0");
  const int32_t* sz = sizes.data();
  const int64_t* docs = doc_idx.data();
  const int64_t n_sizes = sizes.size(), n_docs = doc_idx.size();
  py::array_t<int64_t> out({num_samples + 1, static_cast<int64_t>(2)});
  int64_t* o = out.mutable_data();
  bool bad_doc = false;
  int64_t total = 0;
  {
    py::gil_scoped_release release;
    const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
    const int64_t blocks = n_docs < (1 << 16) ? 1 : std::min<int64_t>(hw, 8);
    std::vector<int32_t> g(n_docs);
    std::vector<int64_t> sums(blocks, 0);
    std::vector<char> bad(blocks, 0);
    auto lo = [&](int64_t b) { return n_docs * b / blocks; };
    run_blocks(blocks, [&](int64_t b) {
      bool flag = false;
      sums[b] = gather_sizes(sz, docs, n_sizes, lo(b), lo(b + 1), g.data(), &flag);
      bad[b] = flag;
    });
    for (int64_t b = 0; b < blocks; ++b) bad_doc = bad_doc || bad[b];
    for (int64_t b = 0; b < blocks; ++b) total += sums[b];
    if (!bad_doc && total > num_samples * seq_length) {
      run_blocks(blocks, [&](int64_t b) {
        int64_t start = 0;
        for (int64_t u = 0; u < b; ++u) start += sums[u];
        emit_samples(g.data(), lo(b), lo(b + 1), start, seq_length, num_samples, o);
      });
    }
  }
  if (bad_doc) throw std::out_of_range("doc_idx entry out of range");
  if (total <= num_samples * seq_length)
    throw std::out_of_range("not enough tokens for num_samples samples");
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
