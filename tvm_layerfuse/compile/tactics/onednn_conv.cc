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
//   x [N, C, H, W], w [O, C/groups, kh, kw] (or packed, see Weights), b [O], r and out
//   [N, O, OH, OW], float32, NCHW.
//   attrs: enum ConvField below (abi.ConvAttrs): strides, paddings (top, left, bottom, right),
//   dilations, groups, act, src_block, dst_block, alpha, beta, algorithm, layer, packed and the
//   weight dims (O, C/groups, kh, kw; packed weights only, see Weights); act: enum
//   Activation (abi.ACTIVATIONS), its post-ops in kActivations: relu (alpha: negative slope,
//   i.e. LeakyRelu), clip [alpha, beta], silu, sigmoid, hardswish, hardsigmoid (alpha * x +
//   beta clipped to [0, 1]), gelu (erf or tanh); alpha and beta are the bits of a float32;
//   src_block is x's block width B (0 plain NCHW, 8 nChw8c, 16 nChw16c, see Layouts),
//   dst_block packs out_j's width in its bits [5j, 5j + 5) (one output: dst_block is its
//   width); algorithm: 0 direct, 1 Winograd (oneDNN's F(4x4, 3x3) or F(2x2, 3x3) kernels:
//   3x3, stride 1, fewer multiplies, chosen per layer by timing at compile time; AVX-512
//   only in oneDNN 2.6), 2 and 3 this library's Winograd kernels (AVX2, output tiles of 2 or
//   4: see Winograd below; where a layer does not fit them, the direct conv runs and
//   `implementation` says so); layer: the
//   layer's id in its module, assigned at compile time. Strides, dilations and groups below 1
//   and block widths other than 0, 8, 16 are refused.
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
// Weights. A compiled model's conv calls pass their weights packed (attrs' `packed` != 0): a
// 1-d tensor, the model's own parameter, holding each piece's weights already in the layout
// its primitive picks on the machine that compiled the model (blocked, e.g. OIhw8i8o, or
// Winograd's opaque layout), one piece after the other (a merged conv's pieces: its row
// ranges), the weight dims in the attrs. The compiler asks this library for those bytes
// (packed_layout, pack_weights: each piece's primitive made exactly as the call makes it).
// A call makes (once, then kept per layer id, piece and shapes) its primitives, checks that
// the identity of their weights layouts (DescId: the fields of each dnnl_memory_desc_t) and
// their size are the recorded ones, and runs on the tensor where it lies: no copy of the
// weights, nothing kept per weight address. Another layout here (another CPU ISA, or a
// thread count whose kernel reads another layout) is refused in one line (CheckPacked), never
// run on bytes it would misread; the compiler packs only calls whose layout is the same for
// every thread count from 1 to kThreadProbe (packed_layout's `varies`), and a kernel on packed
// weights is made for at most kThreadProbe threads (ProbedThreads), so a model runs with any
// thread count.
// Plain weights (w [O, C/groups, kh, kw]: calls made by hand, the compiler's timings) are
// still taken: a primitive is made per (shapes, attributes, weight tensor) and kept with its
// weights reordered once into its layout; a fingerprint of the weight tensor (a few sampled
// values) is compared on every call, so new weights at the same address are reordered again.
//
//   layerfuse.onednn.packed_layout(x_shape, prologue, w_shape, attrs, residual, out_channels)
//       -> [identity, bytes, varies]: the packed weights of that call (attrs with packed 0;
//       x_shape: the conv's input, a prologue's pieces concatenated; out_channels: each
//       output's); varies: 0, or a thread count whose kernels read another layout (ThreadSteady)
//   layerfuse.onednn.pack_weights(x_shape, prologue, w, attrs, residual, out_channels, out)
//       out (1-d float32 of those bytes) = w packed
//
//   layerfuse.onednn.to_blocked  (x, (B,), out)  out = x in nChwBc (see Layouts)
//   layerfuse.onednn.concat      (x_1, ..., x_k, out)   channel concat: per image, piece i is
//       the contiguous range [c_i * H * W, (c_i + C_i) * H * W) of out - in NCHW, and in
//       nChwBc too when every c_i and C_i is a multiple of B (all pieces in one layout)
//   layerfuse.onednn.concat_convs (spec, a_1, ..., a_m, out)   a concat (batch 1) whose pieces
//       are convs (and copies) writing their channel ranges of out directly (see ConcatConvs;
//       spec: abi.ConcatSpec, each member with its kind, offset and argument count)
//   layerfuse.onednn.shuffle     (a, b, attrs, out)   out = channels [first, first + length) of
//       the two-group channel shuffle of concat(a, b) (ShuffleNet: channel 2i is a's i, 2i + 1
//       b's i; a, b of `channels` each); attrs: enum ShuffleField (abi.ShuffleAttrs): a, b and
//       out each plain or nChwBc (padded where its channels are not whole blocks; out's pad
//       channels are written 0)
//   layerfuse.onednn.se_gate     (x, w1, b1, w2, b2, attrs, out)   out = the squeeze-and-excitation
//       gate of x: act2(w2 act1(w1 mean_hw(x) + b1) + b2) per image, w1 [S, C, 1, 1], w2 [C, S, 1, 1]
//       plain; attrs: enum SeGateField (abi.SeGateAttrs: x's and out's block widths, the two
//       activations' codes, alpha and beta bits); out [N, C, 1, 1], or padded nChwBc (see SeGate)
//   layerfuse.onednn.dense       (x, w, b, attrs, out)     out = x @ w + b: x [N, K], w [K, M], b [M]
//       attrs: enum DenseField (abi.DenseAttrs: packed, K, M): packed 0, w plain [K, M]; else w
//       comes packed (1-d) in the layout of the identity `packed`, as a conv's (see Weights)
//   layerfuse.onednn.dense_packed_layout((N, K, M)) -> [identity, bytes, varies]
//   layerfuse.onednn.dense_pack_weights((N, K, M), w, out)   out = w [K, M] packed
//   layerfuse.onednn.pool2d      (x, attrs, out)
//       attrs: enum PoolField (abi.PoolAttrs: alg, kernel, strides, paddings, block); alg: 0 max,
//       1 average counting the padding, 2 average over the input
//       elements only; out's size decides the right/bottom padding oneDNN adds (ceil_mode);
//       x and out both in nChwBc when block = B != 0, else both NCHW
//   layerfuse.onednn.scale_channels (x, g, attrs, out)   out = x * g: x, out [N, C, H, W], g
//       [N, C, 1, 1] (a squeeze-and-excitation gate, broadcast over H, W); attrs: enum
//       ScaleField (abi.ScaleAttrs: block): x and out both in nChwBc when block = B != 0
//       (C % B == 0: g has the same bytes in both layouts), else both NCHW; blocked, x and out
//       may be padded nChwBc of Cg channels (C = ceilB(Cg), g [N, Cg, 1, 1]; the pad channels
//       of out are written 0)
//
//   layerfuse.onednn.implementation(x_shape, w_shape, attrs, residual) -> str
//       the implementation oneDNN picks for that layer on this machine (impl_info_str), e.g.
//       "jit:avx512_core" or "jit_1x1:avx2"; the compiler refuses "ref:" kernels.
//   layerfuse.onednn.block_width() -> int   B for this CPU: 16 where oneDNN runs its AVX-512
//       kernels (avx512_core), 8 with AVX2 / AVX / SSE4.1, 0 (plain layouts only) below
//   layerfuse.onednn.time_conv(x_shape, w_shape, attrs_a, attrs_b, residual, reps, threads)
//       -> [ms_a, ms_b]   that layer's time here under two attrs on `threads` OpenMP threads,
//       fastest of reps interleaved runs each (for the algorithm choice)
//   layerfuse.onednn.pool_implementation(x_shape, out_shape, attrs) -> str   the same, pools
//   layerfuse.onednn.share_pool(library_path) -> bool
//       the parallel loops of a loaded TVM library (its __TVMBackendParallelLaunch slot) run on
//       this library's OpenMP threads instead of TVM's own pool; false where the library has
//       no such slot or needs TVM's parallel barrier

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <oneapi/dnnl/dnnl.hpp>
#include <dlfcn.h>
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <atomic>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

