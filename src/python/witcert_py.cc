// The Python module `witcert._witcert` over the C API (include/witcert/witcert.h), so that Python,
// C and the CLI compute the same numbers. Arrays are read in place when they are C-contiguous and
// of the documented dtype; anything else is a TypeError naming the argument, never a silent copy.
// A failed C call raises the exception its status maps to, with the library's message.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "python/stored_kv.h"
#include "witcert/witcert.h"

namespace py = pybind11;

namespace {

// Raises the exception `s` maps to with `msg` (a message taken on another thread).
void check(witcert_status s, const std::string& msg) {
  if (s == WITCERT_OK) return;
  switch (s) {
    case WITCERT_ERROR_INVALID_ARGUMENT: throw py::value_error(msg);
    case WITCERT_ERROR_OUT_OF_RANGE: throw py::index_error(msg);
    case WITCERT_ERROR_IO: {
      PyErr_SetString(PyExc_OSError, msg.c_str());
      throw py::error_already_set();
    }
    case WITCERT_ERROR_NON_FINITE: {
      PyErr_SetString(PyExc_FloatingPointError, msg.c_str());
      throw py::error_already_set();
    }
    default: throw std::runtime_error(msg);
  }
}

void check(witcert_status s) {
  if (s != WITCERT_OK) check(s, witcert_last_error());
}

// Runs the C call f() without the GIL (the arrays it reads stay referenced by the caller), then
// raises what its status maps to.
template <class F>
void check_nogil(F&& f) {
  witcert_status s;
  {
    py::gil_scoped_release nogil;
    s = f();
  }
  check(s);
}

// A C-contiguous array of T with `ndim` dimensions (any when ndim < 0), read in place.
template <class T>
py::array_t<T> take(const py::handle& obj, const char* name, int ndim = 1) {
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(std::string(name) + " must be a numpy array of " + py::str(py::dtype::of<T>()).cast<std::string>());
  const py::array a = py::reinterpret_borrow<py::array>(obj);
  if (!a.dtype().is(py::dtype::of<T>()))
    throw py::type_error(std::string(name) + " must have dtype " + py::str(py::dtype::of<T>()).cast<std::string>() +
                         ", got " + py::str(a.dtype()).cast<std::string>());
  if (!(a.flags() & py::array::c_style))
    throw py::type_error(std::string(name) + " must be C-contiguous (np.ascontiguousarray)");
  if (ndim >= 0 && a.ndim() != ndim)
    throw py::value_error(std::string(name) + " must have " + std::to_string(ndim) + " dimension(s), got " +
                          std::to_string(a.ndim()));
  return py::reinterpret_borrow<py::array_t<T>>(a);
}

// The text a C call writes into a caller's buffer: asked for its size first, then written.
template <class Call>
std::string text_of(Call&& call) {
  size_t needed = 0;
  const witcert_status s = call(nullptr, 0, &needed);
  if (s != WITCERT_ERROR_BUFFER_TOO_SMALL) check(s);
  std::string text(needed, '\0');
  check(call(text.data(), text.size(), &needed));
  text.resize(needed - 1);
  return text;
}

// An external side's reconstructions (None: none given), with k's shape, into `out`: its data.
const float* reconstruction(const py::object& obj, const char* name, const py::array_t<float>& k,
                            py::array_t<float>& out) {
  if (obj.is_none()) return nullptr;
  out = take<float>(obj, name, static_cast<int>(k.ndim()));
  if (!std::equal(out.shape(), out.shape() + k.ndim(), k.shape()))
    throw py::value_error(std::string(name) + " must have k's shape");
  return out.data();
}

// fp16 travels as numpy float16, whose storage is the IEEE binary16 bits the C API takes.
py::array_t<std::uint16_t> take_f16(const py::handle& obj, const char* name, int ndim) {
  if (!py::isinstance<py::array>(obj)) throw py::type_error(std::string(name) + " must be a numpy array of float16");
  const py::array a = py::reinterpret_borrow<py::array>(obj);
  if (a.dtype().kind() != 'f' || a.dtype().itemsize() != 2)
    throw py::type_error(std::string(name) + " must have dtype float16, got " + py::str(a.dtype()).cast<std::string>());
  if (!(a.flags() & py::array::c_style)) throw py::type_error(std::string(name) + " must be C-contiguous");
  if (a.ndim() != ndim)
    throw py::value_error(std::string(name) + " must have " + std::to_string(ndim) + " dimension(s), got " +
                          std::to_string(a.ndim()));
  return py::array_t<std::uint16_t>(a.request().shape, a.request().strides, static_cast<const std::uint16_t*>(a.data()), a);
}

py::array as_f16(py::array_t<std::uint16_t> bits) { return bits.attr("view")("float16"); }

py::dict bounds_dict(const witcert_bounds& b) {
  py::dict d;
  d["eform"] = b.eform;
  d["two_sided"] = b.two_sided;
  d["retention"] = b.retention;
  d["tanh"] = b.tanh;
  d["tanh_half"] = b.tanh_half;
  d["raw"] = b.raw;
  d["meter"] = b.meter;
  return d;
}

witcert_rope_layout layout_of(const std::string& s) {
  if (s == "interleaved") return WITCERT_ROPE_INTERLEAVED;
  if (s == "neox") return WITCERT_ROPE_NEOX;
  throw py::value_error("layout must be 'interleaved' or 'neox', got '" + s + "'");
}

py::dict meter_logits(const py::object& z_obj, const py::object& c_obj) {
  const auto z = take<double>(z_obj, "z"), c = take<double>(c_obj, "c");
  if (z.size() != c.size())
    throw py::value_error("z has " + std::to_string(z.size()) + " entries, c has " + std::to_string(c.size()));
  witcert_bounds b{};
  check(witcert_meter_logits(z.data(), c.data(), static_cast<size_t>(z.size()), &b));
  return bounds_dict(b);
}

py::dict meter_probs(const py::object& p_obj, const py::object& c_obj) {
  const auto p = take<double>(p_obj, "p_tilde"), c = take<double>(c_obj, "c");
  if (p.size() != c.size())
    throw py::value_error("p_tilde has " + std::to_string(p.size()) + " entries, c has " + std::to_string(c.size()));
  witcert_bounds b{};
  check(witcert_meter_probs(p.data(), c.data(), static_cast<size_t>(p.size()), &b));
  return bounds_dict(b);
}

// ---- The tensor API: whole batches, any float dtype, without the GIL -------------------------

// An array of any float dtype read in place: `code` is the witcert_dtype the Python layer
// determined (bfloat16 arrives as its 16-bit storage). Its item size must match the code.
struct AnyArray {
  py::array a;
  witcert_dtype type;
  const void* data() const { return a.data(); }
};

AnyArray take_any(const py::handle& obj, int code, const char* name) {
  if (!py::isinstance<py::array>(obj)) throw py::type_error(std::string(name) + " must be an array");
  const py::array a = py::reinterpret_borrow<py::array>(obj);
  static const int kItem[] = {8, 4, 2, 2};
  if (code < 0 || code > 3 || a.itemsize() != kItem[code])
    throw py::type_error(std::string(name) + ": dtype code " + std::to_string(code) + " does not match an item of " +
                         std::to_string(a.itemsize()) + " bytes");
  if (!(a.flags() & py::array::c_style))
    throw py::type_error(std::string(name) + " must be C-contiguous (np.ascontiguousarray, tensor.contiguous())");
  return {a, static_cast<witcert_dtype>(code)};
}

// Every bound of every row: a float64 array (rows, 7) in the order of witcert_bounds's fields.
py::array_t<double> meter_batch(const py::object& x_obj, int x_code, const py::object& c_obj, int c_code, bool logits,
                                int threads) {
  const char* x_name = logits ? "z" : "p_tilde";
  const AnyArray x = take_any(x_obj, x_code, x_name), c = take_any(c_obj, c_code, "c");
  if (x.a.ndim() < 1 || x.a.ndim() != c.a.ndim() || !std::equal(x.a.shape(), x.a.shape() + x.a.ndim(), c.a.shape()))
    throw py::value_error(std::string(x_name) + " and c must have the same shape (..., tokens)");
  const size_t n = static_cast<size_t>(x.a.shape(x.a.ndim() - 1));
  const size_t rows = n == 0 ? 0 : static_cast<size_t>(x.a.size()) / n;
  if (n == 0) throw py::value_error(std::string(x_name) + " has no tokens (its last dimension is 0)");
  static_assert(sizeof(witcert_bounds) == 7 * sizeof(double));
  py::array_t<double> out({static_cast<py::ssize_t>(rows), py::ssize_t{7}});
  auto* b = reinterpret_cast<witcert_bounds*>(out.mutable_data());
  check_nogil([&] {
    return logits ? witcert_meter_logits_batch(x.data(), x.type, c.data(), c.type, rows, n, threads, b)
                  : witcert_meter_probs_batch(x.data(), x.type, c.data(), c.type, rows, n, threads, b);
  });
  return out;
}

// Witnesses (n, bands) of n keys (n, d) in any dtype.
py::array witness_batch(const py::object& kh_obj, int kh_code, const py::object& k_obj, int k_code, int bands,
                        const std::string& layout) {
  const AnyArray kh = take_any(kh_obj, kh_code, "k_hat"), k = take_any(k_obj, k_code, "k");
  if (kh.a.ndim() != 2 || k.a.ndim() != 2 || kh.a.shape(0) != k.a.shape(0) || kh.a.shape(1) != k.a.shape(1))
    throw py::value_error("k_hat and k must have the same shape (n, d)");
  if (bands < 1) throw py::value_error("bands must be at least 1");
  const py::ssize_t n = kh.a.shape(0);
  const int d = static_cast<int>(kh.a.shape(1));
  const witcert_rope_layout rl = layout_of(layout);
  py::array_t<std::uint16_t> w({n, static_cast<py::ssize_t>(bands)});
  std::uint16_t* wp = w.mutable_data();
  check_nogil([&] {
    return witcert_witness_batch(d, bands, rl, kh.data(), kh.type, k.data(), k.type, static_cast<size_t>(n), wp);
  });
  return as_f16(w);
}

// c (batch, q_heads, n) from queries (batch, q_heads, d) and witnesses (batch, kv_heads, n, bands).
py::array_t<double> tier_a_batch(const py::object& q_obj, int q_code, const py::object& w_obj, double sm,
                                 const std::string& layout, int threads) {
  const AnyArray q = take_any(q_obj, q_code, "q");
  const auto w = take_f16(w_obj, "witnesses", 4);
  if (q.a.ndim() != 3) throw py::value_error("q must be (batch, q_heads, head_dim)");
  const py::ssize_t batch = q.a.shape(0), hq = q.a.shape(1), d = q.a.shape(2);
  const py::ssize_t hk = w.shape(1), n = w.shape(2), bands = w.shape(3);
  if (w.shape(0) != batch) throw py::value_error("q and witnesses must have the same batch size");
  if (hk < 1 || hq % hk != 0)
    throw py::value_error("q's heads (" + std::to_string(hq) + ") must be a multiple of the witnesses' kv_heads (" +
                          std::to_string(hk) + ")");
  const witcert_rope_layout rl = layout_of(layout);
  py::array_t<double> c({batch, hq, n});
  double* cp = c.mutable_data();
  check_nogil([&] {
    return witcert_tier_a_bounds_batch(static_cast<int>(d), static_cast<int>(bands), rl, q.data(), q.type, w.data(),
                                       static_cast<size_t>(batch), static_cast<int>(hq), static_cast<int>(hk),
                                       static_cast<size_t>(n), sm, threads, cp);
  });
  return c;
}

// Tier B for one head dimension, group and outlier mask.
class DitherInt8 {
 public:
  DitherInt8(int d, int group, std::uint64_t seed, const py::object& outliers) : d_(d), group_(group), seed_(seed) {
    if (d < 1) throw py::value_error("d must be at least 1");
    mask_.assign(static_cast<std::size_t>(d), 0);
    if (!outliers.is_none())
      for (const py::handle& h : outliers) {
        const long c = h.cast<long>();
        if (c < 0 || c >= d) throw py::value_error("outlier channel " + std::to_string(c) + " is outside [0, d)");
        mask_[static_cast<std::size_t>(c)] = 1;
      }
    for (std::uint8_t m : mask_) n_outliers_ += m;
    if (group < 1 || d % group != 0) throw py::value_error("group must divide d");
  }
  py::array_t<float> dither(std::uint32_t layer, std::uint32_t kv_head, std::uint32_t slot) const {
    py::array_t<float> xi(d_);
    check(witcert_dither_values(seed_, layer, kv_head, slot, xi.mutable_data(), static_cast<size_t>(d_)));
    return xi;
  }
  py::tuple encode(const py::object& x_obj, const py::object& xi_obj) const {
    const auto x = take<float>(x_obj, "x"), xi = take<float>(xi_obj, "xi");
    size_check(x.size(), "x");
    size_check(xi.size(), "xi");
    py::array_t<std::int8_t> codes(d_);
    py::array_t<std::uint16_t> scales(d_ / group_), ov(static_cast<py::ssize_t>(n_outliers_));
    check(witcert_dither_encode(x.data(), xi.data(), mask_.data(), static_cast<size_t>(d_), group_, codes.mutable_data(),
                                scales.mutable_data(), ov.mutable_data(), n_outliers_));
    return py::make_tuple(codes, as_f16(scales), as_f16(ov));
  }
  py::array_t<float> decode(const py::object& codes_obj, const py::object& scales_obj, const py::object& xi_obj,
                            const py::object& ov_obj) const {
    const auto codes = take<std::int8_t>(codes_obj, "codes");
    const auto scales = take_f16(scales_obj, "scales", 1);
    const auto xi = take<float>(xi_obj, "xi");
    const auto ov = take_f16(ov_obj, "outlier_values", 1);
    size_check(codes.size(), "codes");
    size_check(xi.size(), "xi");
    if (scales.size() != d_ / group_) throw py::value_error("scales must hold d / group values");
    if (static_cast<size_t>(ov.size()) != n_outliers_) throw py::value_error("outlier_values must hold one value per outlier");
    py::array_t<float> out(d_);
    check(witcert_dither_decode(codes.data(), scales.data(), xi.data(), mask_.data(), ov.data(), n_outliers_,
                                static_cast<size_t>(d_), group_, out.mutable_data()));
    return out;
  }
  double radius(const py::object& q_obj, const py::object& scales_obj, long n_tokens, double delta_loc, double sm) const {
    const auto q = take<float>(q_obj, "q");
    const auto scales = take_f16(scales_obj, "scales", 1);
    size_check(q.size(), "q");
    if (scales.size() != d_ / group_) throw py::value_error("scales must hold d / group values");
    double u = 0;
    check(witcert_dither_radius(q.data(), scales.data(), mask_.data(), static_cast<size_t>(d_), group_, sm, n_tokens,
                                delta_loc, &u));
    return u;
  }
  int d() const { return d_; }
  int group() const { return group_; }

