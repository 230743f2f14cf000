// The oneDNN conv tactic: fused conv layers of a tvm_layerfuse model run as oneDNN primitives.
//
// Each function below is called by the compiled model through R.call_dps_packed (destination
// passing: the output tensor is the last argument) and registered as a global function when
// this library is loaded (static initialiser), so a runtime-only process only has to dlopen it.
//
//   layerfuse.onednn.conv2d      (x, w, b,    attrs, out_1, ..., out_k)
//       concat(out_1, ..., out_k) = act(conv2d(x, w) + b)      (k >= 1: a horizontally merged
//       conv writes its split pieces; piece j is one conv with the rows o_j..o_j+O_j of w, b)
//   layerfuse.onednn.conv2d_add  (x, w, b, r, attrs, out)
//       out = act(conv2d(x, w) + b + r)      r: the residual, as oneDNN's `sum` post-op
//   layerfuse.onednn.conv2d_add_inplace  (x, w, b, r, a_0, ..., a_14)
//       the same with out = r (r's bytes become the result; the attrs as integer arguments,
//       called from TIR: Relax's call_tir_inplace tells memory planning that out is r)
//   layerfuse.onednn.conv2d_pre  (x_1, ..., x_k, s, t, w, b, attrs, out_1, ..., out_m)
//       conv2d of relu(x * s + t), x = concat(x_1, ..., x_k) on channels (k >= 1; s, t [C]: a
//       pre-activation BatchNorm + ReLU, folded): the prologue normalises each piece into its
//       channel range of a scratch buffer in x's layout (see RunPre), so the concatenation is
//       never written; k is found from attrs, the first Shape argument
//
//   x [N, C, H, W], w [O, C/groups, kh, kw], b [O], r and out [N, O, OH, OW], float32, NCHW.
//   attrs = (stride_h, stride_w, pad_top, pad_left, pad_bottom, pad_right, dilation_h,
//            dilation_w, groups, act, src_block, dst_block, alpha, beta, algorithm); act: 0 none,
//   1 relu (alpha: negative slope, i.e. LeakyRelu), 2 clip [alpha, beta], 3 silu
//   (x * sigmoid(x)), 4 sigmoid; alpha and beta are the bits of a float32 (an integer shape
//   entry costs the VM nothing, a float argument a kernel launch each); src_block is x's block
//   width B (0 plain NCHW, 8 nChw8c, 16 nChw16c, see Layouts), dst_block packs out_j's width
//   in its bits [5j, 5j + 5) (one output: dst_block is its width); algorithm: 0 direct, 1 Winograd (oneDNN's F(4x4, 3x3) or F(2x2, 3x3)
//   kernels: 3x3, stride 1, fewer multiplies, chosen per layer by timing at compile time).
//   The BatchNorm of the layer is already folded into w and b.
//
// Layouts. A tensor's bytes are plain NCHW, or - when its producer and all its readers are
// layers of this library, and C % B == 0 - oneDNN's blocked nChwBc (same size, same
// [N, C, H, W] type for TVM, which never reads it): src_block / dst_block say which. The
// block width B is the one oneDNN's optimised kernels use on the CPU the model is compiled
// for (block_width(): 16 with AVX-512, 8 with AVX2 or SSE4.1, where nChw16c gets only the
// reference kernel); the compiler writes it into every call, so this library never guesses
// it and an artifact's bytes mean the same wherever it runs.
// A conv's blocked src or (single) dst may also have C % B != 0: its type is then
// [N, ceilB(C), H, W], the padded nChwBc bytes, and C / O come from the weights.
// A plain src or dst is reordered to/from the layout the primitive prefers (blocked, where
// oneDNN's JIT kernels run with their post-ops fused) in buffers kept with the layer; a
// blocked one is used in place, so consecutive convs run with no reorder between them.
//
// A primitive is created once per (shapes, attributes, weight tensor) and kept; its weights
// are reordered once into the layout the primitive prefers (blocked, e.g. OIhw16i16o) when
// the layer first runs, never per inference. A fingerprint of the weight tensor (a few
// sampled values) is compared on every call, so new weights at the same address are
// reordered again instead of being used stale.
//
//   layerfuse.onednn.to_blocked  (x, (B,), out)  out = x in nChwBc (see Layouts)
//   layerfuse.onednn.concat      (x_1, ..., x_k, out)   channel concat: per image, piece i is
//       the contiguous range [c_i * H * W, (c_i + C_i) * H * W) of out - in NCHW, and in
//       nChwBc too when every c_i and C_i is a multiple of B (all pieces in one layout)
//   layerfuse.onednn.concat_convs (spec, a_1, ..., a_m, out)   a concat (batch 1) whose pieces
//       are convs (and copies) writing their channel ranges of out directly (see ConcatConvs)
//   layerfuse.onednn.dense       (x, w, b, out)     out = x @ w + b: x [N, K], w [K, M], b [M]
//   layerfuse.onednn.pool2d      (x, attrs, out)
//       attrs = (alg, kh, kw, stride_h, stride_w, pad_top, pad_left, pad_bottom, pad_right,
//       block); alg: 0 max, 1 average counting the padding, 2 average over the input
//       elements only; out's size decides the right/bottom padding oneDNN adds (ceil_mode);
//       x and out both in nChwBc when block = B != 0, else both NCHW
//
//   layerfuse.onednn.implementation(x_shape, w_shape, attrs, residual) -> str
//       the implementation oneDNN picks for that layer on this machine (impl_info_str), e.g.
//       "jit:avx512_core" or "jit_1x1:avx2"; the compiler refuses "ref:" kernels.
//   layerfuse.onednn.block_width() -> int   B for this CPU: 16 where oneDNN runs its AVX-512
//       kernels (avx512_core), 8 with AVX2 / AVX / SSE4.1, 0 (plain layouts only) below
//   layerfuse.onednn.time_conv(x_shape, w_shape, attrs_a, attrs_b, residual, reps) -> [ms_a, ms_b]
//       that layer's time here under two attrs, fastest of reps interleaved runs each
//       (for the algorithm choice)
//   layerfuse.onednn.pool_implementation(x_shape, out_shape, attrs) -> str   the same, pools

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