// Everything below has internal linkage (an anonymous namespace; the library is also built with
// -fvisibility=hidden): two copies of this library in one process - the compiler's and an
// artifact's, or two artifacts' - never bind to each other's code or caches. What a process
// sees of a copy is only the global functions it registers (the last copy loaded serves them;
// the loader refuses a copy of another abi_version, see runtime/tactics.py).
namespace layerfuse_onednn {
namespace {

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

// The calling contract (tvm_layerfuse/compile/tactics/abi.py): the field order of each record
// below is that of its Python dataclass, checked by tests/test_tactics_abi.py. Change both
// together and raise kAbiVersion with abi.ABI_VERSION.
constexpr int64_t kAbiVersion = 9;

// ConvAttrs: a conv's attrs
enum ConvField : int {
  kStrideH, kStrideW, kPadTop, kPadLeft, kPadBottom, kPadRight, kDilationH, kDilationW, kGroups, kAct,
  kSrcBlock, kDstBlock, kAlphaBits, kBetaBits, kAlgorithm, kLayer, kPacked, kWeightO, kWeightI, kWeightKh, kWeightKw,
  kConvFieldCount
};
// PoolAttrs: a pool's attrs
enum PoolField : int {
  kAlg, kKernelH, kKernelW, kPoolStrideH, kPoolStrideW, kPoolPadTop, kPoolPadLeft, kPoolPadBottom, kPoolPadRight,
  kPoolBlock, kPoolFieldCount
};
// ToBlockedAttrs: to_blocked's attrs
enum ToBlockedField : int { kBlock, kToBlockedFieldCount };
// ScaleAttrs: scale_channels' attrs
enum ScaleField : int { kScaleBlock, kScaleFieldCount };
// DenseAttrs: dense's attrs
enum DenseField : int { kDensePacked, kDenseK, kDenseM, kDenseFieldCount };
// SeGateAttrs: se_gate's attrs
enum SeGateField : int {
  kSeBlock, kSeDstBlock, kSeSqueezeAct, kSeSqueezeAlphaBits, kSeSqueezeBetaBits, kSeGateAct, kSeGateAlphaBits,
  kSeGateBetaBits, kSeFieldCount
};
// ShuffleAttrs: shuffle's attrs
enum ShuffleField : int {
  kShuffleChannels, kShuffleFirst, kShuffleLength, kShuffleLeftBlock, kShuffleRightBlock, kShuffleDstBlock, kShuffleFieldCount
};
// ConcatSpec: (block, then per member these fields)
enum MemberField : int { kKind, kOffset, kNargs, kMemberFieldCount };
// the arguments of conv2d (abi.CONV2D.roles; its outputs follow) and of conv2d_add_inplace
// (abi.CONV2D_ADD_INPLACE.roles; the attrs follow as integers)
enum Conv2dArg : int { kConv2dInput, kConv2dWeight, kConv2dBias, kConv2dAttrs, kConv2dArgCount };
enum Conv2dAddInplaceArg : int { kInplaceInput, kInplaceWeight, kInplaceBias, kInplaceResidual, kInplaceArgCount };
// ACTIVATIONS: the activation codes; their post-ops are kActivations below, in this order
enum Activation : int {
  kNone, kRelu, kClip, kSilu, kSigmoid, kHardswish, kHardsigmoid, kGeluErf, kGeluTanh, kActivationCount
};

// The block width of a blocked layout: 8 (nChw8c) or 16 (nChw16c); 0 is plain NCHW.
void CheckBlock(int64_t block) {
  if (block != 0 && block != 8 && block != 16)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn: block width must be 0, 8 or 16, got " << block;
}

tag Blocked(int64_t block) {
  CheckBlock(block);
  return block == 16 ? tag::nChw16c : tag::nChw8c;
}

// out_j's block width from a conv's dst_block (abi.DST_BLOCK_BITS = 5 bits per output)
int64_t DstBlock(int64_t dst_block, size_t j) {
  const int64_t block = j < 12 ? (dst_block >> (5 * j)) & 31 : 0;
  CheckBlock(block);
  return block;
}

struct Attrs {
  int64_t stride[2], pad_l[2], pad_r[2], dilation[2], groups, act, src_block, dst_block;
  float alpha, beta;
  int64_t algorithm;  // 0 direct, 1 oneDNN's Winograd, 2 / 3 this library's (tiles of 2 / 4: see Winograd)
  int64_t layer;      // the layer's id in its module
  int64_t packed;     // 0: the weight tensor is plain OIHW; else the identity of its packed layout (PackedId)
  dims wdims;         // packed: the weights' [O, C/groups, kh, kw] (the tensor is their packed bytes)
  static Attrs From(const Shape& a) {
    if (a.size() != kConvFieldCount)
      TVM_FFI_THROW(ValueError) << "layerfuse.onednn: attrs must have " << kConvFieldCount << " entries, got " << a.size();
    if (a[kAlgorithm] < 0 || a[kAlgorithm] > 3)
      TVM_FFI_THROW(ValueError) << "layerfuse.onednn: unknown conv algorithm " << a[kAlgorithm];
    if (a[kAct] < 0 || a[kAct] >= kActivationCount)
      TVM_FFI_THROW(ValueError) << "layerfuse.onednn: unknown activation code " << a[kAct];
    for (int f : {kStrideH, kStrideW, kDilationH, kDilationW, kGroups})
      if (a[f] < 1) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: conv attrs need strides, dilations and groups >= 1";
    for (int f : {kPadTop, kPadLeft, kPadBottom, kPadRight, kLayer})
      if (a[f] < 0) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: conv attrs need paddings and a layer id >= 0";
    CheckBlock(a[kSrcBlock]);
    if (a[kPacked] < 0) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: conv attrs' packed identity must be >= 0";
    dims wdims;
    if (a[kPacked]) {
      wdims = {a[kWeightO], a[kWeightI], a[kWeightKh], a[kWeightKw]};
      for (int64_t d : wdims)
        if (d < 1) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: packed conv attrs need weight dims >= 1";
    }
    return Attrs{{a[kStrideH], a[kStrideW]}, {a[kPadTop], a[kPadLeft]}, {a[kPadBottom], a[kPadRight]},
                 {a[kDilationH], a[kDilationW]}, a[kGroups], a[kAct], a[kSrcBlock], a[kDstBlock],
                 FloatBits(a[kAlphaBits]), FloatBits(a[kBetaBits]), a[kAlgorithm], a[kLayer], a[kPacked], wdims};
  }
};

// The post-ops of each activation (index: its code). alpha and beta: the attrs' values where
// `use` says so, else the fixed ones given. A second eltwise (hardsigmoid: linear, then clip
// to [0, 1]) follows where `then` is set.
struct PostOp {
  bool used;
  dnnl::algorithm alg;
  bool attrs_alpha, attrs_beta;  // take alpha / beta from the attrs
  float alpha, beta;
  bool then;
  dnnl::algorithm then_alg;
  float then_alpha, then_beta;
};
const PostOp kActivations[kActivationCount] = {
    /* kNone        */ {false, dnnl::algorithm::eltwise_relu, false, false, 0.f, 0.f, false, dnnl::algorithm::eltwise_relu, 0.f, 0.f},
    /* kRelu        */ {true, dnnl::algorithm::eltwise_relu, true, false, 0.f, 0.f, false, dnnl::algorithm::eltwise_relu, 0.f, 0.f},
    /* kClip        */ {true, dnnl::algorithm::eltwise_clip, true, true, 0.f, 0.f, false, dnnl::algorithm::eltwise_relu, 0.f, 0.f},
    /* kSilu        */ {true, dnnl::algorithm::eltwise_swish, false, false, 1.f, 0.f, false, dnnl::algorithm::eltwise_relu, 0.f, 0.f},
    /* kSigmoid     */ {true, dnnl::algorithm::eltwise_logistic, false, false, 0.f, 0.f, false, dnnl::algorithm::eltwise_relu, 0.f, 0.f},
    /* kHardswish   */ {true, dnnl::algorithm::eltwise_hardswish, false, false, 0.f, 0.f, false, dnnl::algorithm::eltwise_relu, 0.f, 0.f},
    /* kHardsigmoid */ {true, dnnl::algorithm::eltwise_linear, true, true, 0.f, 0.f, true, dnnl::algorithm::eltwise_clip, 0.f, 1.f},
    /* kGeluErf     */ {true, dnnl::algorithm::eltwise_gelu_erf, false, false, 0.f, 0.f, false, dnnl::algorithm::eltwise_relu, 0.f, 0.f},
    /* kGeluTanh    */ {true, dnnl::algorithm::eltwise_gelu_tanh, false, false, 0.f, 0.f, false, dnnl::algorithm::eltwise_relu, 0.f, 0.f},
};

// The activations this library applies itself, in a pass over the conv's output once the
// primitive has run (sum post-op included), instead of as oneDNN's post-op: SiLU (SiluInPlace).
// Measured on an AVX-512 machine, one thread, nChw16c: oneDNN 2.6's swish post-op adds
// 0.3-0.5 ns per output element to jit_1x1 and jit_dw (a 1x1 conv 16 -> 96 on 112x112: 0.20 ms
// without it, 0.60 ms with it; a 3x3 depthwise conv of 144 channels on 56x56: 0.08 against
// 0.32 ms), this pass 0.20 ns; relu, clip and hardswish post-ops add under 0.05 ns and stay
// oneDNN's.
bool OwnActivation(int64_t act) { return act == kSilu; }
constexpr const char* kOwnSiluSuffix = "+silu:layerfuse";  // `implementation` names it (abi.OWN_SILU_SUFFIX)

void AppendActivation(dnnl::post_ops& ops, const Attrs& at) {
  if (at.act < 0 || at.act >= kActivationCount) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: unknown activation code " << at.act;
  const PostOp& p = kActivations[at.act];
  if (!p.used) return;
  ops.append_eltwise(1.f, p.alg, p.attrs_alpha ? at.alpha : p.alpha, p.attrs_beta ? at.beta : p.beta);
  if (p.then) ops.append_eltwise(1.f, p.then_alg, p.then_alpha, p.then_beta);
}

// The engine and the caches live until the process ends and are never destroyed: static
// destructors at exit would otherwise free primitives after the engine (or oneDNN) is gone.
dnnl::engine& Engine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

// Threads. Several threads (or several VMs, or several modules) call this library at once, with
// no process-wide lock on the way: the primitives and the reordered weights of a layer are made
// once and shared read-only (oneDNN primitives execute concurrently), found in a cache under a
// reader lock; what a call writes besides its outputs - the stream, the scratchpad (every
// primitive runs with scratchpad_mode::user), the reorder buffers of plain src/dst, the
// prologue's scratch and the memory objects a layer's call points at its tensors (ThreadBuffers)
// - belongs to the calling thread.
dnnl::stream& Stream() {
  thread_local dnnl::stream* stream = new dnnl::stream(Engine());
  return *stream;
}

dnnl::primitive_attr UserScratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

// The calling thread's scratchpad for a primitive whose scratchpad is `md` (grown as needed;
// valid until the thread's next call of Scratchpad).
void* ScratchpadData(size_t n) {
  thread_local std::vector<char>* buf = new std::vector<char>();
  if (buf->size() < n + 64) buf->resize(n + 64);
  char* p = buf->data();
  p += (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
  return p;
}

dnnl::memory Scratchpad(const dnnl::memory::desc& md) { return dnnl::memory(md, Engine(), ScratchpadData(md.get_size())); }

void Execute(const dnnl::primitive& prim, const dnnl::memory::desc& scratchpad, std::unordered_map<int, dnnl::memory> args) {
  if (scratchpad.get_size() > 0) args[DNNL_ARG_SCRATCHPAD] = Scratchpad(scratchpad);
  prim.execute(Stream(), args);
}

// A reorder from `a` to `b` (descs), with a user scratchpad.
struct Reorder {
  dnnl::reorder::primitive_desc pd;
  dnnl::reorder prim;
  Reorder() = default;
  Reorder(const dnnl::memory::desc& a, const dnnl::memory::desc& b)
      : pd(Engine(), a, Engine(), b, UserScratchpad()), prim(pd) {}
  void operator()(void* from, void* to) const {
    Execute(prim, pd.scratchpad_desc(),
            {{DNNL_ARG_FROM, dnnl::memory(pd.src_desc(), Engine(), from)}, {DNNL_ARG_TO, dnnl::memory(pd.dst_desc(), Engine(), to)}});
  }
};

dims Dims(const int64_t* d, int n) { return dims(d, d + n); }

// `n` OpenMP threads for the calling thread while this lives (restored however the scope
// ends): a oneDNN kernel made meanwhile fixes n as its thread count.
struct Threads {
  int saved = omp_get_max_threads();
  explicit Threads(int n) { omp_set_num_threads(n); }
  ~Threads() { omp_set_num_threads(saved); }
};

// oneDNN 2.6's primitive cache does not tell kernels made for different thread counts apart:
// a kernel made for n threads would be handed to a later caller at another count, whose team
// then writes beyond the scratchpad sized for n (brgconv kernels on Zen 5, after the
// compiler's 1-thread timings: std::bad_alloc, wrong answers). So whoever makes kernels at
// another count than its caller's empties the cache afterwards (this library keeps its own
// kernels; the cache only spares making identical ones). Descriptors alone are not cached.
void ForgetCachedKernels() {
  const int capacity = dnnl::get_primitive_cache_capacity();
  dnnl::set_primitive_cache_capacity(0);
  dnnl::set_primitive_cache_capacity(capacity);
}
struct OneThread : Threads {
  OneThread() : Threads(1) {}
};

// The thread counts over which a packed weights layout must hold (ThreadSteady): oneDNN 2.6
// picks a kernel's weights layout by the thread count it is made for (its Winograd
// blocking, 1x1 kernels' loop order, Winograd 2x3 or 4x3), so weights packed at one count
// may not be the layout another count's kernel reads.
constexpr int kThreadProbe = 64;

// A kernel that reads packed weights is made for at most kThreadProbe threads, the counts
// over which the compiler found their layout steady: with more it is made and runs on
// kThreadProbe (a kernel runs on the thread count it was made for, see Threads).
struct ProbedThreads {
  std::optional<Threads> t;
  explicit ProbedThreads(bool packed) {
    if (packed && omp_get_max_threads() > kThreadProbe) t.emplace(kThreadProbe);
  }
  bool capped() const { return t.has_value(); }  // kernels made now are for fewer threads than the caller's
};

// 0 when `layout_id()` made for n threads is `here` (its id for the calling thread's count)
// for every n in 1..kThreadProbe; else the first count whose id differs.
template <typename Id, typename F>
int64_t ThreadSteady(Id here, F layout_id) {
  for (int n = 1; n <= kThreadProbe; ++n) {
    Threads t(n);
    if (layout_id() != here) return n;
  }
  return 0;
}

// c rounded up to a multiple of block
int64_t RoundUp(int64_t c, int64_t block) { return (c + block - 1) / block * block; }

// Winograd. oneDNN 2.6 has Winograd kernels for 3x3 on AVX-512 only; a stride-1 conv may run
// this library's Winograd kernel instead (algorithm 2: output tiles of 2 along each axis the
// kernel spans, 3: 4x4 tiles, 3x3 only), chosen per layer by timing at compile time as
// oneDNN's is: on AVX2 for any of its kernel shapes, on AVX-512 for those oneDNN has no
// Winograd for (5x5, 1x7, 7x1, 1x3, 3x1). Along one axis, F(m, r) makes m outputs of an r-tap
// filter g from a = m + r - 1 inputs d with a multiplies instead of m r:
//   y = AT [ (G g) .* (BT d) ]        (AT: m x a, G: a x r, BT: a x a; Cook-Toom, points
//                                      0, 1, -1, 2, -2, 1/2, -1/2 as many as needed, and oo)
// and a 2-d kernel nests two of them, F(mh x mw, rh x rw): per tile (an ah x aw input patch d)
//   y = ATh [ (Gh g Gw^T) .* (BTh d BTw^T) ] ATw^T
// Summed over input channels, each of the ah aw positions xi of the transformed tile is a
// matrix product: M[xi] (tiles x K) = V[xi] (tiles x C) U[xi] (C x K). The forms: F(2x2, 3x3)
// (16 multiplies per 4 outputs instead of 36), F(4x4, 3x3) (36 per 16 instead of 144),
// F(2x2, 5x5), and the 1-d F(2, 7) and F(2, 3) of 1x7 / 7x1 and 1x3 / 3x1 convs (Inception's).
// Activations are nChwBc with B one vector of the ISA the kernel is compiled for (the same code
// twice, onednn_winograd.inc): nChw8c with AVX2, nChw16c with AVX-512. Each task - up to
// kWinoTiles tiles times a panel of 2B output channels - forms its products (a 6 x 16
// register-blocked kernel with AVX2, 12 x 32 with AVX-512) and transforms them back into y with
// the bias, the residual (y's bytes before the call: the sum post-op) and the activation; the
// input transform of its tiles runs in the task (large images) or for all tiles first (small
// ones, see RunWinograd). A conv fits where C and K are multiples of B, groups, strides and
// dilations are 1, src and dst are nChwBc or plain (reordered as for any primitive; both plain:
// B is the widest this CPU runs), the activation is none, relu or clip, and the CPU has the ISA
// (AVX2 and FMA; AVX-512F). Its weights U [ah aw][K/2B][C][2B] (zero past K) are packed like a
// primitive's (WinoPack): ah aw C K floats (K rounded up to 2B).
constexpr int64_t kWinoTiles = 48;  // tiles per task (a multiple of both products' rows)

// One axis: F(m, r) (the matrices verified exact in rational arithmetic)
struct AxisF1 {  // no filter along this axis (a 1-d kernel's other axis)
  static constexpr int m = 1, r = 1, a = 1;
  static constexpr float AT[1][1] = {{1.f}}, G[1][1] = {{1.f}}, BT[1][1] = {{1.f}};
};
struct AxisF23 {
  static constexpr int m = 2, r = 3, a = 4;
  static constexpr float AT[m][a] = {{1.f, 1.f, 1.f, 0.f}, {0.f, 1.f, -1.f, 1.f}};
  static constexpr float G[a][r] = {{-1.f, 0.f, 0.f}, {.5f, .5f, .5f}, {.5f, -.5f, .5f}, {0.f, 0.f, 1.f}};
  static constexpr float BT[a][a] = {{-1.f, 0.f, 1.f, 0.f}, {0.f, 1.f, 1.f, 0.f}, {0.f, -1.f, 1.f, 0.f}, {0.f, -1.f, 0.f, 1.f}};
};
struct AxisF43 {
  static constexpr int m = 4, r = 3, a = 6;
  static constexpr float AT[m][a] = {
      {1.f, 1.f, 1.f, 1.f, 1.f, 0.f}, {0.f, 1.f, -1.f, 2.f, -2.f, 0.f}, {0.f, 1.f, 1.f, 4.f, 4.f, 0.f}, {0.f, 1.f, -1.f, 8.f, -8.f, 1.f}};
  static constexpr float G[a][r] = {{1.f / 4, 0.f, 0.f},           {-1.f / 6, -1.f / 6, -1.f / 6}, {-1.f / 6, 1.f / 6, -1.f / 6},
                                    {1.f / 24, 1.f / 12, 1.f / 6}, {1.f / 24, -1.f / 12, 1.f / 6}, {0.f, 0.f, 1.f}};
  static constexpr float BT[a][a] = {{4.f, 0.f, -5.f, 0.f, 1.f, 0.f},  {0.f, -4.f, -4.f, 1.f, 1.f, 0.f}, {0.f, 4.f, -4.f, -1.f, 1.f, 0.f},
                                     {0.f, -2.f, -1.f, 2.f, 1.f, 0.f}, {0.f, 2.f, -1.f, -2.f, 1.f, 0.f}, {0.f, 4.f, 0.f, -5.f, 0.f, 1.f}};
};
struct AxisF25 {
  static constexpr int m = 2, r = 5, a = 6;
  static constexpr float AT[m][a] = {{1.f, 1.f, 1.f, 1.f, 1.f, 0.f}, {0.f, 1.f, -1.f, 2.f, -2.f, 1.f}};
  static constexpr float G[a][r] = {{1.f / 4, 0.f, 0.f, 0.f, 0.f},
                                    {-1.f / 6, -1.f / 6, -1.f / 6, -1.f / 6, -1.f / 6},
                                    {-1.f / 6, 1.f / 6, -1.f / 6, 1.f / 6, -1.f / 6},
                                    {1.f / 24, 1.f / 12, 1.f / 6, 1.f / 3, 2.f / 3},
                                    {1.f / 24, -1.f / 12, 1.f / 6, -1.f / 3, 2.f / 3},
                                    {0.f, 0.f, 0.f, 0.f, 1.f}};
  static constexpr const float (&BT)[a][a] = AxisF43::BT;  // the same points
};
struct AxisF27 {
  static constexpr int m = 2, r = 7, a = 8;
  static constexpr float AT[m][a] = {{1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 0.f}, {0.f, 1.f, -1.f, 2.f, -2.f, .5f, -.5f, 1.f}};
  static constexpr float G[a][r] = {{-1.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f},
                                    {-2.f / 9, -2.f / 9, -2.f / 9, -2.f / 9, -2.f / 9, -2.f / 9, -2.f / 9},
                                    {-2.f / 9, 2.f / 9, -2.f / 9, 2.f / 9, -2.f / 9, 2.f / 9, -2.f / 9},
                                    {1.f / 90, 1.f / 45, 2.f / 45, 4.f / 45, 8.f / 45, 16.f / 45, 32.f / 45},
                                    {1.f / 90, -1.f / 45, 2.f / 45, -4.f / 45, 8.f / 45, -16.f / 45, 32.f / 45},
                                    {32.f / 45, 16.f / 45, 8.f / 45, 4.f / 45, 2.f / 45, 1.f / 45, 1.f / 90},
                                    {32.f / 45, -16.f / 45, 8.f / 45, -4.f / 45, 2.f / 45, -1.f / 45, 1.f / 90},
                                    {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 1.f}};
  static constexpr float BT[a][a] = {{-1.f, 0.f, 21.f / 4, 0.f, -21.f / 4, 0.f, 1.f, 0.f},
                                     {0.f, 1.f, 1.f, -17.f / 4, -17.f / 4, 1.f, 1.f, 0.f},
                                     {0.f, -1.f, 1.f, 17.f / 4, -17.f / 4, -1.f, 1.f, 0.f},
                                     {0.f, .5f, .25f, -2.5f, -1.25f, 2.f, 1.f, 0.f},
                                     {0.f, -.5f, .25f, 2.5f, -1.25f, -2.f, 1.f, 0.f},
                                     {0.f, 2.f, 4.f, -2.5f, -5.f, .5f, 1.f, 0.f},
                                     {0.f, -2.f, 4.f, 2.5f, -5.f, -.5f, 1.f, 0.f},
                                     {0.f, -1.f, 0.f, 21.f / 4, 0.f, -21.f / 4, 0.f, 1.f}};
};

struct Wino;
struct WinoForm {  // one kernel shape's Winograd form and its code for one ISA
  int64_t mh, mw, ah, aw;
  int64_t block, panel;  // the activations' channel block (one vector), output channels per panel of U (two)
  const char* impl;      // what `implementation` reports
  void (*input)(const Wino&, const float*, float*, int64_t, int64_t, int64_t);
  void (*output)(const Wino&, const float*, int64_t, int64_t, int64_t, int64_t, const float*, bool, float*);
  void (*product)(const float*, int64_t, const float*, int64_t, float*, int64_t);
  void (*pack)(const Wino&, const float*, float*);
};

struct Wino {
  const WinoForm* form;
  int64_t N, C, H, W, K, OH, OW, pt, pl;
  int64_t act;
  float alpha, beta;
  int64_t Positions() const { return form->ah * form->aw; }
  int64_t TH() const { return (OH + form->mh - 1) / form->mh; }
  int64_t TW() const { return (OW + form->mw - 1) / form->mw; }
  int64_t T() const { return N * TH() * TW(); }
  int64_t Panels() const { return (K + form->panel - 1) / form->panel; }
  int64_t PackedFloats() const { return Positions() * Panels() * C * form->panel; }
};

// U[xi][K/panel][C][panel] = (Gh g Gw^T)[xi] of plain weights g [K, C, rh, rw] (in double; zero past K)
template <class H, class W>
void WinoPack(const Wino& s, const float* g, float* u) {
  std::memset(u, 0, sizeof(float) * s.PackedFloats());
  const int64_t P = s.Panels(), panel = s.form->panel;
  for (int64_t k = 0; k < s.K; ++k)
    for (int64_t c = 0; c < s.C; ++c) {
      const float* f = g + (k * s.C + c) * H::r * W::r;
      double t[H::a][W::r] = {}, v[H::a][W::a] = {};
      for (int i = 0; i < H::a; ++i)
        for (int j = 0; j < W::r; ++j)
          for (int q = 0; q < H::r; ++q) t[i][j] += double(H::G[i][q]) * f[q * W::r + j];
      for (int i = 0; i < H::a; ++i)
        for (int j = 0; j < W::a; ++j)
          for (int q = 0; q < W::r; ++q) v[i][j] += t[i][q] * double(W::G[j][q]);
      for (int i = 0; i < H::a; ++i)
        for (int j = 0; j < W::a; ++j)
          u[(((i * W::a + j) * P + k / panel) * s.C + c) * panel + k % panel] = static_cast<float>(v[i][j]);
    }
}

// The products and output transform of tiles [t0, t0 + rows) and panel p, from their V rows
// (v: row t0 of position 0; ld: floats between two positions), through m (xi x rows x panel).
void WinoTask(const Wino& s, const float* v, int64_t ld, const float* u, const float* bias, bool residual, float* y,
              int64_t t0, int64_t rows, int64_t p, float* m) {
  const int64_t P = s.Panels(), X = s.Positions(), panel = s.form->panel;
  for (int64_t xi = 0; xi < X; ++xi)
    s.form->product(v + xi * ld, s.C, u + (xi * P + p) * s.C * panel, s.C, m + xi * rows * panel, rows);
  s.form->output(s, m, t0, t0 + rows, p * panel, std::min(panel, s.K - p * panel), bias, residual, y);
}

// y = conv(x, the weights packed in u) + bias [+ y], activated; x, y nChwBc (B: the form's
// block). Where V is the larger operand (more tiles than output channels: large images) and
// there are tiles enough for every thread (two tasks each at least), the tiles are split into
// a multiple of the thread count of equal tasks, and each task transforms its tiles' input and
// runs every panel on them while their V is in cache: U is read once per task. Else (small
// images, where U, the weights, is the larger operand) the input of all tiles is transformed
// first, and tasks are (panel, tiles) pairs, panels outermost: U is read once, each thread
// reading only its own panels (measured in GoogLeNet at one thread: its 14x14 layers, 49 tiles
// in two tasks against 208-320 channels, took twice their time alone when each task read all
// of U, their weights cold from memory in a model).
void RunWinograd(const Wino& s, const float* x, const float* u, const float* bias, bool residual, float* y) {
  const int64_t T = s.T(), P = s.Panels(), X = s.Positions(), threads = omp_get_max_threads();
  int64_t tasks = (T + kWinoTiles - 1) / kWinoTiles;
  const bool by_chunk = tasks >= 2 * threads && T > P * s.form->panel;
  if (by_chunk) tasks = RoundUp(tasks, threads);
  const int64_t rows = (T + tasks - 1) / tasks, chunks = (T + rows - 1) / rows;  // tiles per task (at most kWinoTiles)
  const int64_t ld = by_chunk ? rows * s.C : T * s.C;  // V: one chunk's per thread, or all of it
  float* shared = by_chunk ? nullptr : static_cast<float*>(ScratchpadData(sizeof(float) * X * ld));
#pragma omp parallel
  {
    thread_local std::vector<float> m, own;  // a task's products; by_chunk: its V
    m.resize(X * rows * s.form->panel);
    if (by_chunk) {
      own.resize(X * ld);
#pragma omp for schedule(static)
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t t0 = ch * rows, n = std::min(T, t0 + rows) - t0;
        s.form->input(s, x, own.data(), t0, t0 + n, ld);
        for (int64_t p = 0; p < P; ++p) WinoTask(s, own.data(), ld, u, bias, residual, y, t0, n, p, m.data());
      }
    } else {
#pragma omp for schedule(static)
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t t0 = ch * rows;
        s.form->input(s, x, shared + t0 * s.C, t0, std::min(T, t0 + rows), ld);
      }  // (the barrier here: V is whole)
#pragma omp for schedule(static) collapse(2)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t ch = 0; ch < chunks; ++ch) {
          const int64_t t0 = ch * rows, n = std::min(T, t0 + rows) - t0;
          WinoTask(s, shared + t0 * s.C, ld, u, bias, residual, y, t0, n, p, m.data());
        }
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// The kernels, once per ISA (onednn_winograd.inc): AVX2 with FMA, eight channels a vector and
// 6 x 16 products; AVX-512, sixteen and 12 x 32.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace wino_avx2 {
struct Vec {
  using reg = __m256;
  static constexpr int64_t kLanes = 8;
  static constexpr int kRows = 6;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float a) { return _mm256_set1_ps(a); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg a) { _mm256_storeu_ps(p, a); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg min(reg a, reg b) { return _mm256_min_ps(a, b); }
};
#define LAYERFUSE_WINO_ISA "avx2"
#include "onednn_winograd.inc"
#undef LAYERFUSE_WINO_ISA
}  // namespace wino_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace wino_avx512 {
struct Vec {
  using reg = __m512;
  static constexpr int64_t kLanes = 16;
  static constexpr int kRows = 12;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float a) { return _mm512_set1_ps(a); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg a) { _mm512_storeu_ps(p, a); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg min(reg a, reg b) { return _mm512_min_ps(a, b); }
};
#define LAYERFUSE_WINO_ISA "avx512"
#include "onednn_winograd.inc"
#undef LAYERFUSE_WINO_ISA
}  // namespace wino_avx512
#pragma GCC pop_options

// The form of a kernel kh x kw under algorithm 2 (tiles of 2) or 3 (tiles of 4) for activations
// in blocks of `block` channels (8: AVX2, 16: AVX-512), or null where this CPU lacks the ISA.
const WinoForm* FormOf(int64_t kh, int64_t kw, int64_t algorithm, int64_t block) {
  if (block == 16) return __builtin_cpu_supports("avx512f") ? wino_avx512::FormOf(kh, kw, algorithm) : nullptr;
  if (block == 8) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? wino_avx2::FormOf(kh, kw, algorithm) : nullptr;
  return nullptr;
}

// The block of a layer whose src and dst are both plain: the widest this CPU's kernels take.
int64_t WinoPlainBlock() { return __builtin_cpu_supports("avx512f") ? 16 : 8; }
#else
const WinoForm* FormOf(int64_t, int64_t, int64_t, int64_t) { return nullptr; }
int64_t WinoPlainBlock() { return 0; }
#endif

// The library's Winograd form for conv(x, w, at) with that dst block: its block is the blocked
// side's (src first), or the widest this CPU runs where both sides are plain; null: none here.
const WinoForm* WinoFormFor(const dims& w, const Attrs& at, int64_t dst_block) {
  const int64_t block = at.src_block ? at.src_block : dst_block ? dst_block : WinoPlainBlock();
  return FormOf(w[2], w[3], at.algorithm, block);
}

// The library's Winograd form that conv(x, w, at) fits (see Winograd above), or null: where
// none does, the direct conv runs and `implementation` names that kernel.
const WinoForm* FittingWinoForm(const dims& x, const dims& w, const Attrs& at, int64_t dst_block) {
  const WinoForm* form = WinoFormFor(w, at, dst_block);
  const bool fits = form && x[1] == w[1]                                                                   // a form, groups 1
         && x[2] + at.pad_l[0] + at.pad_r[0] >= w[2] && x[3] + at.pad_l[1] + at.pad_r[1] >= w[3]  // an output
         && at.stride[0] == 1 && at.stride[1] == 1 && at.dilation[0] == 1 && at.dilation[1] == 1 && at.groups == 1
         && x[1] % form->block == 0 && w[0] % form->block == 0  // whole blocks
         && (!at.src_block || at.src_block == form->block) && (!dst_block || dst_block == form->block)
         && (at.act == kNone || at.act == kRelu || at.act == kClip);
  return fits ? form : nullptr;
}

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
  if (!OwnActivation(at.act)) AppendActivation(ops, at);  // else RunRows applies it
  dnnl::primitive_attr attr = UserScratchpad();
  attr.set_post_ops(ops);
  // One pixel per image and channel (the 1x1 convs of a squeeze-and-excitation block, on
  // [N, C, 1, 1]): oneDNN 2.6's kernels split a conv over its output pixels, so this one runs
  // on one thread whatever the team; made for one thread (a kernel's thread count is fixed
  // when its descriptor is made), it runs without a parallel region around it either, as
  // oneDNN calls a one-thread kernel directly. Its weights' layout is the same for any
  // thread count, so packed weights stay valid.
  std::optional<OneThread> one_thread;
  if (OH * OW == 1 && H * W == 1) one_thread.emplace();
  return dnnl::convolution_forward::primitive_desc(d, attr, Engine());
}