 private:
  void size_check(py::ssize_t n, const char* name) const {
    if (n != d_) throw py::value_error(std::string(name) + " must hold d = " + std::to_string(d_) + " values, got " + std::to_string(n));
  }
  int d_, group_;
  std::uint64_t seed_;
  std::vector<std::uint8_t> mask_;
  size_t n_outliers_ = 0;
};

// One sequence over its own pool.
class Cache {
 public:
  Cache(int layers, int q_heads, int kv_heads, int head_dim, long capacity, const std::string& options_json,
        long pool_bytes, long decode_budget, const std::string& layout) {
    g_ = {layers, q_heads, kv_heads, head_dim, capacity, layout_of(layout)};
    check(witcert_pool_create(&g_, options_json.c_str(), pool_bytes, &pool_));
    const witcert_status s = witcert_cache_create(pool_, nullptr, decode_budget, &cache_);
    if (s != WITCERT_OK) {
      const std::string msg = witcert_last_error();
      witcert_pool_free(pool_);
      throw py::value_error(msg);
    }
  }
  ~Cache() {
    witcert_cache_free(cache_);
    witcert_pool_free(pool_);
  }
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;

  void write(int layer, int kv_head, long pos, const py::object& k_obj, const py::object& v_obj) {
    const auto k = take<float>(k_obj, "k"), v = take<float>(v_obj, "v");
    if (k.size() != g_.head_dim || v.size() != g_.head_dim) throw py::value_error("k and v must hold head_dim values");
    check(witcert_cache_write(cache_, layer, kv_head, pos, k.data(), v.data()));
  }
  py::tuple attend(int layer, int kv_head, const py::object& q_obj, long n_ctx) {
    const auto q = take<float>(q_obj, "q", 2);
    const int group = g_.q_heads / g_.kv_heads;
    if (q.shape(0) != group || q.shape(1) != g_.head_dim)
      throw py::value_error("q must be (q_heads / kv_heads, head_dim) = (" + std::to_string(group) + ", " +
                            std::to_string(g_.head_dim) + ")");
    py::array_t<float> out({static_cast<py::ssize_t>(group), static_cast<py::ssize_t>(g_.head_dim)});
    std::vector<witcert_cell> cells(static_cast<std::size_t>(group));
    check(witcert_cache_attend(cache_, layer, kv_head, q.data(), group, n_ctx, out.mutable_data(), cells.data()));
    py::list cl;
    for (const witcert_cell& c : cells) {
      py::dict d;
      d["layer"] = c.layer;
      d["q_head"] = c.q_head;
      d["pos"] = c.pos;
      d["raw"] = c.raw;
      d["meter"] = c.meter;
      d["v_meter"] = c.v_meter;
      d["output_bound"] = c.output_bound;
      d["repaired"] = c.repaired != 0;
      cl.append(d);
    }
    return py::make_tuple(out, cl);
  }
  // Positions [pos0, pos0 + T) of every KV head of a layer: k and v are (kv_heads, T, head_dim), and
  // k_hat, v_hat (None unless that side's format is external) the caller's reconstructions.
  void write_rows(int layer, long pos0, const py::object& k_obj, const py::object& v_obj, const py::object& kh_obj,
                  const py::object& vh_obj) {
    const auto k = take<float>(k_obj, "k", 3), v = take<float>(v_obj, "v", 3);
    if (k.shape(0) != g_.kv_heads || k.shape(2) != g_.head_dim || !std::equal(k.shape(), k.shape() + 3, v.shape()))
      throw py::value_error("k and v must both be (kv_heads, tokens, head_dim) = (" + std::to_string(g_.kv_heads) +
                            ", T, " + std::to_string(g_.head_dim) + ")");
    py::array_t<float> kh, vh;
    const float* khp = reconstruction(kh_obj, "k_hat", k, kh);
    const float* vhp = reconstruction(vh_obj, "v_hat", k, vh);
    check_nogil(
        [&] { return witcert_cache_write_rows(cache_, layer, pos0, k.shape(1), k.data(), v.data(), khp, vhp); });
  }