namespace layerfuse_onednn {

using tvm::ffi::Shape;
using tvm::ffi::String;
using tvm::ffi::TensorView;
using dims = dnnl::memory::dims;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;

constexpr int kFingerprint = 16;  // sampled weight values compared per call

float FloatBits(int64_t v) {
  const uint32_t bits = static_cast<uint32_t>(v);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The block width of a blocked layout: 8 (nChw8c) or 16 (nChw16c); 0 is plain NCHW.
void CheckBlock(int64_t block) {
  if (block != 0 && block != 8 && block != 16)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn: block width must be 0, 8 or 16, got " << block;
}

tag Blocked(int64_t block) {
  CheckBlock(block);
  return block == 16 ? tag::nChw16c : tag::nChw8c;
}

// out_j's block width from a conv's dst_block (5 bits per output)
int64_t DstBlock(int64_t dst_block, size_t j) {
  const int64_t block = j < 12 ? (dst_block >> (5 * j)) & 31 : 0;
  CheckBlock(block);
  return block;
}

struct Attrs {
  int64_t stride[2], pad_l[2], pad_r[2], dilation[2], groups, act, src_block, dst_block;
  float alpha, beta;
  int64_t algorithm;  // 0 direct, 1 Winograd
  static Attrs From(const Shape& a) {
    if (a.size() != 15) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: attrs must have 15 entries, got " << a.size();
    if (a[14] != 0 && a[14] != 1) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: unknown conv algorithm " << a[14];
    CheckBlock(a[10]);
    return Attrs{{a[0], a[1]}, {a[2], a[3]}, {a[4], a[5]}, {a[6], a[7]}, a[8], a[9], a[10], a[11],
                 FloatBits(a[12]), FloatBits(a[13]), a[14]};
  }
};

// The engine and the layers live until the process ends and are never destroyed: static
// destructors at exit would otherwise free primitives after the engine (or oneDNN) is gone.
dnnl::engine& Engine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

dims Dims(const int64_t* d, int n) { return dims(d, d + n); }

dnnl::convolution_forward::primitive_desc MakeDesc(const dims& x, const dims& w, const Attrs& at, bool residual,
                                                   int64_t dst_block) {
  const int64_t N = x[0], C = x[1], H = x[2], W = x[3];
  const int64_t O = w[0], kh = w[2], kw = w[3], G = at.groups;
  auto out_size = [&](int64_t in, int64_t k, int i) {
    return (in + at.pad_l[i] + at.pad_r[i] - ((k - 1) * at.dilation[i] + 1)) / at.stride[i] + 1;
  };
  const int64_t OH = out_size(H, kh, 0), OW = out_size(W, kw, 1);
  if (C != w[1] * G || O % G != 0) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: conv shapes do not agree";
  dnnl::memory::desc src({N, C, H, W}, dt::f32, at.src_block ? Blocked(at.src_block) : tag::any);
  dnnl::memory::desc dst({N, O, OH, OW}, dt::f32, dst_block ? Blocked(dst_block) : tag::any);
  dnnl::memory::desc bias({O}, dt::f32, tag::x);
  dims wdims = G == 1 ? dims{O, C, kh, kw} : dims{G, O / G, C / G, kh, kw};
  dnnl::memory::desc wei(wdims, dt::f32, tag::any);
  const dnnl::algorithm algorithm =
      at.algorithm == 1 ? dnnl::algorithm::convolution_winograd : dnnl::algorithm::convolution_direct;
  dnnl::convolution_forward::desc d(dnnl::prop_kind::forward_inference, algorithm, src, wei,
                                    bias, dst, {at.stride[0], at.stride[1]},
                                    {at.dilation[0] - 1, at.dilation[1] - 1}, {at.pad_l[0], at.pad_l[1]},
                                    {at.pad_r[0], at.pad_r[1]});
  dnnl::post_ops ops;
  if (residual) ops.append_sum(1.f);
  switch (at.act) {
    case 0: break;
    case 1: ops.append_eltwise(1.f, dnnl::algorithm::eltwise_relu, at.alpha, 0.f); break;
    case 2: ops.append_eltwise(1.f, dnnl::algorithm::eltwise_clip, at.alpha, at.beta); break;
    case 3: ops.append_eltwise(1.f, dnnl::algorithm::eltwise_swish, 1.f, 0.f); break;
    case 4: ops.append_eltwise(1.f, dnnl::algorithm::eltwise_logistic, 0.f, 0.f); break;
    default: TVM_FFI_THROW(ValueError) << "layerfuse.onednn: unknown activation code " << at.act;
  }
  dnnl::primitive_attr attr;
  attr.set_post_ops(ops);
  return dnnl::convolution_forward::primitive_desc(d, attr, Engine());
}

struct Layer {
  dnnl::convolution_forward::primitive_desc pd;
  dnnl::convolution_forward prim;
  dnnl::memory weights;  // in pd.weights_desc(), owned
  std::vector<float> fingerprint;
  // plain NCHW <-> the primitive's layout, for a src/dst that is plain in the graph
  dnnl::memory::desc src_plain, dst_plain;
  bool src_reorder = false, dst_reorder = false;
  dnnl::memory src_buf, dst_buf;  // owned, in pd.src_desc() / pd.dst_desc()
  dnnl::reorder src_in, dst_in, dst_out;
};

std::vector<float> Fingerprint(const float* w, int64_t n) {
  std::vector<float> f;
  for (int k = 0; k < kFingerprint && n > 0; ++k) f.push_back(w[(n - 1) * k / (kFingerprint - 1)]);
  return f;
}

const float* Data(const TensorView& t) {
  return reinterpret_cast<const float*>(static_cast<const char*>(t.data_ptr()) + t.byte_offset());
}

void CheckTensor(const TensorView& t, int ndim, const char* what) {
  if (t.dtype().code != kDLFloat || t.dtype().bits != 32 || t.dtype().lanes != 1)
    TVM_FFI_THROW(TypeError) << "layerfuse.onednn: " << what << " must be float32";
  if (t.ndim() != ndim) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: " << what << " must be " << ndim << "-d";
  if (t.device().device_type != kDLCPU) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: " << what << " is not on the CPU";
  if (!t.IsContiguous()) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: " << what << " must be contiguous";
}

std::mutex& Mutex() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}

std::unordered_map<std::string, std::unique_ptr<Layer>>& Layers() {
  static auto* layers = new std::unordered_map<std::string, std::unique_ptr<Layer>>();
  return *layers;
}

// The rows [o, o + O) of a conv's weights and bias: one piece of a merged conv (or all of it).
struct Rows {
  const float* w;  // [O, C/groups, kh, kw]
  const float* b;  // [O]
  dims wdims;
};

Layer& Get(const dims& x, const Rows& rows, const Attrs& at, const Shape& attrs, bool residual, int64_t dst_block) {
  std::ostringstream key;
  key << (residual ? "sum:" : "") << static_cast<const void*>(rows.w) << ':' << dst_block;
  for (int i = 0; i < 4; ++i) key << ':' << x[i] << ',' << rows.wdims[i];
  for (int64_t v : attrs) key << ';' << v;
  const int64_t wn = rows.wdims[0] * rows.wdims[1] * rows.wdims[2] * rows.wdims[3];
  auto& layers = Layers();
  auto it = layers.find(key.str());
  if (it != layers.end() && it->second->fingerprint == Fingerprint(rows.w, wn)) return *it->second;
  auto layer = std::make_unique<Layer>();
  layer->pd = MakeDesc(x, rows.wdims, at, residual, dst_block);
  layer->prim = dnnl::convolution_forward(layer->pd);
  // the weights, once, into the layout the primitive prefers
  const dims& w = rows.wdims;
  dims plain = at.groups == 1 ? w : dims{at.groups, w[0] / at.groups, w[1], w[2], w[3]};
  dnnl::memory::desc user(plain, dt::f32, at.groups == 1 ? tag::oihw : tag::goihw);
  dnnl::memory src(user, Engine(), const_cast<float*>(rows.w));
  layer->weights = dnnl::memory(layer->pd.weights_desc(), Engine());
  dnnl::stream s(Engine());
  dnnl::reorder(src, layer->weights).execute(s, src, layer->weights);
  s.wait();
  layer->fingerprint = Fingerprint(rows.w, wn);
  // plain activations: reorders into and out of the primitive's layout, buffers kept
  const dnnl::memory::desc src_md = layer->pd.src_desc(), dst_md = layer->pd.dst_desc();
  layer->src_plain = dnnl::memory::desc(src_md.dims(), dt::f32, tag::nchw);
  layer->dst_plain = dnnl::memory::desc(dst_md.dims(), dt::f32, tag::nchw);
  layer->src_reorder = !at.src_block && src_md != layer->src_plain;
  layer->dst_reorder = !dst_block && dst_md != layer->dst_plain;
  if (layer->src_reorder) {
    layer->src_buf = dnnl::memory(src_md, Engine());
    layer->src_in = dnnl::reorder(dnnl::memory(layer->src_plain, Engine(), nullptr), layer->src_buf);
  }
  if (layer->dst_reorder) {
    layer->dst_buf = dnnl::memory(dst_md, Engine());
    layer->dst_in = dnnl::reorder(dnnl::memory(layer->dst_plain, Engine(), nullptr), layer->dst_buf);
    layer->dst_out = dnnl::reorder(layer->dst_buf, dnnl::memory(layer->dst_plain, Engine(), nullptr));
  }
  Layer& ref = *layer;
  layers[key.str()] = std::move(layer);
  return ref;
}

// A destination: a whole output tensor, or the channel range of a concat block it fills.
struct View {
  float* data;
  dims shape;  // [N, O, OH, OW]
  int64_t padded_c = 0;  // O rounded up to B where the tensor holds padded nChwBc, else 0
  int64_t numel() const { return shape[0] * (padded_c ? padded_c : shape[1]) * shape[2] * shape[3]; }
};

int64_t RoundUp(int64_t c, int64_t block) { return (c + block - 1) / block * block; }

View ViewOf(const TensorView& t) { return View{const_cast<float*>(Data(t)), Dims(t.shape().data(), 4)}; }

// One conv (rows of a merged one, or all of it) from x into out, with the mutex held.
// r: the residual (out's shape), or null.
void RunRows(const float* x, const dims& x_dims, const Rows& rows, const Attrs& at, const Shape& attrs,
             const float* r, const View& out, int64_t dst_block) {
  Layer& layer = Get(x_dims, rows, at, attrs, r != nullptr, dst_block);
  for (int i = 0; i < 4; ++i) {
    if (out.shape[i] != layer.pd.dst_desc().dims()[i])
      TVM_FFI_THROW(ValueError) << "layerfuse.onednn: output shape does not match the conv";
  }
  float* dst_ptr = out.data;
  dnnl::stream s(Engine());
  dnnl::memory src, dst;
  if (layer.src_reorder) {
    dnnl::memory user(layer.src_plain, Engine(), const_cast<float*>(x));
    layer.src_in.execute(s, user, layer.src_buf);
    src = layer.src_buf;
  } else {
    src = dnnl::memory(layer.pd.src_desc(), Engine(), const_cast<float*>(x));
  }
  if (layer.dst_reorder) {
    dst = layer.dst_buf;
    if (r) {  // the residual, in the primitive's layout, for the sum post-op
      dnnl::memory user(layer.dst_plain, Engine(), const_cast<float*>(r));
      layer.dst_in.execute(s, user, dst);
    }
  } else {
    dst = dnnl::memory(layer.pd.dst_desc(), Engine(), dst_ptr);
    if (r && r != dst_ptr) std::memcpy(dst_ptr, r, sizeof(float) * out.numel());
  }
  dnnl::memory bias(layer.pd.bias_desc(), Engine(), const_cast<float*>(rows.b));
  layer.prim.execute(s, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, layer.weights}, {DNNL_ARG_BIAS, bias}, {DNNL_ARG_DST, dst}});
  if (layer.dst_reorder) {
    dnnl::memory user(layer.dst_plain, Engine(), dst_ptr);
    layer.dst_out.execute(s, dst, user);
  }
  s.wait();
}