std::vector<float> Fingerprint(const float* w, int64_t n) {
  std::vector<float> f;
  for (int k = 0; k < kFingerprint && n > 0; ++k) f.push_back(w[(n - 1) * k / (kFingerprint - 1)]);
  return f;
}

// FNV-1a over the bytes of the values added (keys and identities; not for security).
struct Hasher {
  uint64_t h = 1469598103934665603ull;
  template <typename T>
  void Add(const T& v) {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(&v);
    for (size_t i = 0; i < sizeof(T); ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
};

// A cache key's hash, a 64-bit word at a time (multiply and fold: about a tenth of Hasher's
// byte loop over the same words). For the keys of this process's caches only: never stored
// and never compared across processes, unlike Hasher's identities.
struct KeyHasher {
  uint64_t h = 0x9e3779b97f4a7c15ull;
  void Add(uint64_t v) {
    h = (h ^ v) * 0xff51afd7ed558ccdull;
    h ^= h >> 32;
  }
};

// The identity of a weights layout: the fields of its memory desc (dnnl_memory_desc_t, a plain C
// struct in oneDNN 2.x) that say where each weight lives, read field by field - not the
// struct's bytes, whose padding and unused union members are no part of the layout. Blocked
// layouts (OIhw8i8o ...) and Winograd's opaque one (wino_desc: its format, tile and blocking,
// its size) are covered; a conv's weights have no other kind.
uint64_t DescId(const dnnl::memory::desc& md) {
  const dnnl_memory_desc_t& d = md.data;
  Hasher h;
  h.Add(d.ndims);
  for (int i = 0; i < d.ndims; ++i) h.Add(d.dims[i]), h.Add(d.padded_dims[i]), h.Add(d.padded_offsets[i]);
  h.Add(static_cast<int>(d.data_type));
  h.Add(d.offset0);
  h.Add(static_cast<int>(d.format_kind));
  if (d.format_kind == dnnl_blocked) {
    const dnnl_blocking_desc_t& b = d.format_desc.blocking;
    for (int i = 0; i < d.ndims; ++i) h.Add(b.strides[i]);
    h.Add(b.inner_nblks);
    for (int i = 0; i < b.inner_nblks; ++i) h.Add(b.inner_blks[i]), h.Add(b.inner_idxs[i]);
  } else if (d.format_kind == dnnl_format_kind_wino) {
    const dnnl_wino_desc_t& w = d.format_desc.wino_desc;
    for (int v : {static_cast<int>(w.wino_format), w.r, w.alpha, w.ic, w.oc, w.ic_block, w.oc_block, w.ic2_block, w.oc2_block})
      h.Add(v);
    h.Add(w.adj_scale);
    h.Add(w.size);
  } else {
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn: weights of format kind " << d.format_kind << " have no identity";
  }
  h.Add(d.extra.flags);
  h.Add(d.extra.compensation_mask);
  h.Add(d.extra.scale_adjust);
  h.Add(d.extra.asymm_compensation_mask);
  h.Add(static_cast<uint64_t>(md.get_size()));
  return h.h;
}

// The identity of the hash of the descriptors' ids (never 0: 0 means plain weights).
int64_t PackedIdOf(const Hasher& h) { return static_cast<int64_t>(h.h >> 2) | 1; }

// The packed identity of a call whose pieces' weights have the layouts `ids` (in piece order):
// positive and non-zero, so it fits an attrs entry and 0 can mean "plain".
int64_t PackedId(const std::vector<uint64_t>& ids) {
  Hasher h;
  for (uint64_t id : ids) h.Add(id);
  return PackedIdOf(h);
}

// What runs one conv layer (or one piece of a merged one): a oneDNN primitive, or - algorithms
// 2 and 3, where the layer fits (FittingWinoForm) - this library's Winograd kernel; with the
// layouts of its src, dst and weights, and its weights' identity (DescId, or the Winograd
// packing's). MakeKernel makes it.
struct Kernel {
  std::optional<Wino> wino;
  dnnl::convolution_forward::primitive_desc pd;  // oneDNN's (none for the Winograd kernel)
  dnnl::memory::desc src_md, dst_md, bias_md, weights_md, scratchpad_md;
  uint64_t weights_id = 0;
  std::string impl;  // what `implementation` reports
};

// One conv layer (or one row range of a merged one): immutable once made, shared by every
// thread that runs the layer. Its weights are the call's own tensor, used in place, when the
// call's weights are packed (attrs' `packed`); else (plain OIHW weights: calls made by hand,
// and forms the compiler does not pack) a copy reordered once into the primitive's layout.
struct Layer {
  uint64_t serial;  // unique in the process: the key of each thread's buffers for this layer
  dims x, wdims;    // what it was made for (checked on every call)
  std::vector<int64_t> attrs;
  bool residual;
  int64_t dst_block;
  Kernel kernel;                   // what runs it, its layouts and weights' identity
  dnnl::convolution_forward prim;  // oneDNN's kernel (none where kernel.wino runs it)
  dims dst_dims;                   // kernel.dst_md's, queried once
  size_t weights_size;   // its bytes
  bool packed;           // the weights are the call's (packed) tensor
  dnnl::memory weights;  // plain weights only: in weights_md, owned
  std::vector<float> fingerprint;  // plain weights only
  // plain NCHW <-> the primitive's layout, for a src/dst that is plain in the graph
  dnnl::memory::desc src_plain, dst_plain;
  bool src_reorder = false, dst_reorder = false;
  int64_t src_pixels = 0, dst_pixels = 0;  // a reorder's PixelBlock: that reorder is CopyPixels
  Reorder src_in, dst_in, dst_out;
};

// The layers, found by the layer id the compiler gave the call (attrs' `layer`), the piece of
// the call (a merged conv's row ranges), a hash of what the layer is made for (two modules
// with the same layer ids) and - plain weights only - the address of the rows' weights. What a
// layer was made for is compared on every call; plain weights also by a fingerprint (new
// weights at a reused address are reordered again). Packed layers hold no weights: nothing
// of them depends on which module's tensor a call passes. ReleaseLayers() drops them all.
struct LayerKey {
  int64_t layer;
  const void* weights;  // plain weights: their address; packed: null
  size_t piece;
  uint64_t made_for;
  bool operator==(const LayerKey& o) const {
    return layer == o.layer && weights == o.weights && piece == o.piece && made_for == o.made_for;
  }
};
struct LayerKeyHash {
  size_t operator()(const LayerKey& k) const {
    return ((std::hash<int64_t>()(k.layer) * 31 + std::hash<const void*>()(k.weights)) * 31 + k.piece) * 31 + k.made_for;
  }
};
using LayerMap = std::unordered_map<LayerKey, std::shared_ptr<const Layer>, LayerKeyHash>;

std::shared_mutex& CacheMutex() {
  static std::shared_mutex* mu = new std::shared_mutex();
  return *mu;
}

LayerMap& Layers() {
  static auto* layers = new LayerMap();
  return *layers;
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

// The plain layout of weights [O, C/groups, kh, kw] (oihw; goihw for a grouped conv).
dnnl::memory::desc PlainWeights(const dims& w, int64_t groups) {
  if (groups == 1) return dnnl::memory::desc(w, dt::f32, tag::oihw);
  return dnnl::memory::desc(dims{groups, w[0] / groups, w[1], w[2], w[3]}, dt::f32, tag::goihw);
}

// The rows [o, o + O) of a conv's weights and bias: one piece of a merged conv (or all of it).
struct Rows {
  const float* w;  // [O, C/groups, kh, kw] plain; null where the call's weights are packed
  const float* b;  // [O]
  dims wdims;
};

Kernel MakeKernel(const dims& x, const dims& w, const Attrs& at, bool residual, int64_t dst_block) {
  Kernel k;
  const WinoForm* form = at.algorithm >= 2 ? FittingWinoForm(x, w, at, dst_block) : nullptr;
  if (form) {
    const int64_t OH = x[2] + at.pad_l[0] + at.pad_r[0] - w[2] + 1, OW = x[3] + at.pad_l[1] + at.pad_r[1] - w[3] + 1;
    k.wino = Wino{form, x[0], x[1], x[2], x[3], w[0], OH, OW, at.pad_l[0], at.pad_l[1],
                  at.act, at.alpha, at.beta};
    k.src_md = dnnl::memory::desc(x, dt::f32, Blocked(form->block));
    k.dst_md = dnnl::memory::desc({x[0], w[0], OH, OW}, dt::f32, Blocked(form->block));
    k.bias_md = dnnl::memory::desc({w[0]}, dt::f32, tag::x);
    k.weights_md = dnnl::memory::desc({k.wino->PackedFloats()}, dt::f32, tag::x);
    Hasher h;
    for (int64_t v : {int64_t{0x57696e6f32783233}, k.wino->C, k.wino->K, k.wino->form->panel, k.wino->form->mh, k.wino->form->mw,
                      k.wino->form->ah, k.wino->form->aw})
      h.Add(v);
    k.weights_id = h.h;
    k.impl = k.wino->form->impl;
    return k;
  }
  Attrs direct = at;
  if (direct.algorithm >= 2) direct.algorithm = 0;
  k.pd = MakeDesc(x, w, direct, residual, dst_block);
  k.src_md = k.pd.src_desc();
  k.dst_md = k.pd.dst_desc();
  k.bias_md = k.pd.bias_desc();
  k.weights_md = k.pd.weights_desc();
  k.scratchpad_md = k.pd.scratchpad_desc();
  k.weights_id = DescId(k.weights_md);
  k.impl = k.pd.impl_info_str();
  if (OwnActivation(at.act)) k.impl += kOwnSiluSuffix;
  return k;
}

// out (k.weights_md's bytes) = the plain weights w [O, C/groups, kh, kw] in the kernel's layout
void PackKernel(const Kernel& k, const dims& wdims, int64_t groups, const float* w, void* out) {
  if (k.wino) {
    k.wino->form->pack(*k.wino, w, static_cast<float*>(out));
    return;
  }
  Reorder(PlainWeights(wdims, groups), k.weights_md)(const_cast<float*>(w), out);
  Stream().wait();
}

// A primitive's execute arguments as oneDNN's C call takes them, made once per set of memory
// objects: the C++ execute copies its map into a new vector on every call.
using ExecArgs = std::vector<dnnl_exec_arg_t>;
ExecArgs ExecArgsOf(const std::unordered_map<int, dnnl::memory>& args) {
  ExecArgs c;
  for (const auto& [arg, mem] : args) c.push_back({arg, mem.get()});
  return c;
}

// conv on the memories of args (src, weights, bias, dst; oneDNN's scratchpad where its kernel has
// one) by kernel k on stream s: the library's Winograd kernel once what s has queued (a reorder
// into src) is done, else the primitive prim (queued on s: the caller waits). residual: dst's
// bytes are the residual, added before the activation (oneDNN's sum post-op).
void RunKernel(const Kernel& k, const dnnl::convolution_forward& prim, const ExecArgs& args, bool residual, dnnl::stream& s) {
  if (!k.wino) {
    dnnl::error::wrap_c_api(dnnl_primitive_execute(prim.get(), s.get(), static_cast<int>(args.size()), args.data()),
                            "could not execute a primitive");
    return;
  }
  s.wait();
  auto data = [&args](int arg) {
    for (const dnnl_exec_arg_t& a : args) {
      void* p = nullptr;
      if (a.arg == arg && dnnl_memory_get_data_handle(a.memory, &p) == dnnl_success) return static_cast<float*>(p);
    }
    TVM_FFI_THROW(InternalError) << "layerfuse.onednn: the Winograd kernel has no argument " << arg;
  };
  RunWinograd(*k.wino, data(DNNL_ARG_SRC), data(DNNL_ARG_WEIGHTS), data(DNNL_ARG_BIAS), residual, data(DNNL_ARG_DST));
}

// One pixel per image ([N, C, 1, 1], the 1x1 convs of a squeeze-and-excitation block): in
// nChwBc element (n, c) lies at n * ceilB(C) + c, in NCHW at n * C + c, so the reorder between
// them is a copy of N rows of C floats (CopyPixels), without a primitive's call. B where md is
// such a tensor in nChwBc, else 0.
int64_t PixelBlock(const dnnl::memory::desc& md) {
  const dims d = md.dims();
  if (d.size() != 4 || d[2] * d[3] != 1) return 0;
  for (int64_t block : {8, 16})
    if (md == dnnl::memory::desc(d, dt::f32, Blocked(block))) return block;
  return 0;
}

// rows [N] of C floats from `from` (row stride cf) to `to` (row stride ct); a padded row's
// tail (ct > C) is left as it is: the reorder buffers are zeroed when made (ThreadBuffers)
void CopyPixels(const float* from, int64_t cf, float* to, int64_t ct, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) std::memcpy(to + n * ct, from + n * cf, sizeof(float) * C);
}

std::shared_ptr<const Layer> MakeLayer(const dims& x, const Rows& rows, const Attrs& at, const std::vector<int64_t>& attrs,
                                       bool residual, int64_t dst_block, const std::vector<float>& fingerprint) {
  static std::atomic<uint64_t> serials{0};
  auto layer = std::make_shared<Layer>();
  layer->serial = ++serials;
  layer->x = x;
  layer->wdims = rows.wdims;
  layer->attrs = attrs;
  layer->residual = residual;
  layer->dst_block = dst_block;
  layer->kernel = MakeKernel(x, rows.wdims, at, residual, dst_block);
  const Kernel& k = layer->kernel;
  if (!k.wino) layer->prim = dnnl::convolution_forward(k.pd);
  layer->dst_dims = k.dst_md.dims();
  layer->weights_size = k.weights_md.get_size();
  layer->packed = at.packed != 0;
  if (!layer->packed) {  // plain weights: once, into the layout the kernel takes
    layer->weights = dnnl::memory(k.weights_md, Engine());
    PackKernel(k, rows.wdims, at.groups, rows.w, layer->weights.get_data_handle());
    layer->fingerprint = fingerprint;
  }
  // plain activations: reorders into and out of the primitive's layout (buffers: per thread)
  const dnnl::memory::desc &src_md = k.src_md, &dst_md = k.dst_md;
  layer->src_plain = dnnl::memory::desc(src_md.dims(), dt::f32, tag::nchw);
  layer->dst_plain = dnnl::memory::desc(dst_md.dims(), dt::f32, tag::nchw);
  layer->src_reorder = !at.src_block && src_md != layer->src_plain;
  layer->dst_reorder = !dst_block && dst_md != layer->dst_plain;
  layer->src_pixels = layer->src_reorder ? PixelBlock(src_md) : 0;
  layer->dst_pixels = layer->dst_reorder ? PixelBlock(dst_md) : 0;
  if (layer->src_reorder) layer->src_in = Reorder(layer->src_plain, src_md);
  if (layer->dst_reorder) {
    layer->dst_in = Reorder(layer->dst_plain, dst_md);
    layer->dst_out = Reorder(dst_md, layer->dst_plain);
  }
  return layer;
}

// The layer for piece `piece` of a call (rows.w: its plain weights, or null where the call's
// weights are packed), made under the call's `threads`.
std::shared_ptr<const Layer> Get(const dims& x, const Rows& rows, const Attrs& at, const Shape& attrs, bool residual,
                                 int64_t dst_block, size_t piece, const ProbedThreads& threads) {
  const bool packed = at.packed != 0;
  std::vector<float> fingerprint;  // plain weights only (packed calls allocate nothing here)
  if (!packed) fingerprint = Fingerprint(rows.w, rows.wdims[0] * rows.wdims[1] * rows.wdims[2] * rows.wdims[3]);
  KeyHasher made_for;
  for (int64_t v : x) made_for.Add(v);
  for (int64_t v : rows.wdims) made_for.Add(v);
  for (int64_t v : attrs) made_for.Add(v);
  made_for.Add(residual);
  made_for.Add(dst_block);
  made_for.Add(omp_get_max_threads());  // its kernels' thread count: another count makes its own
  const LayerKey key{at.layer, packed ? nullptr : static_cast<const void*>(rows.w), piece, made_for.h};
  {
    std::shared_lock<std::shared_mutex> lock(CacheMutex());
    auto it = Layers().find(key);
    if (it != Layers().end()) {
      const Layer& l = *it->second;
      if (l.fingerprint == fingerprint && l.x == x && l.wdims == rows.wdims &&
          std::equal(l.attrs.begin(), l.attrs.end(), attrs.begin(), attrs.end()) && l.residual == residual &&
          l.dst_block == dst_block)
        return it->second;
    }
  }
  const std::vector<int64_t> values(attrs.begin(), attrs.end());
  auto layer = MakeLayer(x, rows, at, values, residual, dst_block, fingerprint);  // no lock held while it is made
  if (threads.capped()) ForgetCachedKernels();
  std::unique_lock<std::shared_mutex> lock(CacheMutex());
  Layers()[key] = layer;
  return layer;
}

// Drop every cached layer (and dense layer): their weights are reordered again on first use.
// Layers that a running call holds live until it returns.
void ReleaseDense();
void ReleaseLayers() {
  {
    std::unique_lock<std::shared_mutex> lock(CacheMutex());
    Layers().clear();
  }
  ReleaseDense();
}

// The calling thread's memory objects of a layer, made on its first call in that thread: the
// reorder buffers (plain src / dst in the primitive's layout, owned) and the wrappers of the
// call's tensors and scratchpad, which each call points at its tensors (set_data_handle; on the
// CPU this does what making a memory object on the handle does, without making one), and the
// execute arguments over them. Per thread, never shared: a call only ever writes its own.
// A wrapper's handle is set where it changed, or always where its layout has padding: oneDNN
// 2.x's set_data_handle zeroes the padding (the tensor at that address may have been
// rewritten since, by another kernel) and otherwise only makes and drops an execution context.
struct Wrapper {
  dnnl::memory mem;
  void* at = nullptr;
  bool padded = false;
  Wrapper() = default;
  explicit Wrapper(dnnl::memory m) : mem(std::move(m)) {
    const dnnl_memory_desc_t& d = mem.get_desc().data;
    for (int i = 0; i < d.ndims; ++i) padded = padded || d.padded_dims[i] != d.dims[i] || d.padded_offsets[i] != 0;
    at = mem.get_data_handle();
  }
  void Point(const void* p) {
    if (p == at && !padded) return;
    mem.set_data_handle(const_cast<void*>(p));
    at = const_cast<void*>(p);
  }
};
struct Buffers {
  dnnl::memory src, dst;                        // reorder buffers (src_reorder / dst_reorder)
  Wrapper x, out, bias, weights, scratch;  // wrappers: handles set per call
  ExecArgs args;                                // over the wrappers' memory objects
};
Buffers& ThreadBuffers(const Layer& layer) {
  thread_local auto* buffers = new std::unordered_map<uint64_t, Buffers>();
  auto it = buffers->find(layer.serial);
  if (it == buffers->end()) {
    Buffers b;
    const dnnl::engine& e = Engine();
    // zeroed once: CopyPixels writes only the channels, and a kernel reads the pad channels too
    if (layer.src_reorder) b.src = dnnl::memory(layer.kernel.src_md, e);
    if (layer.dst_reorder) b.dst = dnnl::memory(layer.kernel.dst_md, e);
    if (layer.src_reorder) std::memset(b.src.get_data_handle(), 0, layer.kernel.src_md.get_size());
    if (layer.dst_reorder) std::memset(b.dst.get_data_handle(), 0, layer.kernel.dst_md.get_size());
    b.x = Wrapper(layer.src_reorder ? b.src : dnnl::memory(layer.kernel.src_md, e, nullptr));
    b.out = Wrapper(layer.dst_reorder ? b.dst : dnnl::memory(layer.kernel.dst_md, e, nullptr));
    b.bias = Wrapper(dnnl::memory(layer.kernel.bias_md, e, nullptr));
    b.weights = Wrapper(layer.packed ? dnnl::memory(layer.kernel.weights_md, e, nullptr) : layer.weights);
    b.args = {{DNNL_ARG_SRC, b.x.mem.get()}, {DNNL_ARG_WEIGHTS, b.weights.mem.get()}, {DNNL_ARG_BIAS, b.bias.mem.get()},
              {DNNL_ARG_DST, b.out.mem.get()}};
    if (layer.kernel.scratchpad_md.get_size() > 0) {
      b.scratch = Wrapper(dnnl::memory(layer.kernel.scratchpad_md, e, nullptr));
      b.args.push_back({DNNL_ARG_SCRATCHPAD, b.scratch.mem.get()});
    }
    it = buffers->emplace(layer.serial, std::move(b)).first;
  }
  return it->second;
}

// A destination: a whole output tensor, or the channel range of a concat block it fills.
struct View {
  float* data;
  dims shape;  // [N, O, OH, OW]
  int64_t padded_c = 0;  // O rounded up to B where the tensor holds padded nChwBc, else 0
  int64_t numel() const { return shape[0] * (padded_c ? padded_c : shape[1]) * shape[2] * shape[3]; }
};

View ViewOf(const TensorView& t) { return View{const_cast<float*>(Data(t)), Dims(t.shape().data(), 4)}; }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LAYERFUSE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LAYERFUSE_CLONES
#endif

// y = y * sigmoid(y) = y / (1 + e^-y) in place for n floats: the SiLU of a conv's output, run
// by this library after the primitive instead of oneDNN's swish post-op (OwnActivation). e^t
// = 2^k * p(r), t = k ln2 + r (|r| <= ln2 / 2, ln2 split in two parts), p Cephes' expf
// polynomial of degree 7 (relative error about 1e-7); t clamped to [-87.3, 88.7], so that
// 2^k stays a normal float (the answer there is y itself or y / 3e38, both right to a float);
// a NaN stays a NaN. 16 lanes per step (AVX-512 / AVX2 / SSE clones picked at load time),
// over oneDNN's OpenMP threads for a large tensor.
LAYERFUSE_CLONES void SiluInPlace(float* __restrict y, int64_t n) {
  typedef float F __attribute__((vector_size(64)));
  typedef int32_t I __attribute__((vector_size(64)));
  constexpr int64_t kChunk = 4096, kParallel = 65536;  // floats per task; fewer: one thread
  const int64_t body = n / 16 * 16, chunks = (body + kChunk - 1) / kChunk;  // whole vectors; the tail after
#pragma omp parallel for schedule(static) if (n >= kParallel)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = std::min(body, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < end; i += 16) {
      F v;
      std::memcpy(&v, y + i, sizeof v);
      F t = -v;
      t = t < 88.7f ? t : F{} + 88.7f;
      t = t > -87.3f ? t : F{} - 87.3f;
      const F shifted = t * 1.44269504088896341f + 12582912.f;  // round(t / ln2) in the low mantissa bits
      const F k = shifted - 12582912.f;
      F r = t - k * 0.693359375f;
      r = r - k * -2.12194440e-4f;
      F p = F{} + 1.9875691500e-4f;
      p = p * r + 1.3981999507e-3f;
      p = p * r + 8.3334519073e-3f;
      p = p * r + 4.1665795894e-2f;
      p = p * r + 1.6666665459e-1f;
      p = p * r + 5.0000001201e-1f;
      p = p * r * r + r + 1.f;
      I bits;
      std::memcpy(&bits, &shifted, sizeof bits);
      bits = (bits - 0x4B400000 + 127) << 23;  // 2^k
      F scale;
      std::memcpy(&scale, &bits, sizeof scale);
      v = v / (1.f + p * scale);
      std::memcpy(y + i, &v, sizeof v);
    }
  }
  for (int64_t i = body; i < n; ++i) y[i] = y[i] / (1.f + std::exp(-y[i]));
}