  // The fields of the cells of one attend_rows call, each (q_heads, T) at the given pointers.
  struct CellFields {
    double *raw, *meter, *v_meter, *output_bound;
    bool* repaired;
  };

  // attend_rows into caller-owned memory, without the GIL: q is (q_heads, T, head_dim); the output of
  // (head h, step t) goes to out + (h·T + t)·d, or out + (t·q_heads + h)·d when token_major (the
  // layout transformers' attention returns). Returns the status of the first failing call.
  witcert_status attend_into(int layer, const float* q, long T, long pos0, long begin, long window, float* out,
                             bool token_major, const CellFields& f) const {
    const long d = g_.head_dim, hq = g_.q_heads;
    const int group = g_.q_heads / g_.kv_heads;
    // Without padding, runs of up to kRun positions go through the cache's causal path, which reads
    // the positions a run shares once (a prefill); with padding, one position at a time.
    constexpr long kRun = 64;
    const long run = begin == 0 ? std::min(T, kRun) : 1;
    std::vector<float> qg(static_cast<std::size_t>(run * group * d)), og(qg.size());
    std::vector<witcert_cell> cells(static_cast<std::size_t>(run * group));
    for (int kv = 0; kv < g_.kv_heads; ++kv)
      for (long t0 = 0; t0 < T; t0 += run) {
        const long n = std::min(run, T - t0);
        for (long t = 0; t < n; ++t)
          for (int j = 0; j < group; ++j)
            std::memcpy(qg.data() + (t * group + j) * d, q + ((kv * group + j) * T + t0 + t) * d, sizeof(float) * d);
        witcert_status s;
        if (run > 1) {
          s = witcert_cache_attend_causal(cache_, layer, kv, qg.data(), group, pos0 + t0, n, window, og.data(),
                                          cells.data());
        } else {
          // A sliding window of `window` positions starts at pos − window + 1 (key t seen while
          // pos − t < window); a query inside the padding (before `begin`) attends to itself only,
          // its output unused.
          const long pos = pos0 + t0;
          const long first = window > 0 ? std::max(begin, pos - window + 1) : begin;
          s = witcert_cache_attend_range(cache_, layer, kv, qg.data(), group, std::min(first, pos), pos + 1,
                                         og.data(), cells.data());
        }
        if (s != WITCERT_OK) return s;
        for (long t = 0; t < n; ++t)
          for (int j = 0; j < group; ++j) {
            const long h = kv * group + j, i = h * T + t0 + t;
            const witcert_cell& c = cells[t * group + j];
            std::memcpy(out + (token_major ? (t0 + t) * hq + h : i) * d, og.data() + (t * group + j) * d,
                        sizeof(float) * d);
            f.raw[i] = c.raw;
            f.meter[i] = c.meter;
            f.v_meter[i] = c.v_meter;
            f.output_bound[i] = c.output_bound;
            f.repaired[i] = c.repaired != 0;
          }
      }
    return WITCERT_OK;
  }