// The prologue of a pre-activation layer (DenseNet's BatchNorm + ReLU before the conv):
// relu(x * s + t), s and t per input channel, into a scratch buffer kept per input shape and
// layout, which the conv then reads. The input is one tensor or the pieces x_1..x_k of a
// channel concatenation, which is never materialised: piece i is normalised with
// s[c_i : c_i + C_i], t[c_i : ...] straight into its channel range of the scratch (per image
// the contiguous range [c_i * H * W, (c_i + C_i) * H * W), in NCHW and - with c_i, C_i
// multiples of B - in nChwBc). A vectorised loop (AVX-512 / AVX2 clones picked at load
// time) over units of one channel (NCHW) or one B-channel block (nChwBc) of one piece and
// image, spread over oneDNN's OpenMP threads in one parallel region per call: measured on
// DenseNet-121, one oneDNN binary primitive (mul, post-ops add and relu) per piece cost
// 3 ms more per inference in call overhead (about 600 small pieces), and over a whole
// single tensor the loop runs as fast as the primitive.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LAYERFUSE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LAYERFUSE_CLONES
#endif

// y = max(x * s + t, 0) for hw pixels of one channel (NCHW)
LAYERFUSE_CLONES void NormaliseChannel(const float* __restrict x, float s, float t, float* __restrict y, int64_t hw) {
  int64_t p = 0;
  for (; p + 16 <= hw; p += 16)  // a constant trip count: vectorised at -O2
    for (int l = 0; l < 16; ++l) y[p + l] = std::max(x[p + l] * s + t, 0.f);
  for (; p < hw; ++p) y[p] = std::max(x[p] * s + t, 0.f);
}

