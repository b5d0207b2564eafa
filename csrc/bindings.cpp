// Every Python binding of zeroshard._C, each a few lines: unpack, call.
// Argument checks live in the functions themselves (checks.h) and raise
// ValueError (std::invalid_argument) naming the offending argument.
#include <torch/extension.h>

#include <map>
#include <optional>

#include "adamw_multi.h"
#include "checks.h"
#include "comm.h"
#include "crc32.h"
#include "quant.h"
#include "io_engine.h"
#include "layout.h"
#include "ops.h"

namespace py = pybind11;
using namespace zeroshard;

#ifndef ZEROSHARD_CUDA_ARCHS
#define ZEROSHARD_CUDA_ARCHS ""
#endif

// Every class is module-local (py::module_local()): two builds of zeroshard can then be
// imported into one process side by side (python -m benchmarks before_after).

static void bind_build_info(py::module_& m) {
  m.def("build_info", [] {
    py::dict d;
#ifdef ZEROSHARD_WITH_CUDA
    d["cuda"] = true;
    d["cuda_archs"] = std::string(ZEROSHARD_CUDA_ARCHS);
    d["cuda_compiler_version"] = std::string(ZEROSHARD_CUDA_VERSION);
#else
    d["cuda"] = false;
    d["cuda_archs"] = std::string();
    d["cuda_compiler_version"] = std::string();
#endif
    d["torch_version"] = std::string(ZEROSHARD_TORCH_VERSION);
    d["cxx_standard"] = static_cast<long>(__cplusplus);
    return d;
  }, "How this extension was built: CUDA or not, CUDA archs, the torch it was built against.");
}

static void bind_layout(py::module_& m) {
  py::class_<Fragment>(m, "Fragment", py::module_local(), "A contiguous piece of one tensor inside one bucket.")
      .def_readonly("tensor", &Fragment::tensor).def_readonly("bucket", &Fragment::bucket)
      .def_readonly("tensor_offset", &Fragment::tensor_offset)
      .def_readonly("bucket_offset", &Fragment::bucket_offset).def_readonly("numel", &Fragment::numel);
  py::class_<Bucket>(m, "Bucket", py::module_local(),
                     "A contiguous range of a buffer reduced/gathered as one collective.")
      .def_readonly("buffer", &Bucket::buffer).def_readonly("offset", &Bucket::offset)
      .def_readonly("numel", &Bucket::numel).def_readonly("shard_numel", &Bucket::shard_numel)
      .def_readonly("data_numel", &Bucket::data_numel).def_readonly("fragments", &Bucket::fragments);
  py::class_<Buffer>(m, "Buffer", py::module_local(), "One flat buffer: the tensors sharing a key, one itemsize.")
      .def_readonly("key", &Buffer::key).def_readonly("itemsize", &Buffer::itemsize)
      .def_readonly("numel", &Buffer::numel).def_readonly("buckets", &Buffer::buckets)
      .def_readonly("tensors", &Buffer::tensors);
  py::class_<TensorPlace>(m, "TensorPlace", py::module_local(), "Where one input tensor lives in its buffer.")
      .def_readonly("buffer", &TensorPlace::buffer).def_readonly("offset", &TensorPlace::offset)
      .def_readonly("numel", &TensorPlace::numel).def_readonly("fragments", &TensorPlace::fragments)
      .def_readonly("owner", &TensorPlace::owner);
  py::class_<ShardPiece>(m, "ShardPiece", py::module_local(), "The part of one tensor one rank owns in one bucket.")
      .def_readonly("tensor", &ShardPiece::tensor).def_readonly("bucket", &ShardPiece::bucket)
      .def_readonly("tensor_offset", &ShardPiece::tensor_offset)
      .def_readonly("shard_offset", &ShardPiece::shard_offset).def_readonly("numel", &ShardPiece::numel);
  py::class_<Layout>(m, "Layout", py::module_local(),
                     "Result of compute_layout; see csrc/layout.h [Note: layout rules].")
      .def_readonly("world_size", &Layout::world_size).def_readonly("align_bytes", &Layout::align_bytes)
      .def_readonly("bucket_cap_bytes", &Layout::bucket_cap_bytes)
      .def_readonly("buffers", &Layout::buffers).def_readonly("buckets", &Layout::buckets)
      .def_readonly("tensors", &Layout::tensors).def_readonly("fragments", &Layout::fragments)
      .def("shard_pieces", &Layout::shard_pieces, py::arg("rank"))
      .def("padding_numel", &Layout::padding_numel, py::arg("buffer"))
      .def("shard_numel", &Layout::shard_numel, py::arg("buffer"));
  m.def("compute_layout", [](const std::vector<int64_t>& numels, const std::vector<int64_t>& itemsizes,
                             const std::vector<int64_t>& keys, int64_t cap, int64_t world, int64_t align,
                             std::vector<int64_t> costs) {
    if (costs.empty()) costs.assign(numels.size(), -1);
    if (itemsizes.size() != numels.size() || keys.size() != numels.size() || costs.size() != numels.size())
      throw std::invalid_argument("numels, itemsizes, keys and costs must have one entry per tensor");
    std::vector<TensorSpec> specs(numels.size());
    for (size_t i = 0; i < numels.size(); ++i) specs[i] = {numels[i], itemsizes[i], keys[i], costs[i]};
    return compute_layout(specs, cap, world, align);
  }, py::arg("numels"), py::arg("itemsizes"), py::arg("keys"), py::arg("bucket_cap_bytes"),
     py::arg("world_size"), py::arg("align_bytes") = 16, py::arg("costs") = std::vector<int64_t>{},
     "Pure layout math (csrc/layout.h).");
}