  // Causal attention of the queries q (q_heads, T, head_dim) at positions [pos0, pos0 + T), each over
  // [begin, its position] (a left-padded row's padding: before begin), within `window` positions
  // of it when window > 0: the outputs (q_heads, T, head_dim) and the cells' fields as arrays
  // (q_heads, T): raw, meter, v_meter, output_bound, repaired.
  py::tuple attend_rows(int layer, const py::object& q_obj, long pos0, long begin, long window) {
    const auto q = take<float>(q_obj, "q", 3);
    check_queries(q, "q");
    const py::ssize_t T = q.shape(1);
    py::array_t<float> out({static_cast<py::ssize_t>(g_.q_heads), T, static_cast<py::ssize_t>(g_.head_dim)});
    py::dict cells = cell_arrays({static_cast<py::ssize_t>(g_.q_heads), T});
    const CellFields f = fields_of(cells, 0, 0);
    check_nogil([&] { return attend_into(layer, q.data(), T, pos0, begin, window, out.mutable_data(), false, f); });
    return py::make_tuple(out, cells);
  }

  void check_queries(const py::array_t<float>& q, const char* name) const {
    if (q.shape(q.ndim() - 3) != g_.q_heads || q.shape(q.ndim() - 1) != g_.head_dim)
      throw py::value_error(std::string(name) + " must be (q_heads, tokens, head_dim) = (" +
                            std::to_string(g_.q_heads) + ", T, " + std::to_string(g_.head_dim) + ") per row");
  }