// the same for hw pixels of one B-channel block (nChwBc: B channels per pixel), B = 8 or 16
// (each a loop of constant trip count)
LAYERFUSE_CLONES void NormaliseBlock(const float* __restrict x, const float* __restrict s, const float* __restrict t,
                                     float* __restrict y, int64_t hw, int64_t block) {
  float sv[16], tv[16];
  for (int l = 0; l < block; ++l) sv[l] = s[l], tv[l] = t[l];
  if (block == 16) {
    for (int64_t p = 0; p < hw; ++p)
      for (int l = 0; l < 16; ++l) y[p * 16 + l] = std::max(x[p * 16 + l] * sv[l] + tv[l], 0.f);
  } else {
    for (int64_t p = 0; p < hw; ++p)
      for (int l = 0; l < 8; ++l) y[p * 8 + l] = std::max(x[p * 8 + l] * sv[l] + tv[l], 0.f);
  }
}

// A conv's input: one tensor, or (with a prologue) the pieces of its channel concatenation.
struct Input {
  std::vector<TensorView> pieces;     // k >= 1; k > 1 only with a prologue
  const TensorView* sc = nullptr;     // the prologue's s and t [C], or null
  const TensorView* sh = nullptr;
};

// [N, C, H, W] of the concatenation of the pieces (checked: same N, H, W; 4-d float32).
dims InputDims(const Input& in) {
  if (in.pieces.empty()) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: no input";
  if (in.pieces.size() > 1 && !in.sc) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: input pieces need a prologue";
  dims d;
  for (const TensorView& x : in.pieces) {
    CheckTensor(x, 4, "input");
    const dims xd = Dims(x.shape().data(), 4);
    if (d.empty()) {
      d = xd;
    } else if (xd[0] != d[0] || xd[2] != d[2] || xd[3] != d[3]) {
      TVM_FFI_THROW(ValueError) << "layerfuse.onednn: input pieces differ in batch or spatial size";
    } else {
      d[1] += xd[1];
    }
  }
  return d;
}

// relu(concat(pieces) * s + t) into the scratch for dims d (see the prologue above), mutex held.
const float* RunPre(const Input& in, const dims& d, int64_t block) {
  const int64_t N = d[0], C = d[1], HW = d[2] * d[3];
  if (in.sc->numel() != C || in.sh->numel() != C)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn: prologue scale/shift length != input channels";
  static auto* scratch = new std::unordered_map<std::string, dnnl::memory>();
  std::ostringstream key;
  for (auto e : d) key << e << ',';
  key << block;
  auto buf = scratch->find(key.str());
  if (buf == scratch->end())
    buf = scratch->emplace(key.str(), dnnl::memory({d, dt::f32, block ? Blocked(block) : tag::nchw}, Engine())).first;
  float* out = static_cast<float*>(buf->second.get_data_handle());
  struct Unit {  // one channel (NCHW) or B-channel block (nChwBc) of one piece and image
    const float* x;
    int64_t c;  // its first channel in the concatenation
    float* y;
  };
  std::vector<Unit> units;
  const int64_t step = block ? block : 1;
  int64_t c = 0;  // the piece's first channel
  for (const TensorView& x : in.pieces) {
    const int64_t Ci = x.shape()[1];
    if (block && (c % block || Ci % block))
      TVM_FFI_THROW(ValueError) << "layerfuse.onednn: blocked input pieces need channels in multiples of " << block;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t u = 0; u < Ci; u += step) units.push_back(Unit{Data(x) + (n * Ci + u) * HW, c + u, out + (n * C + c + u) * HW});
    c += Ci;
  }
  const float* sc = Data(*in.sc);
  const float* sh = Data(*in.sh);
  const int64_t count = static_cast<int64_t>(units.size());
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    const Unit& u = units[i];
    if (block) {
      NormaliseBlock(u.x, sc + u.c, sh + u.c, u.y, HW, block);
    } else {
      NormaliseChannel(u.x, sc[u.c], sh[u.c], u.y, HW);
    }
  }
  return out;
}

// The conv of one call (mutex held): the input (its prologue first), w, b [, r] into the views outs.
void RunLocked(const Input& in, const TensorView& w, const TensorView& b, const TensorView* r, const Shape& attrs,
               const std::vector<View>& outs) {
  dims x_dims = InputDims(in);
  CheckTensor(w, 4, "weight");
  CheckTensor(b, 1, "bias");
  if (r) CheckTensor(*r, 4, "residual");
  Attrs at = Attrs::From(attrs);
  if (outs.empty()) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: no output";
  if (outs.size() > 1 && (r || at.groups != 1))
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn: split outputs need a conv without residual and groups";
  if (b.shape()[0] != w.shape()[0]) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: bias length != channels";
  const int64_t row = w.shape()[1] * w.shape()[2] * w.shape()[3];  // weights per output channel
  // Padded channels: a blocked tensor whose C is not a multiple of B has the type (and bytes)
  // [N, ceilB(C), H, W]; the conv's C and O come from the weights.
  const int64_t C = w.shape()[1] * at.groups, O = w.shape()[0];
  if (!in.sc && at.src_block && x_dims[1] != C && x_dims[1] == RoundUp(C, at.src_block)) x_dims[1] = C;
  std::vector<View> views = outs;
  const int64_t dst0 = DstBlock(at.dst_block, 0);
  if (views.size() == 1 && dst0 && views[0].shape[1] != O && views[0].shape[1] == RoundUp(O, dst0)) {
    views[0].padded_c = views[0].shape[1];
    views[0].shape[1] = O;
  }
  int64_t o = 0;  // output channels done
  const float* xdata = in.sc ? RunPre(in, x_dims, at.src_block) : Data(in.pieces[0]);
  for (size_t j = 0; j < views.size(); ++j) {
    const int64_t Oj = views[j].shape[1];
    if (o + Oj > w.shape()[0]) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: outputs have more channels than the conv";
    if (r && views[j].numel() != r->numel()) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: residual shape != output shape";
    Rows rows{Data(w) + o * row, Data(b) + o, dims{Oj, w.shape()[1], w.shape()[2], w.shape()[3]}};
    RunRows(xdata, x_dims, rows, at, attrs, r ? Data(*r) : nullptr, views[j], DstBlock(at.dst_block, j));
    o += Oj;
  }
  if (o != w.shape()[0]) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: outputs give " << o << " channels, not " << w.shape()[0];
}

