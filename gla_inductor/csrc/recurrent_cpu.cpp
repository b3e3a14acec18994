// The GLA recurrence on CPU, one step at a time, for the forward of gla_inductor's ops.
//
//     S_t = diag(a_t) S_{t-1} + k_t^T v_t        o_t = scale * q_t S_t        (a_t = exp(g_t))
//
// Why a step loop and not the chunked algorithm: per step and state element it does one multiply
// and two fused multiply-adds (5 flops) on a state that stays in L1, with no intermediates; the
// chunked form's matmuls do 8 per state element and step at K = V = 64 and chunks of 64, and
// reach matmul speed only on large tiles. ops.py calls it through ctypes
// (gla_inductor/cpu_recurrent.py compiles it on first use) and keeps the chunked PyTorch forward
// for fp64 and for machines without a C++ compiler.
//
// Work is split into units of (batch, head, tile of up to 32 values): a unit walks all T steps
// with its [K, 32] slice of the state, the outputs of its 32 values accumulating in registers
// over the K rows (four vectors, so four independent chains of dependent adds, not one).
// Strides are in elements; the last dimension of every tensor is contiguous.

#include <cstdint>
#include <cstring>

namespace {

constexpr int kLanes = 8;  // floats per vector (AVX2; the compiler splits it where vectors are narrower)
constexpr int kTile = 32;  // values per unit: four vectors
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec x;
  std::memcpy(&x, p, sizeof x);  // unaligned: rows start at multiples of V
  return x;
}

inline void store(float* p, vec x) { std::memcpy(p, &x, sizeof x); }

struct Args {
  const float *q, *k, *v, *a;  // a: the per-step decay exp(g), or null for no gate
  float *o, *state;            // o [B, T, H, V]; state [B, H, K, V], initial state in, final out
  int64_t B, T, H, K, V, group;  // group: heads of v per head of q and k
  int64_t sq[3], sk[3], sv[3], sa[4], so[3];  // strides over (b, t, h) [, k for a]
  float scale;
  int reverse;
};

// What a unit reads and writes at step t: the rows of q, k, the decay (null without a gate), and its
// values' slices of v and o.
struct Rows {
  const float *q, *k, *a, *v;
  float* o;
};

inline Rows rows_at(const Args& x, int64_t b, int64_t h, int64_t j0, int64_t t) {
  const int64_t hq = h / x.group;
  return {x.q + b * x.sq[0] + t * x.sq[1] + hq * x.sq[2], x.k + b * x.sk[0] + t * x.sk[1] + hq * x.sk[2],
          x.a ? x.a + b * x.sa[0] + t * x.sa[1] + h * x.sa[2] : nullptr,
          x.v + b * x.sv[0] + t * x.sv[1] + h * x.sv[2] + j0, x.o + b * x.so[0] + t * x.so[1] + h * x.so[2] + j0};
}

// One unit with a whole tile of kTile values (NV vectors of them when the tile is narrower).
template <int NV, bool Gated>
void walk_tile(const Args& x, int64_t b, int64_t h, int64_t j0) {
  // locals, not x's fields: the stores through row could alias x as far as the compiler knows
  const int64_t K = x.K, V = x.V, sak = x.sa[3];
  float* S = x.state + (b * x.H + h) * K * V + j0;
  for (int64_t n = 0; n < x.T; n++) {
    const Rows r = rows_at(x, b, h, j0, x.reverse ? x.T - 1 - n : n);
    vec vv[NV], acc[NV];
    for (int c = 0; c < NV; c++) {
      vv[c] = load(r.v + c * kLanes);
      acc[c] = vec{};
    }
    float* row = S;
    for (int64_t i = 0; i < K; i++, row += V) {
      const float ki = r.k[i], qi = r.q[i], ai = Gated ? r.a[i * sak] : 1.f;
      for (int c = 0; c < NV; c++) {
        vec s = load(row + c * kLanes);
        s = Gated ? s * ai + vv[c] * ki : s + vv[c] * ki;
        store(row + c * kLanes, s);
        acc[c] += s * qi;
      }
    }
    for (int c = 0; c < NV; c++) store(r.o + c * kLanes, acc[c] * x.scale);
  }
}

// The last values of a row, fewer than one vector: the same walk, one value at a time.
template <bool Gated>
void walk_rest(const Args& x, int64_t b, int64_t h, int64_t j0) {
  const int64_t width = x.V - j0;
  float* S = x.state + (b * x.H + h) * x.K * x.V + j0;
  for (int64_t n = 0; n < x.T; n++) {
    const Rows r = rows_at(x, b, h, j0, x.reverse ? x.T - 1 - n : n);
    float acc[kLanes] = {};
    for (int64_t i = 0; i < x.K; i++) {
      float* row = S + i * x.V;
      for (int64_t c = 0; c < width; c++) {
        row[c] = Gated ? row[c] * r.a[i * x.sa[3]] + r.k[i] * r.v[c] : row[c] + r.k[i] * r.v[c];
        acc[c] += r.q[i] * row[c];
      }
    }
    for (int64_t c = 0; c < width; c++) r.o[c] = acc[c] * x.scale;
  }
}

// A row's V values in units: tiles of kTile, then one of the whole vectors left, then the rest.
struct Unit {
  int64_t j0, width;
};

int64_t units_per_row(int64_t V) {
  const int64_t rest = V % kTile;
  return V / kTile + (rest >= kLanes) + (rest % kLanes > 0);
}

Unit unit_of_row(int64_t V, int64_t r) {
  const int64_t whole = V / kTile * kTile, rest = V % kTile;
  if (r < V / kTile) return {r * kTile, kTile};
  if (r == V / kTile && rest >= kLanes) return {whole, rest / kLanes * kLanes};
  return {V - rest % kLanes, rest % kLanes};
}

template <bool Gated>
void walk(const Args& x, int64_t b, int64_t h, Unit u) {
  switch (u.width / kLanes) {
    case 4: return walk_tile<4, Gated>(x, b, h, u.j0);
    case 3: return walk_tile<3, Gated>(x, b, h, u.j0);
    case 2: return walk_tile<2, Gated>(x, b, h, u.j0);
    case 1: return walk_tile<1, Gated>(x, b, h, u.j0);
    default: return walk_rest<Gated>(x, b, h, u.j0);
  }
}

}  // namespace

extern "C" int gla_recurrent_forward(const float* q, const float* k, const float* v, const float* a,
                                     float* o, float* state, const int64_t* shape, const int64_t* strides,
                                     float scale, int reverse, int threads) {
  Args x{q, k, v, a, o, state};
  x.B = shape[0], x.T = shape[1], x.H = shape[2], x.K = shape[3], x.V = shape[4], x.group = shape[5];
  for (int d = 0; d < 3; d++) {
    x.sq[d] = strides[d], x.sk[d] = strides[3 + d], x.sv[d] = strides[6 + d], x.so[d] = strides[13 + d];
  }
  for (int d = 0; d < 4; d++) x.sa[d] = strides[9 + d];
  x.scale = scale, x.reverse = reverse;
  const int64_t per_row = units_per_row(x.V), units = x.B * x.H * per_row;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t u = 0; u < units; u++) {
    const int64_t bh = u / per_row, b = bh / x.H, h = bh % x.H;
    const Unit unit = unit_of_row(x.V, u % per_row);
    if (a) walk<true>(x, b, h, unit); else walk<false>(x, b, h, unit);
  }
  return 0;
}