// One conv (rows of a merged one, or all of it) from x into out, as `layer`; w: its packed
// weights (null: the layer's own copy), b: its bias. r: the residual (out's shape), or null.
void RunRows(const float* x, const Layer& layer, const float* w, const float* b, const float* r, const View& out) {
  for (int i = 0; i < 4; ++i) {
    if (out.shape[i] != layer.dst_dims[i]) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: output shape does not match the conv";
  }
  float* dst_ptr = out.data;
  Buffers& buf = ThreadBuffers(layer);
  const int64_t N = layer.dst_dims[0], C = layer.x[1], O = layer.dst_dims[1];
  if (layer.src_pixels) {
    CopyPixels(x, C, static_cast<float*>(buf.src.get_data_handle()), RoundUp(C, layer.src_pixels), N, C);
  } else if (layer.src_reorder) {
    layer.src_in(const_cast<float*>(x), buf.src.get_data_handle());
  } else {
    buf.x.Point(x);
  }
  float* const dst_buf = layer.dst_reorder ? static_cast<float*>(buf.dst.get_data_handle()) : nullptr;
  if (layer.dst_reorder) {  // the residual, for the sum post-op
    if (r && layer.dst_pixels) CopyPixels(r, O, dst_buf, RoundUp(O, layer.dst_pixels), N, O);
    if (r && !layer.dst_pixels) layer.dst_in(const_cast<float*>(r), dst_buf);
  } else {
    buf.out.Point(dst_ptr);
    if (r && r != dst_ptr) std::memcpy(dst_ptr, r, sizeof(float) * out.numel());
  }
  buf.bias.Point(b);
  // packed weights: the call's own tensor, wrapped where it lies (no copy)
  if (layer.packed) buf.weights.Point(w);
  if (buf.scratch.mem) buf.scratch.Point(ScratchpadData(layer.kernel.scratchpad_md.get_size()));
  RunKernel(layer.kernel, layer.prim, buf.args, r != nullptr, Stream());
  if (layer.dst_reorder && !layer.dst_pixels) layer.dst_out(dst_buf, dst_ptr);
  Stream().wait();
  if (layer.dst_reorder && layer.dst_pixels) CopyPixels(dst_buf, RoundUp(O, layer.dst_pixels), dst_ptr, O, N, O);
  if (!layer.kernel.wino && OwnActivation(layer.attrs[kAct])) SiluInPlace(dst_ptr, out.numel());
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

// y = x * g for hw pixels of one channel (NCHW)
LAYERFUSE_CLONES void ScaleChannel(const float* __restrict x, float g, float* __restrict y, int64_t hw) {
  int64_t p = 0;
  for (; p + 16 <= hw; p += 16)
    for (int l = 0; l < 16; ++l) y[p + l] = x[p + l] * g;
  for (; p < hw; ++p) y[p] = x[p] * g;
}

// the same for hw pixels of one B-channel block (nChwBc), g: the block's B factors
LAYERFUSE_CLONES void ScaleBlock(const float* __restrict x, const float* __restrict g, float* __restrict y, int64_t hw,
                                 int64_t block, int64_t valid) {
  float gv[16];
  for (int l = 0; l < block; ++l) gv[l] = l < valid ? g[l] : 0.f;  // the pad channels of a padded block: 0
  if (block == 16) {
    for (int64_t p = 0; p < hw; ++p)
      for (int l = 0; l < 16; ++l) y[p * 16 + l] = x[p * 16 + l] * gv[l];
  } else {
    for (int64_t p = 0; p < hw; ++p)
      for (int l = 0; l < 8; ++l) y[p * 8 + l] = x[p * 8 + l] * gv[l];
  }
}

// out = x * g, g [N, C, 1, 1] broadcast over H, W: the gate of a squeeze-and-excitation block,
// in the layout of the convs around it (attrs: (block,)), so that the tensor it scales stays
// blocked from the conv that makes it to the conv that reads the product. One unit is one
// channel (NCHW) or one B-channel block (nChwBc: [N, C/B, H, W, B], whose factors are
// g[n, cB : cB + B], the same bytes in both layouts) of one image, spread over oneDNN's OpenMP
// threads in one parallel region.
void ScaleChannels(TensorView x, TensorView g, Shape attrs, TensorView out) {
  CheckTensor(x, 4, "input");
  CheckTensor(g, 4, "gate");
  CheckTensor(out, 4, "output");
  if (attrs.size() != kScaleFieldCount)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.scale_channels: attrs must have " << kScaleFieldCount << " entry, got "
                              << attrs.size();
  const int64_t block = attrs[kScaleBlock];
  CheckBlock(block);
  const int64_t N = x.shape()[0], C = x.shape()[1], HW = x.shape()[2] * x.shape()[3];
  for (int i = 0; i < 4; ++i)
    if (out.shape()[i] != x.shape()[i]) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.scale_channels: output shape != input shape";
  // the gate's channels: C, or (blocked, padded nChwBc: x is [N, ceilB(Cg), H, W]) Cg with C - B < Cg < C
  const int64_t Cg = g.shape()[1];
  const bool padded = block && Cg < C && Cg > C - block;
  if (g.shape()[0] != N || (Cg != C && !padded) || g.shape()[2] * g.shape()[3] != 1)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.scale_channels: the gate must be [N, C, 1, 1] of the input's N, C"
                              << " (or, blocked, of the channels its padded blocks hold)";
  if (block && C % block)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.scale_channels: blocked channels must be a multiple of " << block;
  const float* xp = Data(x);
  const float* gp = Data(g);
  float* yp = const_cast<float*>(Data(out));
  const int64_t step = block ? block : 1;
  const int64_t per_image = C / step;
  const int64_t units = N * per_image;
#pragma omp parallel for schedule(static)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t offset = u * step * HW;  // unit u: image u / per_image, channels from (u % per_image) * step
    const int64_t c0 = (u % per_image) * step;
    if (block) {
      ScaleBlock(xp + offset, gp + (u / per_image) * Cg + c0, yp + offset, HW, block, Cg - c0);
    } else {
      ScaleChannel(xp + offset, gp[u], yp + offset, HW);
    }
  }
}