  // Arrays of `shape` for every cell field, in a dict by name.
  static py::dict cell_arrays(const std::vector<py::ssize_t>& shape) {
    py::dict cells;
    for (const char* name : {"raw", "meter", "v_meter", "output_bound"}) cells[name] = py::array_t<double>(shape);
    cells["repaired"] = py::array_t<bool>(shape);
    return cells;
  }

  // The fields of row `row` (each row `per_row` cells) of arrays made by cell_arrays.
  static CellFields fields_of(const py::dict& cells, std::size_t row, std::size_t per_row) {
    const auto at = [&](const char* name) {
      return cells[name].cast<py::array_t<double>>().mutable_data() + row * per_row;
    };
    return {at("raw"), at("meter"), at("v_meter"), at("output_bound"),
            cells["repaired"].cast<py::array_t<bool>>().mutable_data() + row * per_row};
  }

  // write_rows without the GIL, for the batch calls (k_hat and v_hat: null unless a side is external).
  witcert_status write_into(int layer, long pos0, long T, const float* k, const float* v, const float* k_hat,
                            const float* v_hat) const {
    return witcert_cache_write_rows(cache_, layer, pos0, T, k, v, k_hat, v_hat);
  }

  const witcert_geometry& geometry() const { return g_; }

  void report_start(long first_pos) { check(witcert_cache_report_start(cache_, first_pos)); }
  // The report as JSON text (the package parses it).
  std::string report() const {
    return text_of([&](char* json, size_t cap, size_t* n) { return witcert_cache_report(cache_, json, cap, n); });
  }

  // A request-level repair decided by another tensor-parallel rank: the pages promoted.
  long promote_all(long at) {
    std::int64_t pages = 0;
    check(witcert_cache_promote_all(cache_, at, &pages));
    return static_cast<long>(pages);
  }

  // From now on (keep) the report's cells are also kept, for drain_cells to hand to a Report.
  void keep_cells(bool keep) { check(witcert_cache_keep_cells(cache_, keep ? 1 : 0)); }
  py::array_t<witcert_report_cell> drain_cells() {
    size_t n = 0;
    const witcert_status s = witcert_cache_drain_cells(cache_, nullptr, 0, &n);
    if (s != WITCERT_ERROR_BUFFER_TOO_SMALL) check(s);
    py::array_t<witcert_report_cell> cells(static_cast<py::ssize_t>(n));
    check(witcert_cache_drain_cells(cache_, cells.mutable_data(), n, &n));
    return cells;
  }

  py::dict stats() const {
    witcert_cache_stats s{};
    witcert_pool_stats p{};
    check(witcert_cache_stats_get(cache_, &s));
    check(witcert_pool_stats_get(pool_, &p));
    py::dict d;
    d["page_ins"] = s.page_ins;
    d["page_in_bytes"] = s.page_in_bytes;
    d["sequence_bytes"] = s.bytes;
    d["pool_pages"] = p.pages;
    d["pool_free_pages"] = p.free_pages;
    d["page_size"] = p.page_size;
    d["pool_bytes"] = p.bytes;
    d["backing_bytes"] = p.backing_bytes;
    return d;
  }