void Run(const Input& in, const TensorView& w, const TensorView& b, const TensorView* r, const Shape& attrs,
         const std::vector<TensorView>& outs) {
  std::vector<View> views;
  for (const auto& t : outs) {
    CheckTensor(t, 4, "output");
    views.push_back(ViewOf(t));
  }
  try {
    std::lock_guard<std::mutex> lock(Mutex());
    RunLocked(in, w, b, r, attrs, views);
  } catch (const dnnl::error& e) {
    TVM_FFI_THROW(RuntimeError) << "layerfuse.onednn: oneDNN failed: " << e.what();
  }
}

// The index of a pre-activation layer's attrs among args[first...]: (x_1, ..., x_k, s, t, w, b,
// attrs, ...) with k >= 1, attrs the first Shape.
int PreAttrsAt(const tvm::ffi::PackedArgs& args, int first, const char* who) {
  int a = first;
  while (a < args.size() && !args[a].as<Shape>().has_value()) ++a;
  if (a >= args.size() || a - first < 5)
    TVM_FFI_THROW(ValueError) << who << ": expected (x_1, ..., x_k, s, t, w, b, attrs, ...)";
  return a;
}

// conv2d(x, w, b, attrs, out_1, ..., out_k)
void Conv2d(tvm::ffi::PackedArgs args, tvm::ffi::Any* rv) {
  if (args.size() < 5) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.conv2d: expected (x, w, b, attrs, out...)";
  std::vector<TensorView> outs;
  for (int i = 4; i < args.size(); ++i) outs.push_back(args[i].cast<TensorView>());
  Run(Input{{args[0].cast<TensorView>()}}, args[1].cast<TensorView>(), args[2].cast<TensorView>(), nullptr,
      args[3].cast<Shape>(), outs);
}

void Conv2dAdd(TensorView x, TensorView w, TensorView b, TensorView r, Shape attrs, TensorView out) {
  Run(Input{{x}}, w, b, &r, attrs, {out});
}

// conv2d_add_inplace(x, w, b, r, attrs_0, ..., attrs_n): conv2d_add with out = r, the attrs as
// integer arguments (the call comes from a TIR function that Relax calls with call_tir_inplace,
// so memory planning knows out is r). The sum post-op reads r where it writes: no copy.
void Conv2dAddInplace(tvm::ffi::PackedArgs args, tvm::ffi::Any* rv) {
  if (args.size() < 5) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.conv2d_add_inplace: expected (x, w, b, r, attrs...)";
  std::vector<int64_t> a;
  for (int i = 4; i < args.size(); ++i) a.push_back(args[i].cast<int64_t>());
  TensorView r = args[3].cast<TensorView>();
  Run(Input{{args[0].cast<TensorView>()}}, args[1].cast<TensorView>(), args[2].cast<TensorView>(), &r, Shape(a.begin(), a.end()), {r});
}

// conv2d_pre(x_1, ..., x_k, s, t, w, b, attrs, out_1, ..., out_m): conv2d of
// relu(concat(x_1, ..., x_k) * s + t), the concatenation never materialised (see RunPre)
void Conv2dPre(tvm::ffi::PackedArgs args, tvm::ffi::Any* rv) {
  const int a = PreAttrsAt(args, 0, "layerfuse.onednn.conv2d_pre");
  Input in;
  for (int i = 0; i < a - 4; ++i) in.pieces.push_back(args[i].cast<TensorView>());
  TensorView sc = args[a - 4].cast<TensorView>(), sh = args[a - 3].cast<TensorView>();
  CheckTensor(sc, 1, "prologue scale");
  CheckTensor(sh, 1, "prologue shift");
  in.sc = &sc;
  in.sh = &sh;
  std::vector<TensorView> outs;
  for (int i = a + 1; i < args.size(); ++i) outs.push_back(args[i].cast<TensorView>());
  Run(in, args[a - 2].cast<TensorView>(), args[a - 1].cast<TensorView>(), nullptr, args[a].cast<Shape>(), outs);
}