// The squeeze-and-excitation gate (MobileNetV3's, EfficientNet's): one call for what would be
// three - the global average of x and two 1x1 convs on [N, C, 1, 1] with their activations -
// with s = mean over H x W of x, per image and channel:
//
//   h = act1(w1 s + b1)   (S values)      g = act2(w2 h + b2)   (C values)
//
// x in NCHW or nChwBc (attrs' block; padded: its type [N, ceilB(C), H, W]); out [N, Co, 1, 1]
// with Co = C, or ceilB(C) in padded nChwBc (dst_block), where channel c of image n lies at
// n * Co + c either way (one pixel), the pad channels written 0. The activations are those of a
// conv's attrs (kActivations' codes, alpha and beta), computed in float. The averages, then the
// rows of each product (dot products in 16 partial sums), are spread over OpenMP's threads in
// one parallel region, where the gate has enough work for it.
float Activate(int64_t act, float alpha, float beta, float v) {
  switch (act) {
    case kNone: return v;
    case kRelu: return v > 0.f ? v : alpha * v;
    case kClip: return std::min(std::max(v, alpha), beta);
    case kSilu: return v / (1.f + std::exp(-v));
    case kSigmoid: return 1.f / (1.f + std::exp(-v));
    case kHardswish: return v * std::min(std::max(v + 3.f, 0.f), 6.f) / 6.f;
    case kHardsigmoid: return std::min(std::max(alpha * v + beta, 0.f), 1.f);
    case kGeluErf: return 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f));
    case kGeluTanh: return 0.5f * v * (1.f + std::tanh(0.79788456080286536f * (v + 0.044715f * v * v * v)));
  }
  TVM_FFI_THROW(ValueError) << "layerfuse.onednn: unknown activation code " << act;
}