 private:
  witcert_geometry g_{};
  witcert_pool* pool_ = nullptr;
  witcert_cache* cache_ = nullptr;
};

// Runs row(b) for b in [0, rows) without the GIL and raises the failure of the first failing row.
// Serial rows run on this thread and stop at the first failure (a cache's report keeps a shard per
// thread that records into it, so a batch whose caches' own reports are read stays on one thread);
// parallel rows, independent caches whose cells are drained, run on the process's OpenMP threads.
template <class Row>
void for_each_row(std::size_t rows, Row row, bool parallel = false) {
  std::vector<witcert_status> status(rows, WITCERT_OK);
  std::vector<std::string> message(rows);
  const auto run = [&](std::size_t b) {
    status[b] = row(b);
    if (status[b] != WITCERT_OK) message[b] = witcert_last_error();  // the error text is per thread
    return status[b] == WITCERT_OK;
  };
  {
    py::gil_scoped_release nogil;
    if (parallel) {
      const long n = static_cast<long>(rows);
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
      for (long b = 0; b < n; ++b) run(static_cast<std::size_t>(b));
    } else {
      for (std::size_t b = 0; b < rows && run(b); ++b) {
      }
    }
  }
  for (std::size_t b = 0; b < rows; ++b)
    if (status[b] != WITCERT_OK) check(status[b], "row " + std::to_string(b) + ": " + message[b]);
}

std::vector<Cache*> caches_of(const py::list& caches, const py::array& x, const char* name, int ndim = 4) {
  if (caches.empty() || x.ndim() != ndim || x.shape(0) != static_cast<py::ssize_t>(caches.size()))
    throw py::value_error(std::string(name) + (ndim == 4 ? " must be (rows, heads, tokens, head_dim)"
                                                         : " must be (rows, heads, head_dim)") +
                          ", one row per cache");
  std::vector<Cache*> out;
  for (const py::handle& h : caches) out.push_back(&h.cast<Cache&>());
  // One shape of layer; capacities may differ (each request has its own).
  const witcert_geometry& g = out[0]->geometry();
  for (const Cache* c : out) {
    const witcert_geometry& o = c->geometry();
    if (o.layers != g.layers || o.q_heads != g.q_heads || o.kv_heads != g.kv_heads || o.head_dim != g.head_dim)
      throw py::value_error("the caches of a batch must have one geometry (layers, heads, head_dim)");
  }
  return out;
}

// Cache.write_rows for every row of a batch in one call: k and v are (rows, kv_heads, T, head_dim),
// row b written into caches[b].
void write_batch(const py::list& caches, int layer, long pos0, const py::object& k_obj, const py::object& v_obj) {
  const auto k = take<float>(k_obj, "k", 4), v = take<float>(v_obj, "v", 4);
  const std::vector<Cache*> cs = caches_of(caches, k, "k");
  const witcert_geometry& g = cs[0]->geometry();
  if (!std::equal(k.shape(), k.shape() + 4, v.shape()) || k.shape(1) != g.kv_heads || k.shape(3) != g.head_dim)
    throw py::value_error("k and v must both be (rows, kv_heads, tokens, head_dim) = (" + std::to_string(cs.size()) +
                          ", " + std::to_string(g.kv_heads) + ", T, " + std::to_string(g.head_dim) + ")");
  const long T = static_cast<long>(k.shape(2));
  const std::size_t per_row = static_cast<std::size_t>(g.kv_heads) * T * g.head_dim;
  for_each_row(cs.size(), [&](std::size_t b) {
    return cs[b]->write_into(layer, pos0, T, k.data() + b * per_row, v.data() + b * per_row, nullptr, nullptr);
  });
}

// Cache.attend_rows for every row of a batch in one call: q is (rows, q_heads, T, head_dim), begins
// one per row; the outputs come token-major, (rows, T, q_heads, head_dim) as transformers' attention
// returns them, and the cells' fields as arrays (rows, q_heads, T).
py::tuple attend_batch(const py::list& caches, int layer, const py::object& q_obj, long pos0,
                       const std::vector<long>& begins, long window) {
  const auto q = take<float>(q_obj, "q", 4);
  const std::vector<Cache*> cs = caches_of(caches, q, "q");
  const witcert_geometry& g = cs[0]->geometry();
  cs[0]->check_queries(q, "q");
  if (begins.size() != cs.size()) throw py::value_error("begins must hold one position per row");
  const py::ssize_t rows = q.shape(0), T = q.shape(2), hq = g.q_heads, d = g.head_dim;
  py::array_t<float> out({rows, T, hq, d});
  py::dict cells = Cache::cell_arrays({rows, hq, T});
  std::vector<Cache::CellFields> fields;
  for (py::ssize_t b = 0; b < rows; ++b)
    fields.push_back(Cache::fields_of(cells, static_cast<std::size_t>(b), static_cast<std::size_t>(hq * T)));
  float* op = out.mutable_data();
  for_each_row(cs.size(), [&](std::size_t b) {
    return cs[b]->attend_into(layer, q.data() + b * hq * T * d, T, pos0, begins[b], window, op + b * T * hq * d, true,
                              fields[b]);
  });
  return py::make_tuple(out, cells);
}

// A request's report from cells drained elsewhere (witcert_report_*): another process's cache, or
// the ranks of a tensor-parallel model.
// The layer cache vLLM stored, as bytes with its shape (blocks, kv_heads, block_size, head_dim),
// element and layout, checked once for every read of it.
struct Stored {
  py::array_t<std::uint8_t> bytes;
  witcert::python::StoredShape shape{};
  witcert::python::StoredLayout layout{};
  witcert::python::StoredElement element{};
  Stored(const py::object& obj, const std::vector<long>& dims, const std::string& elem, const std::string& lay) {
    namespace wp = witcert::python;
    try {
      element = wp::stored_element(elem);
      layout = wp::stored_layout(lay);
    } catch (const std::invalid_argument& e) {
      throw py::value_error(e.what());
    }
    bytes = take<std::uint8_t>(obj, "stored", -1);
    if (dims.size() != 4 || *std::min_element(dims.begin(), dims.end()) < 1)
      throw py::value_error("shape must be (blocks, kv_heads, block_size, head_dim), each at least 1");
    shape = {dims[0], dims[1], dims[2], dims[3]};
    const long need = dims[0] * dims[1] * dims[2] * 2 * dims[3] * static_cast<long>(wp::element_bytes(element));
    if (bytes.size() != need)
      throw py::value_error("stored holds " + std::to_string(bytes.size()) + " bytes; its shape and element take " +
                            std::to_string(need));
    if (layout == wp::StoredLayout::amx && (dims[2] % 16 || dims[3] % 16))
      throw py::value_error("the amx layout needs block_size and head_dim multiples of 16");
  }
  // Keys and values of slot for every KV head, into k and v (kv_heads × head_dim each).
  void read(std::int64_t slot, float k_scale, float v_scale, float* k, float* v) const {
    witcert::python::read_stored(bytes.data(), shape, layout, element, slot, k_scale, v_scale, k, v);
  }
  std::vector<std::int64_t> slots(const py::object& obj) const {
    const auto a = take<std::int64_t>(obj, "slots", 1);
    std::vector<std::int64_t> out(a.data(), a.data() + a.size());
    for (std::size_t i = 0; i < out.size(); ++i)
      if (out[i] < 0 || out[i] >= shape.blocks * shape.block_size)
        throw py::value_error("slots[" + std::to_string(i) + "] is outside the cache");
    return out;
  }
};

// What vLLM stored at `slots`: (keys, values), each (slots, kv_heads, head_dim) float32.
py::tuple read_stored(const py::object& stored_obj, const std::vector<long>& shape, const std::string& element,
                      const std::string& layout, const py::object& slots_obj, double k_scale, double v_scale) {
  const Stored st(stored_obj, shape, element, layout);
  const std::vector<std::int64_t> slots = st.slots(slots_obj);
  const py::ssize_t n = static_cast<py::ssize_t>(slots.size()), kvh = shape[1], d = shape[3];
  py::array_t<float> k({n, kvh, d}), v({n, kvh, d});
  for (py::ssize_t i = 0; i < n; ++i)
    st.read(slots[i], static_cast<float>(k_scale), static_cast<float>(v_scale), k.mutable_data() + i * kvh * d,
            v.mutable_data() + i * kvh * d);
  return py::make_tuple(k, v);
}

// One decode position per row of vLLM's batch for one layer, in one call: row b writes its exact key
// and value (k, v: (rows, kv_heads, head_dim)) at position pos[b] of caches[b], beside what vLLM
// stored at slots[b] (read from `stored`); then attends its queries q (rows, q_heads, head_dim) as
// attend_batch does. Returns the outputs (rows, q_heads, head_dim) and the cells' fields as arrays
// (rows, q_heads, 1).
py::tuple vllm_decode(const py::list& caches, int layer, const std::vector<long>& pos, const py::object& k_obj,
                      const py::object& v_obj, const py::object& q_obj, const py::object& stored_obj,
                      const std::vector<long>& shape, const std::string& element, const std::string& layout,
                      const py::object& slots_obj, double k_scale, double v_scale, long window) {
  const auto k = take<float>(k_obj, "k", 3), v = take<float>(v_obj, "v", 3), q = take<float>(q_obj, "q", 3);
  const std::vector<Cache*> cs = caches_of(caches, q, "q", 3);
  const witcert_geometry& g = cs[0]->geometry();
  const Stored st(stored_obj, shape, element, layout);
  const std::vector<std::int64_t> slots = st.slots(slots_obj);
  const py::ssize_t rows = static_cast<py::ssize_t>(cs.size()), kvh = g.kv_heads, hq = g.q_heads, d = g.head_dim;
  for (const auto* a : {&k, &v})
    if (a->shape(0) != rows || a->shape(1) != kvh || a->shape(2) != d)
      throw py::value_error("k and v must be (rows, kv_heads, head_dim)");
  if (q.shape(1) != hq || q.shape(2) != d) throw py::value_error("q must be (rows, q_heads, head_dim)");
  if (shape[1] != kvh || shape[3] != d)
    throw py::value_error("the stored cache's heads or head_dim are not the caches'");
  if (pos.size() != cs.size() || slots.size() != cs.size())
    throw py::value_error("pos and slots must hold one entry per row");
  std::vector<float> kh(static_cast<std::size_t>(rows * kvh * d)), vh(kh.size());
  py::array_t<float> out({rows, hq, d});
  py::dict cells = Cache::cell_arrays({rows, hq, 1});
  std::vector<Cache::CellFields> fields;
  for (py::ssize_t b = 0; b < rows; ++b)
    fields.push_back(Cache::fields_of(cells, static_cast<std::size_t>(b), static_cast<std::size_t>(hq)));
  float* op = out.mutable_data();
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  // Rows are independent requests: inside vLLM, its OpenMP team (whose workers otherwise spin between
  // its kernels) takes them.
  for_each_row(
      cs.size(),
      [&](std::size_t b) {
        const std::size_t at = b * kvh * d;
        st.read(slots[b], ks, vs, kh.data() + at, vh.data() + at);
        const witcert_status s = cs[b]->write_into(layer, pos[b], 1, k.data() + at, v.data() + at, kh.data() + at,
                                                   vh.data() + at);
        if (s != WITCERT_OK) return s;
        return cs[b]->attend_into(layer, q.data() + b * hq * d, 1, pos[b], 0, window, op + b * hq * d, true,
                                  fields[b]);
      },
      true);
  return py::make_tuple(out, cells);
}

class Report {
 public:
  Report(const std::string& options, int layers, int q_heads, long first_pos) {
    check(witcert_report_create(options.c_str(), layers, q_heads, first_pos, &r_));
  }
  ~Report() { witcert_report_free(r_); }
  Report(const Report&) = delete;
  Report& operator=(const Report&) = delete;