// concat_convs(spec, a_1, ..., a_m, out): a channel concat whose pieces are made in place.
// spec = (block, kind_1, offset_1, ..., kind_k, offset_k); member j writes the channels
// [offset_j, offset_j + C_j) of out (batch 1: a contiguous range of out, in NCHW and - with
// offsets and C_j multiples of block B - in nChwBc) and takes its arguments from a_*: kind 0
// copy (x), 1 conv2d (x, w, b, attrs), 2 conv2d_pre (x_1, ..., x_k, s, t, w, b, attrs), 3
// conv2d_add (x, w, b, r, attrs), as the functions above (a conv's dst_block says out's
// layout).
void ConcatConvs(tvm::ffi::PackedArgs args, tvm::ffi::Any* rv) {
  if (args.size() < 3) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: expected (spec, args..., out)";
  const Shape spec = args[0].cast<Shape>();
  TensorView out = args[args.size() - 1].cast<TensorView>();
  CheckTensor(out, 4, "output");
  const int64_t C = out.shape()[1], H = out.shape()[2], W = out.shape()[3];
  if (out.shape()[0] != 1) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: batch must be 1";
  if (spec.size() < 1 || spec.size() % 2 != 1) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: bad spec";
  const int64_t block = spec[0];
  CheckBlock(block);
  float* base = const_cast<float*>(Data(out));
  static const int kArgs[] = {1, 4, 0, 5};  // kind 2: counted from its attrs
  int a = 1;  // next argument
  try {
    std::lock_guard<std::mutex> lock(Mutex());
    for (size_t m = 1; m + 1 < spec.size(); m += 2) {
      const int64_t kind = spec[m], offset = spec[m + 1];
      if (kind < 0 || kind > 3) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: unknown member kind " << kind;
      auto t = [&](int i) { return args[a + i].cast<TensorView>(); };
      // kind 2: its attrs (the first Shape) says how many input pieces it has
      const int n = kind == 2 ? PreAttrsAt(args, a, "layerfuse.onednn.concat_convs") - a + 1 : kArgs[kind];
      if (a + n > args.size() - 1) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: spec does not match the arguments";
      const int64_t Cj = kind == 0 ? t(0).shape()[1] : t(kind == 2 ? n - 3 : 1).shape()[0];
      if (offset < 0 || offset + Cj > C || (block && (offset % block || Cj % block)))
        TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: piece does not fit the output";
      View view{base + offset * H * W, dims{1, Cj, H, W}};
      if (kind == 0) {
        TensorView x = t(0);
        CheckTensor(x, 4, "input");
        if (x.numel() != view.numel()) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: copy shape mismatch";
        std::memcpy(view.data, Data(x), sizeof(float) * x.numel());
      } else if (kind == 1) {
        RunLocked(Input{{t(0)}}, t(1), t(2), nullptr, args[a + 3].cast<Shape>(), {view});
      } else if (kind == 2) {
        Input in;
        for (int i = 0; i < n - 5; ++i) in.pieces.push_back(t(i));
        TensorView sc = t(n - 5), sh = t(n - 4);
        in.sc = &sc;
        in.sh = &sh;
        RunLocked(in, t(n - 3), t(n - 2), nullptr, args[a + n - 1].cast<Shape>(), {view});
      } else {
        TensorView r = t(3);
        RunLocked(Input{{t(0)}}, t(1), t(2), &r, args[a + 4].cast<Shape>(), {view});
      }
      a += n;
    }
  } catch (const dnnl::error& e) {
    TVM_FFI_THROW(RuntimeError) << "layerfuse.onednn: oneDNN failed: " << e.what();
  }
  if (a != args.size() - 1) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: unused arguments";
}

// out = pool(x): max or average, in nChwBc or NCHW (see the header).
struct Pool {
  dnnl::pooling_forward::primitive_desc pd;
  dnnl::pooling_forward prim;
};

dnnl::pooling_forward::primitive_desc PoolDesc(const dims& x, const dims& y, const Shape& a) {
  if (a.size() != 10) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.pool2d: attrs must have 10 entries, got " << a.size();
  static const dnnl::algorithm algs[] = {dnnl::algorithm::pooling_max, dnnl::algorithm::pooling_avg_include_padding,
                                         dnnl::algorithm::pooling_avg_exclude_padding};
  if (a[0] < 0 || a[0] > 2) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.pool2d: unknown algorithm " << a[0];
  const int64_t kh = a[1], kw = a[2], sh = a[3], sw = a[4], pt = a[5], pl = a[6];
  // the bottom/right padding: the stated one, or more where out's size needs it (ceil_mode)
  const int64_t pb = std::max(a[7], (y[2] - 1) * sh + kh - x[2] - pt);
  const int64_t pr = std::max(a[8], (y[3] - 1) * sw + kw - x[3] - pl);
  if ((x[2] + pt + pb - kh) / sh + 1 != y[2] || (x[3] + pl + pr - kw) / sw + 1 != y[3] || x[0] != y[0] || x[1] != y[1])
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.pool2d: output shape does not match the pool";
  const tag t = a[9] ? Blocked(a[9]) : tag::nchw;
  dnnl::memory::desc src(x, dt::f32, t), dst(y, dt::f32, t);
  dnnl::pooling_forward::desc d(dnnl::prop_kind::forward_inference, algs[a[0]], src, dst, {sh, sw}, {kh, kw}, {pt, pl},
                                {pb, pr});
  return dnnl::pooling_forward::primitive_desc(d, Engine());
}

void Pool2d(TensorView x, Shape attrs, TensorView out) {
  CheckTensor(x, 4, "input");
  CheckTensor(out, 4, "output");
  try {
    std::lock_guard<std::mutex> lock(Mutex());
    static auto* pools = new std::unordered_map<std::string, std::unique_ptr<Pool>>();
    std::ostringstream key;
    for (int i = 0; i < 4; ++i) key << x.shape()[i] << ',' << out.shape()[i] << ';';
    for (int64_t v : attrs) key << v << ';';
    auto it = pools->find(key.str());
    if (it == pools->end()) {
      auto pool = std::make_unique<Pool>();
      pool->pd = PoolDesc(Dims(x.shape().data(), 4), Dims(out.shape().data(), 4), attrs);
      pool->prim = dnnl::pooling_forward(pool->pd);
      it = pools->emplace(key.str(), std::move(pool)).first;
    }
    const Pool& pool = *it->second;
    dnnl::stream s(Engine());
    dnnl::memory src(pool.pd.src_desc(), Engine(), const_cast<float*>(Data(x)));
    dnnl::memory dst(pool.pd.dst_desc(), Engine(), const_cast<float*>(Data(out)));
    pool.prim.execute(s, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}});
    s.wait();
  } catch (const dnnl::error& e) {
    TVM_FFI_THROW(RuntimeError) << "layerfuse.onednn: oneDNN failed: " << e.what();
  }
}

// out = x @ w + b (the classifier: Gemm / Linear), x [N, K], w [K, M], b [M], out [N, M], as a
// oneDNN matmul primitive made once per shape.
// The weights are reordered once into the layout the primitive prefers (packed for its
// brgemm kernel), checked by fingerprint like a conv's.
dnnl::matmul::primitive_desc DenseDesc(int64_t N, int64_t K, int64_t M) {
  dnnl::memory::desc src({N, K}, dt::f32, tag::ab), wei({K, M}, dt::f32, tag::any), bias({1, M}, dt::f32, tag::ab),
      dst({N, M}, dt::f32, tag::ab);
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, bias, dst), Engine());
}