// s[0:B] = the sums over hw pixels of one B-channel block of nChwBc (x: the block's first float)
template <int B>
LAYERFUSE_CLONES void SumBlockOf(const float* __restrict x, int64_t hw, float* __restrict s) {
  float acc[B] = {};
  for (int64_t p = 0; p < hw; ++p)
    for (int l = 0; l < B; ++l) acc[l] += x[p * B + l];
  for (int l = 0; l < B; ++l) s[l] = acc[l];
}
void SumBlock(const float* x, int64_t hw, int64_t block, float* s) {
  if (block == 16) {
    SumBlockOf<16>(x, hw, s);
  } else {
    SumBlockOf<8>(x, hw, s);
  }
}

// the dot product of a[0:n] and b[0:n], in 16 partial sums (vectorised)
LAYERFUSE_CLONES float Dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[16] = {};
  int64_t p = 0;
  for (; p + 16 <= n; p += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[p + l] * b[p + l];
  float total = 0.f;
  for (int l = 0; l < 16; ++l) total += acc[l];
  for (; p < n; ++p) total += a[p] * b[p];
  return total;
}

LAYERFUSE_CLONES float SumChannel(const float* __restrict x, int64_t hw) {
  float acc[16] = {};
  int64_t p = 0;
  for (; p + 16 <= hw; p += 16)
    for (int l = 0; l < 16; ++l) acc[l] += x[p + l];
  float total = 0.f;
  for (int l = 0; l < 16; ++l) total += acc[l];
  for (; p < hw; ++p) total += x[p];
  return total;
}

void SeGate(TensorView x, TensorView w1, TensorView b1, TensorView w2, TensorView b2, Shape attrs, TensorView out) {
  for (const auto& [t, what, nd] : {std::make_tuple(&x, "input", 4), std::make_tuple(&w1, "squeeze weight", 4),
                                    std::make_tuple(&b1, "squeeze bias", 1), std::make_tuple(&w2, "gate weight", 4),
                                    std::make_tuple(&b2, "gate bias", 1), std::make_tuple(&out, "gate", 4)})
    CheckTensor(*t, nd, what);
  if (attrs.size() != kSeFieldCount)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.se_gate: attrs must have " << kSeFieldCount << " entries, got " << attrs.size();
  const int64_t block = attrs[kSeBlock], dst_block = attrs[kSeDstBlock];
  CheckBlock(block);
  CheckBlock(dst_block);
  const int64_t S = w1.shape()[0], C = w1.shape()[1], N = x.shape()[0], HW = x.shape()[2] * x.shape()[3];
  const int64_t Cx = block ? RoundUp(C, block) : C, Co = dst_block ? RoundUp(C, dst_block) : C;
  if (w1.shape()[2] * w1.shape()[3] != 1 || w2.shape()[0] != C || w2.shape()[1] != S || w2.shape()[2] * w2.shape()[3] != 1 ||
      b1.numel() != S || b2.numel() != C)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.se_gate: weights must be [S, C, 1, 1] and [C, S, 1, 1], biases [S] and [C]";
  if (x.shape()[1] != Cx || out.shape()[0] != N || out.shape()[1] != Co || out.shape()[2] * out.shape()[3] != 1)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.se_gate: input [N, " << Cx << ", H, W] and gate [N, " << Co
                              << ", 1, 1] expected for " << C << " channels in these layouts";
  for (int64_t code : {attrs[kSeSqueezeAct], attrs[kSeGateAct]})
    if (code < 0 || code >= kActivationCount) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: unknown activation code " << code;
  const float* xp = Data(x);
  float* g = const_cast<float*>(Data(out));
  std::vector<float> s(N * Cx), h(S);
  const int64_t step = block ? block : 1, units = N * Cx / step;
  const float* W1 = Data(w1);
  const float* W2 = Data(w2);
  const float inv = 1.f / static_cast<float>(HW);
  const float a1 = FloatBits(attrs[kSeSqueezeAlphaBits]), c1 = FloatBits(attrs[kSeSqueezeBetaBits]);
  const float a2 = FloatBits(attrs[kSeGateAlphaBits]), c2 = FloatBits(attrs[kSeGateBetaBits]);
#pragma omp parallel if (N * (Cx * HW + 2 * S * C) >= 65536)
  {
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
      if (block) {
        SumBlock(xp + u * step * HW, HW, block, s.data() + u * step);
      } else {
        s[u] = SumChannel(xp + u * HW, HW);
      }
    }
    for (int64_t n = 0; n < N; ++n) {
      const float* sn = s.data() + n * Cx;
#pragma omp for schedule(static)
      for (int64_t j = 0; j < S; ++j) h[j] = Activate(attrs[kSeSqueezeAct], a1, c1, Dot(W1 + j * C, sn, C) * inv + Data(b1)[j]);
#pragma omp for schedule(static)
      for (int64_t c = 0; c < Co; ++c)
        g[n * Co + c] = c < C ? Activate(attrs[kSeGateAct], a2, c2, Dot(W2 + c * S, h.data(), S) + Data(b2)[c]) : 0.f;
    }
  }
}

// Channel c of one image of hw pixels, NCHW or nChwBc (padded or not): where its pixel 0 lies,
// and the distance between its pixels.
struct Plane {
  int64_t start, step;
  Plane(int64_t c, int64_t hw, int64_t block)
      : start(block ? (c / block) * hw * block + c % block : c * hw), step(block ? block : 1) {}
};

// The channels a tensor of `channels` occupies in layout `block` (padded to whole blocks).
int64_t Stored(int64_t channels, int64_t block) { return block ? (channels + block - 1) / block * block : channels; }