static void bind_kernels(py::module_& m) {
  py::class_<AdamWOptions>(m, "AdamWOptions", py::module_local(), "One set of AdamW hyperparameters (csrc/ops.h).")
      .def(py::init([](double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
             return AdamWOptions{lr, beta1, beta2, eps, weight_decay, step};
           }), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
           py::arg("step"));
  m.def("fused_adamw_", &fused_adamw_, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("outs"), py::arg("hypers"), py::arg("hyper_of"), py::arg("scale"),
        py::arg("noop"), py::arg("found_inf"), py::call_guard<py::gil_scoped_release>(),
        "Fused AdamW over flat shards, one launch (csrc/ops.h).");
#ifdef ZEROSHARD_WITH_CUDA
  m.def("adamw_cuda_launch", [](std::optional<bool> streaming, std::optional<int32_t> blocks_per_sm) {
          AdamWLaunch l = adamw_cuda_launch();
          if (streaming) l.access = *streaming ? Access::kStreaming : Access::kCached;
          if (blocks_per_sm) {
            if (*blocks_per_sm < 1) throw py::value_error("blocks_per_sm must be at least 1");
            l.blocks_per_sm = *blocks_per_sm;
          }
          set_adamw_cuda_launch(l);
          return py::make_tuple(l.access == Access::kStreaming, l.blocks_per_sm);
        }, py::arg("streaming") = py::none(), py::arg("blocks_per_sm") = py::none(),
        "The CUDA AdamW's (streaming, blocks_per_sm), after setting those given (csrc/adamw_multi.h).");
#endif
  // quantized gathers ([Note: quantized gathers] in quant.h)
  m.def("quantize_blocks_", &quantize_blocks_, py::arg("values"), py::arg("wire"), py::arg("counts"),
        py::arg("block"), py::arg("kind"), py::call_guard<py::gil_scoped_release>(),
        "Block-quantize segments into their wire records, one launch (csrc/ops.h).");
  m.def("dequantize_blocks_", &dequantize_blocks_, py::arg("wire"), py::arg("values"), py::arg("counts"),
        py::arg("block"), py::arg("kind"), py::call_guard<py::gil_scoped_release>(),
        "Decode the wire records of segments, one launch (csrc/ops.h).");
  m.def("quant_wire_bytes", &quant_wire_bytes, py::arg("numel"), py::arg("block"),
        "Bytes of one chunk on the wire (csrc/quant.h).");
  // checkpoint checksums
  m.def("crc32", [](py::buffer data, uint32_t crc) {
          const py::buffer_info b = data.request();
          const py::gil_scoped_release unlocked;
          return crc32(b.ptr, static_cast<size_t>(b.size * b.itemsize), crc);
        }, py::arg("data"), py::arg("crc") = 0, "zlib.crc32, faster where the CPU allows (csrc/crc32.h).");
  m.def("crc32_is_fast", &crc32_is_fast, "Whether crc32 folds with PCLMULQDQ here (csrc/crc32.h).");
}