  void record(const py::array_t<witcert_report_cell, py::array::c_style | py::array::forcecast>& cells) {
    check(witcert_report_record(r_, cells.data(), static_cast<size_t>(cells.size())));
  }
  void add_page_ins(long page_ins, long page_in_bytes) {
    check(witcert_report_add_page_ins(r_, page_ins, page_in_bytes));
  }
  std::string json() const {
    return text_of([&](char* json, size_t cap, size_t* n) { return witcert_report_json(r_, json, cap, n); });
  }

 private:
  witcert_report* r_ = nullptr;
};

class Engine {
 public:
  Engine(const std::string& path, int threads) { check(witcert_engine_load(path.c_str(), threads, &e_)); }
  ~Engine() { witcert_engine_free(e_); }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  std::vector<std::int32_t> tokenize(const std::string& text, bool chat) const {
    size_t n = 0;
    witcert_status s = witcert_engine_tokenize(e_, text.c_str(), chat, nullptr, 0, &n);
    if (s != WITCERT_ERROR_BUFFER_TOO_SMALL && s != WITCERT_OK) check(s);
    std::vector<std::int32_t> ids(n);
    check(witcert_engine_tokenize(e_, text.c_str(), chat, ids.data(), ids.size(), &n));
    return ids;
  }

  // The request as JSON (the C API's request_json); on_token(token, piece, step_meter or None)
  // returning True cancels.
  py::dict generate(const std::string& prompt, const std::string& request_json, const py::object& on_token) {
    struct Ctx {
      py::object cb;
      std::string text;
      std::vector<std::int32_t> tokens;
      bool failed = false;
      std::unique_ptr<py::error_already_set> error;
    } ctx{on_token, {}, {}, false, nullptr};
    const auto trampoline = [](void* user, int32_t token, const char* piece, const witcert_step_meter* m) -> int {
      auto* c = static_cast<Ctx*>(user);
      c->tokens.push_back(token);
      c->text += piece;
      if (c->cb.is_none() || c->failed) return c->failed;
      try {
        py::object meter = py::none();
        if (m) {
          py::dict d;
          d["cells"] = m->cells;
          d["coverage_k"] = m->coverage_k;
          d["coverage_v"] = m->coverage_v;
          d["raw_max"] = m->raw_max;
          d["meter_max"] = m->meter_max;
          d["repaired"] = m->repaired;
          meter = d;
        }
        return py::cast<bool>(py::bool_(c->cb(token, py::bytes(piece), meter))) ? 1 : 0;
      } catch (py::error_already_set& e) {
        c->failed = true;  // stop, and raise the callback's exception after the call returns
        c->error = std::make_unique<py::error_already_set>(std::move(e));
        return 1;
      }
    };
    witcert_generation r{};
    const witcert_status s = witcert_engine_generate(e_, prompt.c_str(), request_json.c_str(), trampoline, &ctx, &r,
                                                     nullptr, 0, nullptr);
    if (ctx.failed) throw *ctx.error;
    check(s);
    py::dict out;
    out["text"] = py::bytes(ctx.text).attr("decode")("utf-8", "replace");
    out["tokens"] = ctx.tokens;
    out["prompt_tokens"] = r.prompt_tokens;
    out["completion_tokens"] = r.completion_tokens;
    out["finish_reason"] = r.cancelled ? "cancelled" : r.stopped ? "stop" : "length";
    static const char* const kVerdicts[] = {"certified", "repaired", "at-risk", "unmetered"};
    out["verdict"] = kVerdicts[r.verdict];
    out["reason"] = std::string(r.reason);
    if (r.has_meter) {
      py::dict m;
      m["cells"] = r.cells;
      m["coverage_k"] = r.coverage_k;
      m["coverage_v"] = r.coverage_v;
      m["raw_median"] = r.raw_median;
      m["raw_p90"] = r.raw_p90;
      m["raw_max"] = r.raw_max;
      m["page_ins"] = r.page_ins;
      m["page_in_bytes"] = r.page_in_bytes;
      out["meter"] = m;
    } else {
      out["meter"] = py::none();
    }
    return out;
  }