void Dense(TensorView x, TensorView w, TensorView b, TensorView out) {
  CheckTensor(x, 2, "input");
  CheckTensor(w, 2, "weight");
  CheckTensor(out, 2, "output");
  const int64_t N = x.shape()[0], K = x.shape()[1], M = w.shape()[1];
  if (w.shape()[0] != K || b.numel() != M || out.shape()[0] != N || out.shape()[1] != M)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.dense: shapes do not agree";
  try {
    std::lock_guard<std::mutex> lock(Mutex());
    struct Prim {
      dnnl::matmul::primitive_desc pd;
      dnnl::matmul prim;
      dnnl::memory weights;  // in pd.weights_desc(), owned
      std::vector<float> fingerprint;
    };
    static auto* prims = new std::unordered_map<std::string, std::unique_ptr<Prim>>();
    std::ostringstream key;
    key << N << ',' << K << ',' << M << ':' << static_cast<const void*>(Data(w));
    auto it = prims->find(key.str());
    if (it == prims->end() || it->second->fingerprint != Fingerprint(Data(w), K * M)) {
      auto p = std::make_unique<Prim>();
      p->pd = DenseDesc(N, K, M);
      p->prim = dnnl::matmul(p->pd);
      dnnl::memory user(dnnl::memory::desc({K, M}, dt::f32, tag::ab), Engine(), const_cast<float*>(Data(w)));
      p->weights = dnnl::memory(p->pd.weights_desc(), Engine());
      dnnl::stream s(Engine());
      dnnl::reorder(user, p->weights).execute(s, user, p->weights);
      s.wait();
      p->fingerprint = Fingerprint(Data(w), K * M);
      (*prims)[key.str()] = std::move(p);
      it = prims->find(key.str());
    }
    const Prim& p = *it->second;
    dnnl::stream s(Engine());
    p.prim.execute(s, {{DNNL_ARG_SRC, dnnl::memory(p.pd.src_desc(), Engine(), const_cast<float*>(Data(x)))},
                       {DNNL_ARG_WEIGHTS, p.weights},
                       {DNNL_ARG_BIAS, dnnl::memory(p.pd.bias_desc(), Engine(), const_cast<float*>(Data(b)))},
                       {DNNL_ARG_DST, dnnl::memory(p.pd.dst_desc(), Engine(), const_cast<float*>(Data(out)))}});
    s.wait();
  } catch (const dnnl::error& e) {
    TVM_FFI_THROW(RuntimeError) << "layerfuse.onednn: oneDNN failed: " << e.what();
  }
}

String DenseImplementation(Shape shape) {
  if (shape.size() != 3) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: (N, K, M) expected";
  try {
    return String(DenseDesc(shape[0], shape[1], shape[2]).impl_info_str());
  } catch (const dnnl::error& e) {
    return String(std::string("unsupported: ") + e.what());
  }
}

String PoolImplementation(Shape x, Shape y, Shape attrs) {
  if (x.size() != 4 || y.size() != 4) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: 4-d shapes expected";
  try {
    return String(PoolDesc(Dims(x.data(), 4), Dims(y.data(), 4), attrs).impl_info_str());
  } catch (const dnnl::error& e) {
    return String(std::string("unsupported: ") + e.what());
  }
}


// out (nChwBc bytes, [N, C, H, W] type) = x (NCHW), attrs = (B): one reorder for a plain tensor
// that several oneDNN layers read, instead of one inside each of them.
void ToBlocked(TensorView x, Shape attrs, TensorView out) {
  CheckTensor(x, 4, "input");
  CheckTensor(out, 4, "output");
  if (attrs.size() != 1 || attrs[0] == 0) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.to_blocked: attrs must be (block,)";
  const int64_t block = attrs[0];
  const tag blocked_tag = Blocked(block);
  if (x.shape()[1] % block != 0)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.to_blocked: channels % " << block << " != 0";
  try {
    std::lock_guard<std::mutex> lock(Mutex());
    static auto* reorders = new std::unordered_map<std::string, dnnl::reorder>();
    dims d = Dims(x.shape().data(), 4);
    dnnl::memory::desc plain(d, dt::f32, tag::nchw), blocked(d, dt::f32, blocked_tag);
    std::ostringstream key;
    for (auto v : d) key << v << ',';
    key << block;
    auto it = reorders->find(key.str());
    if (it == reorders->end()) {
      it = reorders->emplace(key.str(), dnnl::reorder(dnnl::memory(plain, Engine(), nullptr),
                                                      dnnl::memory(blocked, Engine(), nullptr))).first;
    }
    dnnl::stream s(Engine());
    dnnl::memory src(plain, Engine(), const_cast<float*>(Data(x)));
    dnnl::memory dst(blocked, Engine(), const_cast<float*>(Data(out)));
    it->second.execute(s, src, dst);
    s.wait();
  } catch (const dnnl::error& e) {
    TVM_FFI_THROW(RuntimeError) << "layerfuse.onednn: oneDNN failed: " << e.what();
  }
}

// out = concat(x_1, ..., x_k) on the channel axis (NCHW, plain): one memcpy per piece and
// image - the concatenation of layers whose producers are library calls (TVM's in-place
// concat only moves TVM kernels' outputs).
void ConcatChannels(tvm::ffi::PackedArgs args, tvm::ffi::Any* rv) {
  const int k = args.size() - 1;
  if (k < 1) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat: no input";
  TensorView out = args[k].cast<TensorView>();
  CheckTensor(out, 4, "output");
  const int64_t N = out.shape()[0], C = out.shape()[1], HW = out.shape()[2] * out.shape()[3];
  char* dst = reinterpret_cast<char*>(const_cast<float*>(Data(out)));
  int64_t offset = 0;  // channels written so far
  for (int i = 0; i < k; ++i) {
    TensorView x = args[i].cast<TensorView>();
    CheckTensor(x, 4, "input");
    const int64_t Ci = x.shape()[1];
    if (x.shape()[0] != N || x.shape()[2] * x.shape()[3] != HW || offset + Ci > C)
      TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat: input " << i << " does not fit the output";
    const char* src = reinterpret_cast<const char*>(Data(x));
    for (int64_t n = 0; n < N; ++n)
      std::memcpy(dst + sizeof(float) * (n * C + offset) * HW, src + sizeof(float) * n * Ci * HW, sizeof(float) * Ci * HW);
    offset += Ci;
  }
  if (offset != C) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat: inputs give " << offset << " channels, not " << C;
}

String Implementation(Shape x, Shape w, Shape attrs, bool residual) {
  if (x.size() != 4 || w.size() != 4) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: 4-d shapes expected";
  try {
    const Attrs at = Attrs::From(attrs);
    auto pd = MakeDesc(Dims(x.data(), 4), Dims(w.data(), 4), at, residual, DstBlock(at.dst_block, 0));
    return String(pd.impl_info_str());
  } catch (const dnnl::error& e) {
    return String(std::string("unsupported: ") + e.what());
  }
}