static void bind_collectives(py::module_& m) {
  py::class_<CommHandle, Handle>(m, "CommHandle", py::module_local(), "Guards the result of one collective.")
      .def("wait", &CommHandle::wait, py::call_guard<py::gil_scoped_release>(),
           "Block (CPU) or order the current stream (CUDA) until the result is ready. Idempotent.")
      .def("wait_for", &CommHandle::wait_for, py::arg("seconds"), py::call_guard<py::gil_scoped_release>(),
           "wait() for at most `seconds`; False (the handle abandoned) when the time ran out.")
      .def_property_readonly("waited", &CommHandle::waited)
      .def("completed", &CommHandle::completed,
           "Whether the collective has finished; never blocks (wait() is still needed).");
  m.def("abandon_unwaited", &abandon_unwaited,
        "Handles dropped without wait() park their collectives from now on (csrc/comm.h).");
  m.def("reduce_scatter", &reduce_scatter, py::arg("group_name"), py::arg("input"), py::arg("output"),
        py::arg("average"), py::arg("input_is_scratch") = false, py::call_guard<py::gil_scoped_release>(),
        "Flat reduce-scatter (csrc/comm.h).");
  m.def("reduce_scatter_scratch_bytes", &reduce_scatter_scratch_bytes, py::arg("chunk_numel"),
        py::arg("element_size"), py::arg("world"), py::arg("in_place"), py::arg("input_is_scratch") = false,
        "Scratch bytes of a reduce-scatter on gloo (csrc/gloo_p2p.h).");
  m.def("set_reduce_scatter_piece_bytes", &set_reduce_scatter_piece_bytes, py::arg("bytes"),
        "The smallest piece of a reduce-scatter in pieces; returns the previous (csrc/gloo_p2p.h).");
  m.def("all_gather", &all_gather, py::arg("group_name"), py::arg("input"), py::arg("output"),
        py::call_guard<py::gil_scoped_release>(), "Flat all-gather (csrc/comm.h).");
  m.def("reduce_scatter_v", &reduce_scatter_v, py::arg("group_name"), py::arg("input"), py::arg("output"),
        py::arg("bounds"), py::arg("average"), py::call_guard<py::gil_scoped_release>(),
        "Reduce-scatter over uneven chunks (csrc/comm.h, [Note: uneven collectives]).");
  m.def("all_gather_v", &all_gather_v, py::arg("group_name"), py::arg("input"), py::arg("output"),
        py::arg("bounds"), py::call_guard<py::gil_scoped_release>(),
        "All-gather over uneven chunks (csrc/comm.h, [Note: uneven collectives]).");
  m.def("all_reduce", &all_reduce, py::arg("group_name"), py::arg("tensor"), py::arg("average"),
        py::call_guard<py::gil_scoped_release>(), "All-reduce (csrc/comm.h).");
}

static void bind_io_engine(py::module_& m) {
  py::register_local_exception<IoError>(m, "IoError", PyExc_OSError);
  py::class_<IoEngine>(m, "IoEngine", py::module_local(), "Direct reads and writes of one file (csrc/io_engine.h).")
      .def(py::init([](const std::string& path, const std::string& backend, int depth, int64_t piece_bytes) {
             const std::map<std::string, IoBackend> kinds{
                 {"auto", IoBackend::kAuto}, {"io_uring", IoBackend::kUring}, {"aio", IoBackend::kAio}};
             if (!kinds.count(backend)) throw py::value_error("backend must be 'auto', 'io_uring' or 'aio', got '" + backend + "'");
             return std::make_unique<IoEngine>(path, kinds.at(backend), depth, piece_bytes);
           }), py::arg("path"), py::arg("backend") = "auto", py::arg("depth") = 8, py::arg("piece_bytes") = 1 << 20,
           py::call_guard<py::gil_scoped_release>())
      .def("submit", [](IoEngine& e, bool write, const at::Tensor& t, int64_t offset) {
             if (!t.device().is_cpu()) value_error("the tensor is on ", t.device(), "; the engine moves host memory");
             check_contiguous(t, "the tensor");
             void* data = t.data_ptr();
             const py::gil_scoped_release unlocked;
             return e.submit(write, offset, static_cast<int64_t>(t.nbytes()), data);
           }, py::arg("write"), py::arg("tensor"), py::arg("offset"),
           "Starts moving the tensor's bytes from (read) or to (write) the file at `offset`; returns a ticket.")
      .def("wait", &IoEngine::wait, py::arg("ticket"), py::call_guard<py::gil_scoped_release>(),
           "Blocks until the ticket's bytes have moved; raises IoError (an OSError) naming file, offset, errno.")
      .def("check", &IoEngine::check, py::arg("nbytes"), py::call_guard<py::gil_scoped_release>(),
           "Raises IoError if the file was deleted or is shorter than `nbytes`.")
      .def_property_readonly("path", &IoEngine::path).def_property_readonly("backend", &IoEngine::backend)
      .def_property_readonly("fallback", &IoEngine::fallback).def_property_readonly("depth", &IoEngine::depth)
      .def_property_readonly("size", &IoEngine::size);
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "zeroshard C++/CUDA core: layout math, fused AdamW, collectives, the I/O engine";
  bind_build_info(m);
  bind_layout(m);
  bind_kernels(m);
  bind_collectives(m);
  bind_io_engine(m);
}