 private:
  witcert_engine* e_ = nullptr;
};

}  // namespace

PYBIND11_MODULE(_witcert, m) {
  PYBIND11_NUMPY_DTYPE(witcert_report_cell, layer, q_head, pos, raw, meter, v_meter, output_bound, raw_before,
                       meter_before, v_meter_before, v_meter_sure, tv, v_true, repaired);
  m.doc() = "WitCert's C API for Python (the witcert package wraps it with type hints).";
  m.attr("API_VERSION") = witcert_api_version();
  m.attr("__version__") = witcert_version();
  m.def("meter_logits", &meter_logits, py::arg("z"), py::arg("c"));
  m.def("meter_probs", &meter_probs, py::arg("p_tilde"), py::arg("c"));
  m.def("meter_tanh", [](double c_max) {
    double t = 0, th = 0;
    check(witcert_meter_tanh(c_max, &t, &th));
    return py::make_tuple(t, th);
  });
  m.def("meter_log_domain", [](double log_a, double log_a_minus) {
    double e = 0, ts = 0;
    check(witcert_meter_log_domain(log_a, log_a_minus, &e, &ts));
    return py::make_tuple(e, ts);
  });
  m.def("true_tv", [](const py::object& p_obj, const py::object& e_obj) {
    const auto p = take<double>(p_obj, "p_tilde"), e = take<double>(e_obj, "eps");
    if (p.size() != e.size()) throw py::value_error("p_tilde and eps must have the same length");
    double tv = 0;
    check(witcert_true_tv(p.data(), e.data(), static_cast<size_t>(p.size()), &tv));
    return tv;
  });
  m.def("meter_batch", &meter_batch);
  m.def("write_batch", &write_batch);
  m.def("attend_batch", &attend_batch);
  m.def("read_stored", &read_stored);
  m.def("vllm_decode", &vllm_decode);
  m.def("witness_batch", &witness_batch);
  m.def("tier_a_batch", &tier_a_batch);
  m.def("delta_loc", [](double delta_req, long layers, long q_heads, long steps) {
    double d = 0;
    check(witcert_delta_loc(delta_req, layers, q_heads, steps, &d));
    return d;
  });
  m.def("value_bound", [](double tv_k, double v_max_norm, double weighted_rho) {
    double b = 0, vm = 0;
    check(witcert_value_bound(tv_k, v_max_norm, weighted_rho, &b, &vm));
    return py::make_tuple(b, vm);
  });
  py::class_<DitherInt8>(m, "DitherInt8")
      .def(py::init<int, int, std::uint64_t, const py::object&>(), py::arg("d"), py::arg("group"), py::arg("seed"),
           py::arg("outliers"))
      .def("dither", &DitherInt8::dither)
      .def("encode", &DitherInt8::encode)
      .def("decode", &DitherInt8::decode)
      .def("radius", &DitherInt8::radius)
      .def_property_readonly("d", &DitherInt8::d)
      .def_property_readonly("group", &DitherInt8::group);
  py::class_<Cache>(m, "Cache")
      .def(py::init<int, int, int, int, long, const std::string&, long, long, const std::string&>())
      .def("write", &Cache::write)
      .def("attend", &Cache::attend)
      .def("write_rows", &Cache::write_rows)
      .def("attend_rows", &Cache::attend_rows)
      .def("report_start", &Cache::report_start)
      .def("report", &Cache::report)
      .def("promote_all", &Cache::promote_all)
      .def("keep_cells", &Cache::keep_cells)
      .def("drain_cells", &Cache::drain_cells)
      .def("stats", &Cache::stats);
  py::class_<Report>(m, "Report")
      .def(py::init<const std::string&, int, int, long>())
      .def("record", &Report::record)
      .def("add_page_ins", &Report::add_page_ins)
      .def("json", &Report::json);
  py::class_<Engine>(m, "Engine")
      .def(py::init<const std::string&, int>())
      .def("tokenize", &Engine::tokenize)
      .def("generate", &Engine::generate);
}