void Shuffle(TensorView a, TensorView b, Shape attrs, TensorView out) {
  CheckTensor(a, 4, "input");
  CheckTensor(b, 4, "input");
  CheckTensor(out, 4, "output");
  if (attrs.size() != kShuffleFieldCount)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.shuffle: attrs must have " << kShuffleFieldCount << " entries, got "
                              << attrs.size();
  const int64_t channels = attrs[kShuffleChannels], first = attrs[kShuffleFirst], count = attrs[kShuffleLength];
  const int64_t ab = attrs[kShuffleLeftBlock], bb = attrs[kShuffleRightBlock], ob = attrs[kShuffleDstBlock];
  CheckBlock(ab);
  CheckBlock(bb);
  CheckBlock(ob);
  const int64_t N = a.shape()[0], H = a.shape()[2], W = a.shape()[3], HW = H * W;
  if (channels < 1 || count < 1 || first < 0 || first + count > 2 * channels)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.shuffle: channels [" << first << ", " << first + count << ") of 2 x " << channels;
  for (const TensorView* t : {&b, &out})
    if (t->shape()[0] != N || t->shape()[2] != H || t->shape()[3] != W)
      TVM_FFI_THROW(ValueError) << "layerfuse.onednn.shuffle: inputs and output differ in N, H or W";
  if (a.shape()[1] != Stored(channels, ab) || b.shape()[1] != Stored(channels, bb) || out.shape()[1] != Stored(count, ob))
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.shuffle: channel dims do not match the attrs";
  const float* ap = Data(a);
  const float* bp = Data(b);
  float* yp = const_cast<float*>(Data(out));
  const int64_t a_img = a.shape()[1] * HW, b_img = b.shape()[1] * HW, y_chans = out.shape()[1], y_img = y_chans * HW;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < y_chans; ++k) {  // output channel k: the shuffle's channel first + k
      const Plane to(k, HW, ob);
      float* y = yp + n * y_img + to.start;
      if (k >= count) {  // a pad channel of a padded block
        for (int64_t p = 0; p < HW; ++p) y[p * to.step] = 0.f;
        continue;
      }
      const int64_t c = first + k;
      const bool from_a = c % 2 == 0;
      const Plane from(c / 2, HW, from_a ? ab : bb);
      const float* x = (from_a ? ap + n * a_img : bp + n * b_img) + from.start;
      for (int64_t p = 0; p < HW; ++p) y[p * to.step] = x[p * from.step];
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

// relu(concat(pieces) * s + t) into the calling thread's scratch for dims d (see the prologue above).
const float* RunPre(const Input& in, const dims& d, int64_t block) {
  const int64_t N = d[0], C = d[1], HW = d[2] * d[3];
  if (in.sc->numel() != C || in.sh->numel() != C)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn: prologue scale/shift length != input channels";
  thread_local auto* scratch = new std::map<std::array<int64_t, 5>, dnnl::memory>();
  const std::array<int64_t, 5> key{d[0], d[1], d[2], d[3], block};
  auto buf = scratch->find(key);
  if (buf == scratch->end())
    buf = scratch->emplace(key, dnnl::memory({d, dt::f32, block ? Blocked(block) : tag::nchw}, Engine())).first;
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

// The pieces of one conv call: its input dims x (C from the weights where a blocked input holds
// padded channels) and, per output view (its padded channels taken off), the weight dims of
// its rows. `wd`: the call's weights [O, C/groups, kh, kw]; prologue: the input is a
// concatenation with a prologue. Shapes only: the call (RunConv) and the compiler's packing
// (PackedLayout) plan a call alike.
std::vector<dims> PlanPieces(dims& x, bool prologue, const dims& wd, const Attrs& at, bool residual, std::vector<View>& views) {
  if (views.empty()) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: no output";
  if (views.size() > 1 && (residual || at.groups != 1))
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn: split outputs need a conv without residual and groups";
  // Padded channels: a blocked tensor whose C is not a multiple of B has the type (and bytes)
  // [N, ceilB(C), H, W]; the conv's C and O come from the weights.
  const int64_t C = wd[1] * at.groups, O = wd[0];
  if (!prologue && at.src_block && x[1] != C && x[1] == RoundUp(C, at.src_block)) x[1] = C;
  const int64_t dst0 = DstBlock(at.dst_block, 0);
  if (views.size() == 1 && dst0 && views[0].shape[1] != O && views[0].shape[1] == RoundUp(O, dst0)) {
    views[0].padded_c = views[0].shape[1];
    views[0].shape[1] = O;
  }
  std::vector<dims> pieces;
  int64_t o = 0;  // output channels planned
  for (const View& v : views) {
    const int64_t Oj = v.shape[1];
    if (Oj < 1 || o + Oj > O) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: outputs have more channels than the conv";
    pieces.push_back(dims{Oj, wd[1], wd[2], wd[3]});
    o += Oj;
  }
  if (o != O) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: outputs give " << o << " channels, not " << O;
  return pieces;
}

// the words the loader (runtime/loader.py) recognises this refusal by
constexpr const char* kPackedElsewhere = "its weights were packed at compile time for a oneDNN weights layout";

// A call with packed weights: refuse, in one line, weights packed for another layout than the
// one this machine's oneDNN chooses for the call (another CPU ISA: another blocking, or
// Winograd where the compiling machine had it), or of another size.
void CheckPacked(const std::vector<std::shared_ptr<const Layer>>& layers, const Attrs& at, const TensorView& w) {
  Hasher h;  // PackedId of the layers' weights_id, without a vector
  size_t bytes = 0;
  for (const auto& l : layers) h.Add(l->kernel.weights_id), bytes += l->weights_size;
  const int64_t here = PackedIdOf(h);
  if (here != at.packed || bytes != sizeof(float) * static_cast<size_t>(w.numel()))
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn: layer " << at.layer << ": " << kPackedElsewhere << " (identity " << at.packed
                              << ", " << sizeof(float) * w.numel() << " bytes) that oneDNN " << dnnl_version()->major << '.'
                              << dnnl_version()->minor << " does not pick on this CPU (identity " << here << ", " << bytes
                              << " bytes, for " << omp_get_max_threads()
                              << " threads): compile it on this machine";
}

// The conv of one call: the input (its prologue first), w, b [, r] into the views outs. w: plain
// [O, C/groups, kh, kw], or - attrs' `packed` - the packed bytes of its pieces' weights, one
// after the other, each in its primitive's layout (1-d; the dims are in the attrs).
void RunConv(const Input& in, const TensorView& w, const TensorView& b, const TensorView* r, const Shape& attrs,
             const std::vector<View>& outs) {
  dims x_dims = InputDims(in);
  Attrs at = Attrs::From(attrs);
  const bool packed = at.packed != 0;
  const ProbedThreads threads(packed);  // its kernels made and run for one thread count
  CheckTensor(w, packed ? 1 : 4, packed ? "packed weight" : "weight");
  CheckTensor(b, 1, "bias");
  if (r) CheckTensor(*r, 4, "residual");
  const dims wd = packed ? at.wdims : Dims(w.shape().data(), 4);
  if (b.shape()[0] != wd[0]) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: bias length != channels";
  std::vector<View> views = outs;
  const std::vector<dims> pieces = PlanPieces(x_dims, in.sc != nullptr, wd, at, r != nullptr, views);
  const int64_t row = wd[1] * wd[2] * wd[3];  // weights per output channel
  std::vector<std::shared_ptr<const Layer>> layers;
  int64_t o = 0;
  for (size_t j = 0; j < pieces.size(); ++j) {
    if (r && views[j].numel() != r->numel()) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: residual shape != output shape";
    const Rows rows{packed ? nullptr : Data(w) + o * row, Data(b) + o, pieces[j]};
    layers.push_back(Get(x_dims, rows, at, attrs, r != nullptr, DstBlock(at.dst_block, j), j, threads));
    o += pieces[j][0];
  }
  if (packed) CheckPacked(layers, at, w);
  const float* xdata = in.sc ? RunPre(in, x_dims, at.src_block) : Data(in.pieces[0]);
  o = 0;
  size_t offset = 0;  // packed: bytes of the pieces before
  for (size_t j = 0; j < pieces.size(); ++j) {
    const float* wj = packed ? reinterpret_cast<const float*>(reinterpret_cast<const char*>(Data(w)) + offset) : nullptr;
    RunRows(xdata, *layers[j], wj, Data(b) + o, r ? Data(*r) : nullptr, views[j]);
    offset += layers[j]->weights_size;
    o += pieces[j][0];
  }
}

// The weights layout the call conv(x, w, attrs [, residual]) -> outputs of out_channels each
// gets on this machine, asked by the compiler to pack the call's weights (PackWeights): its
// packed identity (attrs' `packed`) and bytes. x: the conv's input dims (a prologue's pieces:
// their concatenation's); prologue, residual: whether the call has them; attrs with packed 0.
struct Packing {
  dims x;
  Attrs at;
  std::vector<dims> pieces;
  std::vector<Kernel> kernels;
};

Packing PlanPacking(const Shape& x, bool prologue, const Shape& w, const Shape& attrs, bool residual, const Shape& out_channels) {
  if (x.size() != 4 || w.size() != 4) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: 4-d shapes expected";
  Packing p{Dims(x.data(), 4), Attrs::From(attrs), {}, {}};
  if (p.at.packed) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: these weights are packed already";
  std::vector<View> views;
  for (int64_t c : out_channels) views.push_back(View{nullptr, dims{x[0], c, 1, 1}});
  p.pieces = PlanPieces(p.x, prologue, Dims(w.data(), 4), p.at, residual, views);
  for (size_t j = 0; j < p.pieces.size(); ++j)
    p.kernels.push_back(MakeKernel(p.x, p.pieces[j], p.at, residual, DstBlock(p.at.dst_block, j)));
  return p;
}

tvm::ffi::Array<int64_t> PackedLayout(Shape x, bool prologue, Shape w, Shape attrs, bool residual, Shape out_channels) {
  try {
    auto ids_bytes = [&] {
      const Packing p = PlanPacking(x, prologue, w, attrs, residual, out_channels);
      std::vector<uint64_t> ids;
      int64_t bytes = 0;
      for (const Kernel& k : p.kernels) ids.push_back(k.weights_id), bytes += k.weights_md.get_size();
      return std::make_pair(PackedId(ids), bytes);
    };
    const auto [id, bytes] = ids_bytes();
    const int64_t varies = ThreadSteady(id, [&] { return ids_bytes().first; });
    return tvm::ffi::Array<int64_t>{id, bytes, varies};
  } catch (const dnnl::error& e) {
    TVM_FFI_THROW(RuntimeError) << "layerfuse.onednn: oneDNN failed: " << e.what();
  }
}

// out (1-d float32, PackedLayout's bytes) = the plain weights w [O, C/groups, kh, kw] of that
// call, each piece's rows in its kernel's layout, one piece after the other.
void PackWeights(Shape x, bool prologue, TensorView w, Shape attrs, bool residual, Shape out_channels, TensorView out) {
  CheckTensor(w, 4, "weight");
  CheckTensor(out, 1, "packed weight");
  try {
    const Packing p = PlanPacking(x, prologue, w.shape(), attrs, residual, out_channels);
    size_t bytes = 0;
    for (const Kernel& k : p.kernels) bytes += k.weights_md.get_size();
    if (bytes != sizeof(float) * static_cast<size_t>(out.numel()))
      TVM_FFI_THROW(ValueError) << "layerfuse.onednn.pack_weights: the packed weights take " << bytes << " bytes, out has "
                                << sizeof(float) * out.numel();
    const int64_t row = w.shape()[1] * w.shape()[2] * w.shape()[3];
    char* dst = reinterpret_cast<char*>(const_cast<float*>(Data(out)));
    std::memset(dst, 0, bytes);  // padding of blocked layouts: zeros, as oneDNN's reorder leaves them
    int64_t o = 0;
    for (size_t j = 0; j < p.kernels.size(); ++j) {
      PackKernel(p.kernels[j], p.pieces[j], p.at.groups, Data(w) + o * row, dst);
      dst += p.kernels[j].weights_md.get_size();
      o += p.pieces[j][0];
    }
  } catch (const dnnl::error& e) {
    TVM_FFI_THROW(RuntimeError) << "layerfuse.onednn: oneDNN failed: " << e.what();
  }
}

void Run(const Input& in, const TensorView& w, const TensorView& b, const TensorView* r, const Shape& attrs,
         const std::vector<TensorView>& outs) {
  std::vector<View> views;
  for (const auto& t : outs) {
    CheckTensor(t, 4, "output");
    views.push_back(ViewOf(t));
  }
  try {
    RunConv(in, w, b, r, attrs, views);
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
  if (args.size() < kConv2dArgCount + 1) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.conv2d: expected (x, w, b, attrs, out...)";
  std::vector<TensorView> outs;
  for (int i = kConv2dArgCount; i < args.size(); ++i) outs.push_back(args[i].cast<TensorView>());
  Run(Input{{args[kConv2dInput].cast<TensorView>()}}, args[kConv2dWeight].cast<TensorView>(),
      args[kConv2dBias].cast<TensorView>(), nullptr, args[kConv2dAttrs].cast<Shape>(), outs);
}

void Conv2dAdd(TensorView x, TensorView w, TensorView b, TensorView r, Shape attrs, TensorView out) {
  Run(Input{{x}}, w, b, &r, attrs, {out});
}

// conv2d_add_inplace(x, w, b, r, attrs_0, ..., attrs_n): conv2d_add with out = r, the attrs as
// integer arguments (the call comes from a TIR function that Relax calls with call_tir_inplace,
// so memory planning knows out is r). The sum post-op reads r where it writes: no copy.
void Conv2dAddInplace(tvm::ffi::PackedArgs args, tvm::ffi::Any* rv) {
  if (args.size() != kInplaceArgCount + kConvFieldCount)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.conv2d_add_inplace: expected (x, w, b, r, attrs...)";
  std::vector<int64_t> a;
  for (int i = kInplaceArgCount; i < args.size(); ++i) a.push_back(args[i].cast<int64_t>());
  TensorView r = args[kInplaceResidual].cast<TensorView>();
  Run(Input{{args[kInplaceInput].cast<TensorView>()}}, args[kInplaceWeight].cast<TensorView>(),
      args[kInplaceBias].cast<TensorView>(), &r, Shape(a.begin(), a.end()), {r});
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
// spec = (block, then per member kind, offset, nargs: MemberField); member j writes the
// channels [offset_j, offset_j + C_j) of out (batch 1: a contiguous range of out, in NCHW and
// - with offsets and C_j multiples of block B - in nChwBc) and takes the next nargs_j
// arguments: kind 0 copy (x), 1 conv2d (x, w, b, attrs), 2 conv2d_pre (x_1, ..., x_k, s, t,
// w, b, attrs), 3 conv2d_add (x, w, b, r, attrs), as the functions above (a conv's dst_block
// says out's layout).
void ConcatConvs(tvm::ffi::PackedArgs args, tvm::ffi::Any* rv) {
  if (args.size() < 3) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: expected (spec, args..., out)";
  enum ConcatConvsArg : int { kSpec, kMembers };  // (spec, the members' arguments..., out)
  const Shape spec = args[kSpec].cast<Shape>();
  TensorView out = args[args.size() - 1].cast<TensorView>();
  CheckTensor(out, 4, "output");
  const int64_t C = out.shape()[1], H = out.shape()[2], W = out.shape()[3];
  if (out.shape()[0] != 1) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: batch must be 1";
  if (spec.size() < 1 || (spec.size() - 1) % kMemberFieldCount != 0)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: bad spec";
  const int64_t block = spec[0];
  CheckBlock(block);
  float* base = const_cast<float*>(Data(out));
  static const int kFixed[] = {1, 4, 5, 5};  // arguments per member kind (kind 2: its pieces, plus 5)
  int a = kMembers;  // next argument
  try {
    for (size_t m = 1; m + kMemberFieldCount <= spec.size(); m += kMemberFieldCount) {
      const int64_t kind = spec[m + kKind], offset = spec[m + kOffset], n = spec[m + kNargs];
      if (kind < 0 || kind > 3) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: unknown member kind " << kind;
      if (kind == 2 ? n < kFixed[2] + 1 : n != kFixed[kind])
        TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: member of kind " << kind << " with " << n << " arguments";
      if (a + n > args.size() - 1) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: spec does not match the arguments";
      auto t = [&](int i) { return args[a + i].cast<TensorView>(); };
      // a conv member's channels: its weights' rows (the attrs say them where the weights are packed)
      int64_t Cj = kind == 0 ? t(0).shape()[1] : t(kind == 2 ? n - 3 : 1).shape()[0];
      if (kind != 0) {
        const Attrs at = Attrs::From(args[a + n - 1].cast<Shape>());
        if (at.packed) Cj = at.wdims[0];
      }
      if (offset < 0 || offset + Cj > C || (block && (offset % block || Cj % block)))
        TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: piece does not fit the output";
      View view{base + offset * H * W, dims{1, Cj, H, W}};
      if (kind == 0) {
        TensorView x = t(0);
        CheckTensor(x, 4, "input");
        if (x.numel() != view.numel()) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.concat_convs: copy shape mismatch";
        std::memcpy(view.data, Data(x), sizeof(float) * x.numel());
      } else if (kind == 1) {
        RunConv(Input{{t(0)}}, t(1), t(2), nullptr, args[a + 3].cast<Shape>(), {view});
      } else if (kind == 2) {
        Input in;
        for (int i = 0; i < n - 5; ++i) in.pieces.push_back(t(i));
        TensorView sc = t(n - 5), sh = t(n - 4);
        in.sc = &sc;
        in.sh = &sh;
        RunConv(in, t(n - 3), t(n - 2), nullptr, args[a + n - 1].cast<Shape>(), {view});
      } else {
        TensorView r = t(3);
        RunConv(Input{{t(0)}}, t(1), t(2), &r, args[a + 4].cast<Shape>(), {view});
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
  if (a.size() != kPoolFieldCount)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.pool2d: attrs must have " << kPoolFieldCount << " entries, got " << a.size();
  static const dnnl::algorithm algs[] = {dnnl::algorithm::pooling_max, dnnl::algorithm::pooling_avg_include_padding,
                                         dnnl::algorithm::pooling_avg_exclude_padding};
  if (a[kAlg] < 0 || a[kAlg] > 2) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.pool2d: unknown algorithm " << a[kAlg];
  const int64_t kh = a[kKernelH], kw = a[kKernelW], sh = a[kPoolStrideH], sw = a[kPoolStrideW], pt = a[kPoolPadTop],
                pl = a[kPoolPadLeft];
  if (kh < 1 || kw < 1 || sh < 1 || sw < 1 || pt < 0 || pl < 0)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.pool2d: attrs need kernel sizes and strides >= 1, paddings >= 0";
  // the bottom/right padding: the stated one, or more where out's size needs it (ceil_mode)
  const int64_t pb = std::max(a[kPoolPadBottom], (y[2] - 1) * sh + kh - x[2] - pt);
  const int64_t pr = std::max(a[kPoolPadRight], (y[3] - 1) * sw + kw - x[3] - pl);
  if ((x[2] + pt + pb - kh) / sh + 1 != y[2] || (x[3] + pl + pr - kw) / sw + 1 != y[3] || x[0] != y[0] || x[1] != y[1])
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.pool2d: output shape does not match the pool";
  const tag t = a[kPoolBlock] ? Blocked(a[kPoolBlock]) : tag::nchw;
  dnnl::memory::desc src(x, dt::f32, t), dst(y, dt::f32, t);
  dnnl::pooling_forward::desc d(dnnl::prop_kind::forward_inference, algs[a[kAlg]], src, dst, {sh, sw}, {kh, kw}, {pt, pl},
                                {pb, pr});
  return dnnl::pooling_forward::primitive_desc(d, UserScratchpad(), Engine());
}

void Pool2d(TensorView x, Shape attrs, TensorView out) {
  CheckTensor(x, 4, "input");
  CheckTensor(out, 4, "output");
  try {
    static auto* mu = new std::shared_mutex();
    static auto* pools = new std::map<std::vector<int64_t>, std::shared_ptr<const Pool>>();
    std::vector<int64_t> key;  // (made once per shape; a pool has no weights and no layer id)
    key.reserve(8 + attrs.size());
    for (int i = 0; i < 4; ++i) key.push_back(x.shape()[i]), key.push_back(out.shape()[i]);
    key.insert(key.end(), attrs.begin(), attrs.end());
    std::shared_ptr<const Pool> pool;
    {
      std::shared_lock<std::shared_mutex> lock(*mu);
      auto it = pools->find(key);
      if (it != pools->end()) pool = it->second;
    }
    if (!pool) {
      auto made = std::make_shared<Pool>();
      made->pd = PoolDesc(Dims(x.shape().data(), 4), Dims(out.shape().data(), 4), attrs);
      made->prim = dnnl::pooling_forward(made->pd);
      std::unique_lock<std::shared_mutex> lock(*mu);
      pool = (*pools)[key] = made;
    }
    dnnl::memory src(pool->pd.src_desc(), Engine(), const_cast<float*>(Data(x)));
    dnnl::memory dst(pool->pd.dst_desc(), Engine(), const_cast<float*>(Data(out)));
    Execute(pool->prim, pool->pd.scratchpad_desc(), {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}});
    Stream().wait();
  } catch (const dnnl::error& e) {
    TVM_FFI_THROW(RuntimeError) << "layerfuse.onednn: oneDNN failed: " << e.what();
  }
}

// out = x @ w + b (the classifier: Gemm / Linear), x [N, K], w [K, M], b [M], out [N, M], as a
// oneDNN matmul primitive made once per shape. Packed weights (attrs' packed != 0: the
// compiled model's) are used where they lie, their layout's identity checked as a conv's;
// plain ones are reordered once into the layout the primitive prefers, checked by
// fingerprint like a conv's.
dnnl::matmul::primitive_desc DenseDesc(int64_t N, int64_t K, int64_t M) {
  dnnl::memory::desc src({N, K}, dt::f32, tag::ab), wei({K, M}, dt::f32, tag::any), bias({1, M}, dt::f32, tag::ab),
      dst({N, M}, dt::f32, tag::ab);
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, bias, dst), UserScratchpad(), Engine());
}

struct DensePrim {
  int64_t N, K, M;
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
  dnnl::memory weights;  // plain weights only: in pd.weights_desc(), owned
  std::vector<float> fingerprint;
  int64_t packed_id;     // PackedId of pd.weights_desc(), computed once
  size_t weights_size;   // its bytes
};

std::shared_mutex& DenseMutex() {
  static auto* mu = new std::shared_mutex();
  return *mu;
}

// plain weights: by their address; packed ones: by (N, K, M) under the null address (shared);
// and by the thread count their kernel is made for
std::map<std::tuple<const void*, int64_t, int64_t, int64_t, int64_t>, std::shared_ptr<const DensePrim>>& DensePrims() {
  static auto* prims = new std::map<std::tuple<const void*, int64_t, int64_t, int64_t, int64_t>, std::shared_ptr<const DensePrim>>();
  return *prims;
}

void ReleaseDense() {
  std::unique_lock<std::shared_mutex> lock(DenseMutex());
  DensePrims().clear();
}

void Dense(TensorView x, TensorView w, TensorView b, Shape attrs, TensorView out) {
  CheckTensor(x, 2, "input");
  CheckTensor(out, 2, "output");
  if (attrs.size() != kDenseFieldCount)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.dense: attrs must have " << kDenseFieldCount << " entries, got " << attrs.size();
  const int64_t packed = attrs[kDensePacked];
  if (packed < 0) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.dense: the packed identity must be >= 0";
  CheckTensor(w, packed ? 1 : 2, packed ? "packed weight" : "weight");
  const int64_t N = x.shape()[0], K = x.shape()[1], M = packed ? attrs[kDenseM] : w.shape()[1];
  if ((packed ? attrs[kDenseK] : w.shape()[0]) != K || b.numel() != M || out.shape()[0] != N || out.shape()[1] != M)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.dense: shapes do not agree";
  try {
    const ProbedThreads threads(packed);  // its kernel made and run for one thread count
    std::vector<float> fingerprint;
    if (!packed) fingerprint = Fingerprint(Data(w), K * M);
    const auto key = std::make_tuple(packed ? nullptr : static_cast<const void*>(Data(w)), N, K, M, static_cast<int64_t>(omp_get_max_threads()));
    std::shared_ptr<const DensePrim> p;
    {
      std::shared_lock<std::shared_mutex> lock(DenseMutex());
      auto it = DensePrims().find(key);
      if (it != DensePrims().end() && it->second->fingerprint == fingerprint) p = it->second;
    }
    if (!p) {  // made without the lock held; plain weights reordered once into the primitive's layout
      auto made = std::make_shared<DensePrim>();
      made->N = N, made->K = K, made->M = M;
      made->pd = DenseDesc(N, K, M);
      made->prim = dnnl::matmul(made->pd);
      made->packed_id = PackedId({DescId(made->pd.weights_desc())});
      made->weights_size = made->pd.weights_desc().get_size();
      if (!packed) {
        made->weights = dnnl::memory(made->pd.weights_desc(), Engine());
        Reorder(dnnl::memory::desc({K, M}, dt::f32, tag::ab), made->pd.weights_desc())(const_cast<float*>(Data(w)),
                                                                                        made->weights.get_data_handle());
        Stream().wait();
        made->fingerprint = fingerprint;
      }
      if (threads.capped()) ForgetCachedKernels();
      std::unique_lock<std::shared_mutex> lock(DenseMutex());
      p = DensePrims()[key] = made;
    }
    dnnl::memory weights = p->weights;
    if (packed) {
      const int64_t here = p->packed_id;
      if (here != packed || p->weights_size != sizeof(float) * static_cast<size_t>(w.numel()))
        TVM_FFI_THROW(ValueError) << "layerfuse.onednn: the dense layer: " << kPackedElsewhere << " (identity " << packed << ", "
                                  << sizeof(float) * w.numel() << " bytes) that oneDNN does not pick on this CPU (identity " << here
                                  << ", " << p->weights_size << " bytes): compile it on this machine";
      weights = dnnl::memory(p->pd.weights_desc(), Engine(), const_cast<float*>(Data(w)));
    }
    Execute(p->prim, p->pd.scratchpad_desc(),
            {{DNNL_ARG_SRC, dnnl::memory(p->pd.src_desc(), Engine(), const_cast<float*>(Data(x)))},
             {DNNL_ARG_WEIGHTS, weights},
             {DNNL_ARG_BIAS, dnnl::memory(p->pd.bias_desc(), Engine(), const_cast<float*>(Data(b)))},
             {DNNL_ARG_DST, dnnl::memory(p->pd.dst_desc(), Engine(), const_cast<float*>(Data(out)))}});
    Stream().wait();
  } catch (const dnnl::error& e) {
    TVM_FFI_THROW(RuntimeError) << "layerfuse.onednn: oneDNN failed: " << e.what();
  }
}

tvm::ffi::Array<int64_t> DensePackedLayout(Shape nkm) {
  if (nkm.size() != 3) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: (N, K, M) expected";
  try {
    const dnnl::memory::desc md = DenseDesc(nkm[0], nkm[1], nkm[2]).weights_desc();
    const int64_t varies = ThreadSteady(DescId(md), [&] { return DescId(DenseDesc(nkm[0], nkm[1], nkm[2]).weights_desc()); });
    return tvm::ffi::Array<int64_t>{PackedId({DescId(md)}), static_cast<int64_t>(md.get_size()), varies};
  } catch (const dnnl::error& e) {
    TVM_FFI_THROW(RuntimeError) << "layerfuse.onednn: oneDNN failed: " << e.what();
  }
}

void DensePackWeights(Shape nkm, TensorView w, TensorView out) {
  if (nkm.size() != 3) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: (N, K, M) expected";
  CheckTensor(w, 2, "weight");
  CheckTensor(out, 1, "packed weight");
  const int64_t K = nkm[1], M = nkm[2];
  if (w.shape()[0] != K || w.shape()[1] != M) TVM_FFI_THROW(ValueError) << "layerfuse.onednn.dense_pack_weights: w is not [K, M]";
  try {
    const dnnl::memory::desc md = DenseDesc(nkm[0], K, M).weights_desc();
    if (md.get_size() != sizeof(float) * static_cast<size_t>(out.numel()))
      TVM_FFI_THROW(ValueError) << "layerfuse.onednn.dense_pack_weights: out has the wrong size";
    std::memset(const_cast<float*>(Data(out)), 0, md.get_size());
    Reorder(dnnl::memory::desc({K, M}, dt::f32, tag::ab), md)(const_cast<float*>(Data(w)), const_cast<float*>(Data(out)));
    Stream().wait();
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
  if (attrs.size() != kToBlockedFieldCount || attrs[kBlock] == 0)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.to_blocked: attrs must be (block,) with block 8 or 16";
  const int64_t block = attrs[kBlock];
  const tag blocked_tag = Blocked(block);
  if (x.shape()[1] % block != 0)
    TVM_FFI_THROW(ValueError) << "layerfuse.onednn.to_blocked: channels % " << block << " != 0";
  try {
    static auto* mu = new std::shared_mutex();
    static auto* reorders = new std::map<std::pair<dims, int64_t>, std::shared_ptr<const Reorder>>();
    dims d = Dims(x.shape().data(), 4);
    const std::pair<dims, int64_t> key{d, block};
    std::shared_ptr<const Reorder> reorder;
    {
      std::shared_lock<std::shared_mutex> lock(*mu);
      auto it = reorders->find(key);
      if (it != reorders->end()) reorder = it->second;
    }
    if (!reorder) {
      auto made = std::make_shared<Reorder>(dnnl::memory::desc(d, dt::f32, tag::nchw), dnnl::memory::desc(d, dt::f32, blocked_tag));
      std::unique_lock<std::shared_mutex> lock(*mu);
      reorder = (*reorders)[key] = made;
    }
    (*reorder)(const_cast<float*>(Data(x)), const_cast<float*>(Data(out)));
    Stream().wait();
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
    return String(MakeKernel(Dims(x.data(), 4), Dims(w.data(), 4), at, residual, DstBlock(at.dst_block, 0)).impl);
  } catch (const dnnl::error& e) {
    return String(std::string("unsupported: ") + e.what());
  }
}

// The time (ms) of this conv layer on this machine under each of two attrs (e.g. direct and
// Winograd): the fastest of `reps` runs each, the two run in turn (weights, src and residual
// filled with a fixed pattern; weight reorders are not timed). The minimum of interleaved
// runs, because other processes on the machine only ever add time. On `threads` threads
// (>= 1), the kernels made for that count: oneDNN 2.6 picks another kernel by the thread
// count (3x3 32 -> 64 on 147x147, AVX-512: Winograd 4x3 at one thread, 1.08x the direct conv's
// time, Winograd 2x3 at two, 0.50x), so the compiler times both one thread and the machine's
// count. At one thread no OpenMP barrier can wait for a thread that another process holds off
// its core (whole scheduler time slices, 8 ms and more on a busy 2-core machine). For the
// tactic choice between algorithms at compile time.
tvm::ffi::Array<double> TimeConv(Shape x, Shape w, Shape attrs_a, Shape attrs_b, bool residual, int64_t reps,
                                 int64_t threads) {
  if (x.size() != 4 || w.size() != 4) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: 4-d shapes expected";
  if (threads < 1) TVM_FFI_THROW(ValueError) << "layerfuse.onednn: time_conv needs threads >= 1, got " << threads;
  try {
    static auto* timing = new std::mutex();  // one timing at a time (the thread count is process-wide)
    std::lock_guard<std::mutex> lock(*timing);
    // the thread count from before the primitives are made: oneDNN fixes a kernel's then; on
    // leaving (however), the kernels made for it are dropped from oneDNN's cache
    struct Forget {
      ~Forget() { ForgetCachedKernels(); }
    } forget;
    Threads team(static_cast<int>(std::min<int64_t>(threads, 1 << 16)));
    struct Timed {
      Kernel k;
      dnnl::convolution_forward prim;  // oneDNN's kernels
      std::unordered_map<int, dnnl::memory> args;
      ExecArgs exec;
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
      Timed t{MakeKernel(Dims(x.data(), 4), Dims(w.data(), 4), at, residual, DstBlock(at.dst_block, 0)), {}, {}};
      if (!t.k.wino) t.prim = dnnl::convolution_forward(t.k.pd);
      t.args = {{DNNL_ARG_SCRATCHPAD, dnnl::memory(t.k.scratchpad_md, Engine())},
                {DNNL_ARG_SRC, filled(t.k.src_md)},
                {DNNL_ARG_WEIGHTS, filled(t.k.weights_md)},
                {DNNL_ARG_BIAS, filled(t.k.bias_md)},
                {DNNL_ARG_DST, filled(t.k.dst_md)}};
      t.exec = ExecArgsOf(t.args);
      timed.push_back(std::move(t));
    }
    dnnl::stream s(Engine());
    for (int64_t k = -1; k < std::max<int64_t>(reps, 1); ++k) {  // one warm-up run each
      for (Timed& t : timed) {
        const auto t0 = std::chrono::steady_clock::now();
        RunKernel(t.k, t.prim, t.exec, residual, s);
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

int64_t AbiVersion() { return kAbiVersion; }

// One thread pool for the whole model. A model whose layers alternate between this library
// (oneDNN's OpenMP threads) and TVM's kernels (TVM's own pool) would otherwise keep two sets of
// worker threads, each spinning after its turn while the other set works: on a machine with as
// many cores as threads, every switch competes with a spinning thread of the other pool. So the
// TVM kernels' parallel loops run on OpenMP too, as TVM's own OpenMP build runs them: TVM's
// codegen calls the function in the library's `__TVMBackendParallelLaunch` slot (the loader
// fills it with TVM's pool at load) with a lambda that splits its loop by (task id, number of
// tasks); the team size is what OpenMP gives, so every task of the loop runs exactly once.
struct ParallelGroupEnv {  // TVM's TVMParallelGroupEnv
  void* sync_handle;
  int32_t num_task;
};
using ParallelLambda = int (*)(int task_id, ParallelGroupEnv* penv, void* cdata);

int OmpParallelLaunch(ParallelLambda lambda, void* cdata, int num_task) {
  const int want = num_task > 0 ? num_task : omp_get_max_threads();
  std::atomic<int> status{0};
#pragma omp parallel num_threads(want)
  {
    ParallelGroupEnv env{nullptr, static_cast<int32_t>(omp_get_num_threads())};
    const int rc = lambda(omp_get_thread_num(), &env, cdata);
    if (rc != 0) status.store(rc);
  }
  return status.load();
}

bool SharePool(String library_path) {
  void* handle = dlopen(library_path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return false;  // not loaded (or not by this path)
  void** launch = reinterpret_cast<void**>(dlsym(handle, "__TVMBackendParallelLaunch"));
  // a barrier inside a parallel loop needs TVM's pool (its sync handle): keep that pool there
  const bool barrier = dlsym(handle, "__TVMBackendParallelBarrier") != nullptr;
  const bool shared = launch != nullptr && !barrier;
  if (shared) *launch = reinterpret_cast<void*>(&OmpParallelLaunch);
  dlclose(handle);
  return shared;
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

}  // namespace
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
  Function::SetGlobal("layerfuse.onednn.scale_channels", Function::FromTyped(layerfuse_onednn::ScaleChannels), true);
  Function::SetGlobal("layerfuse.onednn.shuffle", Function::FromTyped(layerfuse_onednn::Shuffle), true);
  Function::SetGlobal("layerfuse.onednn.se_gate", Function::FromTyped(layerfuse_onednn::SeGate), true);
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
  Function::SetGlobal("layerfuse.onednn.abi_version", Function::FromTyped(layerfuse_onednn::AbiVersion), true);
  Function::SetGlobal("layerfuse.onednn.release", Function::FromTyped(layerfuse_onednn::ReleaseLayers), true);
  Function::SetGlobal("layerfuse.onednn.block_width", Function::FromTyped(layerfuse_onednn::BlockWidth), true);
  Function::SetGlobal("layerfuse.onednn.packed_layout", Function::FromTyped(layerfuse_onednn::PackedLayout), true);
  Function::SetGlobal("layerfuse.onednn.pack_weights", Function::FromTyped(layerfuse_onednn::PackWeights), true);
  Function::SetGlobal("layerfuse.onednn.dense_packed_layout", Function::FromTyped(layerfuse_onednn::DensePackedLayout), true);
  Function::SetGlobal("layerfuse.onednn.dense_pack_weights", Function::FromTyped(layerfuse_onednn::DensePackWeights), true);
  Function::SetGlobal("layerfuse.onednn.share_pool", Function::FromTyped(layerfuse_onednn::SharePool), true);
}