// The time (ms) of this conv layer on this machine under each of two attrs (e.g. direct and
// Winograd): the fastest of `reps` runs each, the two run in turn (weights, src and residual
// filled with a fixed pattern; weight reorders are not timed). The minimum of interleaved
// runs, because other processes on the machine only ever add time; on one thread, because an
// OpenMP barrier waiting for a thread that another process holds off its core adds whole
// scheduler time slices (8 ms and more on a busy 2-core machine), which would decide the
// choice instead of the kernels. For the tactic choice between algorithms at compile time.
tvm::ffi::Array<double> TimeConv(Shape x, Shape w, Shape attrs_a, Shape attrs_b, bool residual, int64_t reps) {
  if (x.size() != 4 || w.size() != 4) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: 4-d shapes expected";
  try {
    std::lock_guard<std::mutex> lock(Mutex());
    // one thread from before the primitives are made: oneDNN fixes a kernel's thread count then
    struct OneThread {  // restored however this function ends
      int saved = omp_get_max_threads();
      OneThread() { omp_set_num_threads(1); }
      ~OneThread() { omp_set_num_threads(saved); }
    } one_thread;
    struct Timed {
      dnnl::convolution_forward prim;
      std::unordered_map<int, dnnl::memory> args;
      double best = 1e300;
    };
    auto filled = [](const dnnl::memory::desc& md) {
      dnnl::memory m(md, Engine());
      float* p = static_cast<float*>(m.get_data_handle());
      const size_t n = md.get_size() / sizeof(float);
      for (size_t i = 0; i < n; ++i) p[i] = static_cast<float>(static_cast<int>(i * 2654435761u % 2001) - 1000) * 1e-3f;
      return m;
    };
    std::vector<Timed> timed;
    for (const Shape* attrs : {&attrs_a, &attrs_b}) {
      const Attrs at = Attrs::From(*attrs);
      auto pd = MakeDesc(Dims(x.data(), 4), Dims(w.data(), 4), at, residual, DstBlock(at.dst_block, 0));
      timed.push_back(Timed{dnnl::convolution_forward(pd),
                            {{DNNL_ARG_SRC, filled(pd.src_desc())},
                             {DNNL_ARG_WEIGHTS, filled(pd.weights_desc())},
                             {DNNL_ARG_BIAS, filled(pd.bias_desc())},
                             {DNNL_ARG_DST, filled(pd.dst_desc())}}});
    }
    dnnl::stream s(Engine());
    for (int64_t k = -1; k < std::max<int64_t>(reps, 1); ++k) {  // one warm-up run each
      for (Timed& t : timed) {
        const auto t0 = std::chrono::steady_clock::now();
        t.prim.execute(s, t.args);
        s.wait();
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (k >= 0) t.best = std::min(t.best, ms);
      }
    }
    return tvm::ffi::Array<double>{timed[0].best, timed[1].best};
  } catch (const dnnl::error& e) {
    TVM_FFI_THROW(RuntimeError) << "layerfuse.onednn: oneDNN failed: " << e.what();
  }
}

// The block width of oneDNN's optimised kernels on this CPU (see Layouts): its AVX-512
// kernels (avx512_core and up) take nChw16c, its AVX2 / AVX / SSE4.1 ones nChw8c; below
// SSE4.1 there are only reference kernels, and plain layouts are kept.
int64_t BlockWidth() {
  const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
  switch (isa) {
    case dnnl::cpu_isa::sse41:
    case dnnl::cpu_isa::avx:
    case dnnl::cpu_isa::avx2:
    case dnnl::cpu_isa::avx2_vnni:
      return 8;
    case dnnl::cpu_isa::avx512_core:
    case dnnl::cpu_isa::avx512_core_vnni:
    case dnnl::cpu_isa::avx512_core_bf16:
    case dnnl::cpu_isa::avx512_core_amx:
      return 16;
    default:
      return 0;
  }
}

String Version() {
  const dnnl_version_t* v = dnnl_version();
  std::ostringstream os;
  os << v->major << '.' << v->minor << '.' << v->patch;
  return String(os.str());
}

}  // namespace layerfuse_onednn

// Registered with override: a process may load this library from several artifacts (or the
// compiler's build cache and an artifact); the last one loaded serves the calls.
TVM_FFI_STATIC_INIT_BLOCK() {
  using tvm::ffi::Function;
  Function::SetGlobal("layerfuse.onednn.conv2d", Function::FromPacked(layerfuse_onednn::Conv2d), true);
  Function::SetGlobal("layerfuse.onednn.conv2d_pre", Function::FromPacked(layerfuse_onednn::Conv2dPre), true);
  Function::SetGlobal("layerfuse.onednn.concat_convs", Function::FromPacked(layerfuse_onednn::ConcatConvs), true);
  Function::SetGlobal("layerfuse.onednn.pool2d", Function::FromTyped(layerfuse_onednn::Pool2d), true);
  Function::SetGlobal("layerfuse.onednn.dense", Function::FromTyped(layerfuse_onednn::Dense), true);
  Function::SetGlobal("layerfuse.onednn.dense_implementation", Function::FromTyped(layerfuse_onednn::DenseImplementation),
                      true);
  Function::SetGlobal("layerfuse.onednn.pool_implementation", Function::FromTyped(layerfuse_onednn::PoolImplementation),
                      true);
  Function::SetGlobal("layerfuse.onednn.conv2d_add", Function::FromTyped(layerfuse_onednn::Conv2dAdd), true);
  Function::SetGlobal("layerfuse.onednn.conv2d_add_inplace", Function::FromPacked(layerfuse_onednn::Conv2dAddInplace),
                      true);
  Function::SetGlobal("layerfuse.onednn.concat", Function::FromPacked(layerfuse_onednn::ConcatChannels), true);
  Function::SetGlobal("layerfuse.onednn.to_blocked", Function::FromTyped(layerfuse_onednn::ToBlocked), true);
  Function::SetGlobal("layerfuse.onednn.implementation", Function::FromTyped(layerfuse_onednn::Implementation), true);
  Function::SetGlobal("layerfuse.onednn.time_conv", Function::FromTyped(layerfuse_onednn::TimeConv), true);
  Function::SetGlobal("layerfuse.onednn.version", Function::FromTyped(layerfuse_onednn::Version), true);
  Function::SetGlobal("layerfuse.onednn.block_width", Function::FromTyped(layerfuse_onednn::BlockWidth), true);
}
