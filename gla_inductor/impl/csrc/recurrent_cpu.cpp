// The GLA recurrence on CPU, one step at a time, for the forward and backward of gla_inductor's ops.
//
//     S_t = diag(a_t) S_{t-1} + k_t^T v_t        o_t = scale * q_t S_t        (a_t = exp(g_t))
//
// Why a step loop and not the chunked algorithm: per step and state element it does one multiply
// and two fused multiply-adds (5 flops) on a state that stays in L1, with no intermediates; the
// chunked form's matmuls do 8 per state element and step at K = V = 64 and chunks of 64, and
// reach matmul speed only on large tiles. ops.py calls it through ctypes
// (gla_inductor/impl/step_loop.py compiles it on first use) and keeps the chunked PyTorch
// implementation for fp64 and for machines without a C++ compiler.
//
// Work is split into units of (batch, head, tile of up to 32 values): a unit walks all T steps
// with its [K, 32] slice of the state, the outputs of its 32 values accumulating in registers
// over the K rows (four vectors, so four independent chains of dependent adds, not one).
// Strides are in elements; the last dimension of every tensor is contiguous.

#include <algorithm>
#include <cstdint>
#include <cstring>
#ifdef _OPENMP
#include <omp.h>
#endif

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

// ------------------------------------------------------------------------------------------------
// Backward. D_t, the gradient w.r.t. S_t, runs the recurrence back in time:
//
//     D_t = scale * q_t^T do_t + diag(a_{t+1}) D_{t+1}          (dht in place of D_T)
//     dq_t = scale * S_t do_t     dk_t = D_t v_t     dv_t = k_t D_t     dg_t = a_t * rowsum(D_t * S_{t-1})
//
// with diag(a_T) = 1, and dh0 = diag(a_0) D_0; t counts steps in the order the recurrence takes them
// (T-1 down to 0 with reverse). It needs the states S_t in reverse order: the forward walk keeps the
// state entering every chunk of `chunk` steps, and each chunk's states are walked again into a
// buffer before the chunk is walked back. A unit is a whole (batch, head): dq, dk and dg sum over all V.
// ------------------------------------------------------------------------------------------------

struct Grads {
  const float* dout;  // do [B, T, H, V], contiguous
  const float* dht;   // [B, H, K, V] or null
  float *dq, *dk, *dv, *dg, *dh0;  // dq, dk, dg [B, T, H, K]; dv [B, T, H, V]; dh0 [B, H, K, V]
  float* work;                     // backward_work(...) floats per thread
  int64_t chunk;
};

// The floats a unit of the backward keeps: the state entering each chunk, the chunk + 1 states of
// one chunk, D and a row of dv.
int64_t backward_work(int64_t T, int64_t K, int64_t V, int64_t chunk) {
  return ((T + chunk - 1) / chunk + chunk + 2) * K * V + V;
}

// The sum of a vector's lanes as a tree (three dependent adds, not seven: one row's three sums are
// on the backward's critical path).
inline float hsum(vec x) {
  float half[kLanes / 2];
  for (int l = 0; l < kLanes / 2; l++) half[l] = x[l] + x[l + kLanes / 2];
  return (half[0] + half[2]) + (half[1] + half[3]);
}

// out = diag(a) in + k^T v over a whole [K, V] state (in == out allowed); a null without a gate.
template <bool Gated>
void state_step(const Args& x, const Rows& r, const float* in, float* out) {
  const int64_t K = x.K, V = x.V, sak = x.sa[3];
  for (int64_t i = 0; i < K; i++) {
    const float ai = Gated ? r.a[i * sak] : 1.f, ki = r.k[i];
    const float* src = in + i * V;
    float* dst = out + i * V;
    int64_t j = 0;
    for (; j + kLanes <= V; j += kLanes) store(dst + j, load(src + j) * ai + load(r.v + j) * ki);
    for (; j < V; j++) dst[j] = src[j] * ai + r.v[j] * ki;
  }
}

// One step back: D holds the gradient w.r.t. S_t from the steps after t on entry, and w.r.t.
// S_{t-1} on exit; dv_row is scratch of V floats.
template <bool Gated>
void step_back(const Args& x, const Grads& y, const Rows& r, int64_t b, int64_t t, int64_t h,
               const float* S, const float* S_prev, float* D, float* dv_row) {
  const int64_t K = x.K, V = x.V, sak = x.sa[3];
  const int64_t rk = ((b * x.T + t) * x.H + h) * K, rv = ((b * x.T + t) * x.H + h) * V;
  const float* dout = y.dout + rv;
  for (int64_t j = 0; j < V; j++) dv_row[j] = 0.f;
  for (int64_t i = 0; i < K; i++) {
    const float ai = Gated ? r.a[i * sak] : 1.f, ki = r.k[i], qi = x.scale * r.q[i];
    const float *s = S + i * V, *sp = S_prev + i * V;
    float* d = D + i * V;
    vec dq{}, dk{}, dg{};
    int64_t j = 0;
    for (; j + kLanes <= V; j += kLanes) {
      const vec dj = load(d + j) + load(dout + j) * qi, vj = load(r.v + j), doj = load(dout + j);
      dk += dj * vj;
      dq += doj * load(s + j);
      if (Gated) dg += dj * load(sp + j);
      store(dv_row + j, load(dv_row + j) + dj * ki);
      store(d + j, Gated ? dj * ai : dj);
    }
    float dq_s = hsum(dq), dk_s = hsum(dk), dg_s = hsum(dg);
    for (; j < V; j++) {
      const float dj = d[j] + dout[j] * qi;
      dk_s += dj * r.v[j];
      dq_s += dout[j] * s[j];
      dg_s += dj * sp[j];
      dv_row[j] += dj * ki;
      d[j] = Gated ? dj * ai : dj;
    }
    y.dq[rk + i] = x.scale * dq_s;
    y.dk[rk + i] = dk_s;
    if (Gated) y.dg[rk + i] = ai * dg_s;
  }
  for (int64_t j = 0; j < V; j++) y.dv[rv + j] = dv_row[j];
}

template <bool Gated>
void backward_unit(const Args& x, const Grads& y, int64_t b, int64_t h, float* work) {
  const int64_t K = x.K, V = x.V, KV = K * V, T = x.T, C = y.chunk, chunks = (T + C - 1) / C;
  float *entering = work, *states = entering + chunks * KV, *D = states + (C + 1) * KV;
  float* dv_row = D + KV;
  auto time = [&](int64_t n) { return x.reverse ? T - 1 - n : n; };
  auto rows = [&](int64_t n) { return rows_at(x, b, h, 0, time(n)); };

  std::memcpy(states, x.state + (b * x.H + h) * KV, KV * sizeof(float));
  for (int64_t n = 0; n < T; n++) {
    if (n % C == 0) std::memcpy(entering + n / C * KV, states, KV * sizeof(float));
    state_step<Gated>(x, rows(n), states, states);
  }
  if (y.dht) std::memcpy(D, y.dht + (b * x.H + h) * KV, KV * sizeof(float));
  else std::fill(D, D + KV, 0.f);
  for (int64_t c = chunks - 1; c >= 0; c--) {
    const int64_t n0 = c * C, steps = std::min(C, T - n0);
    std::memcpy(states, entering + c * KV, KV * sizeof(float));
    for (int64_t m = 0; m < steps; m++) state_step<Gated>(x, rows(n0 + m), states + m * KV, states + (m + 1) * KV);
    for (int64_t m = steps - 1; m >= 0; m--)
      step_back<Gated>(x, y, rows(n0 + m), b, time(n0 + m), h, states + (m + 1) * KV, states + m * KV, D, dv_row);
  }
  std::memcpy(y.dh0 + (b * x.H + h) * KV, D, KV * sizeof(float));
}

}  // namespace

namespace {

int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

Args parse(const float* q, const float* k, const float* v, const float* a, float* o, float* state,
           const int64_t* shape, const int64_t* strides, float scale, int reverse) {
  Args x{q, k, v, a, o, state};
  x.B = shape[0], x.T = shape[1], x.H = shape[2], x.K = shape[3], x.V = shape[4], x.group = shape[5];
  for (int d = 0; d < 3; d++) {
    x.sq[d] = strides[d], x.sk[d] = strides[3 + d], x.sv[d] = strides[6 + d], x.so[d] = strides[13 + d];
  }
  for (int d = 0; d < 4; d++) x.sa[d] = strides[9 + d];
  x.scale = scale, x.reverse = reverse;
  return x;
}

}  // namespace

extern "C" int gla_recurrent_forward(const float* q, const float* k, const float* v, const float* a,
                                     float* o, float* state, const int64_t* shape, const int64_t* strides,
                                     float scale, int reverse, int threads) {
  const Args x = parse(q, k, v, a, o, state, shape, strides, scale, reverse);
  const int64_t per_row = units_per_row(x.V), units = x.B * x.H * per_row;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t u = 0; u < units; u++) {
    const int64_t bh = u / per_row, b = bh / x.H, h = bh % x.H;
    const Unit unit = unit_of_row(x.V, u % per_row);
    if (a) walk<true>(x, b, h, unit); else walk<false>(x, b, h, unit);
  }
  return 0;
}

extern "C" int64_t gla_recurrent_backward_work(int64_t T, int64_t K, int64_t V, int64_t chunk) {
  return backward_work(T, K, V, chunk);
}

// The gradients, from q, k, v, a and the initial state (in `state`, read only) as in the forward,
// do and dht; o's strides are unused. dg is written only with a gate. work: `threads` times
// gla_recurrent_backward_work(T, K, V, chunk) floats.
extern "C" int gla_recurrent_backward(const float* q, const float* k, const float* v, const float* a,
                                      float* state, const float* dout, const float* dht, float* dq, float* dk,
                                      float* dv, float* dg, float* dh0, float* work, const int64_t* shape,
                                      const int64_t* strides, float scale, int reverse, int64_t chunk,
                                      int threads) {
  const Args x = parse(q, k, v, a, nullptr, state, shape, strides, scale, reverse);
  const Grads y{dout, dht, dq, dk, dv, dg, dh0, work, chunk};
  const int64_t per_thread = backward_work(x.T, x.K, x.V, chunk);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bh = 0; bh < x.B * x.H; bh++) {
    float* mine = work + thread_index() * per_thread;
    if (a) backward_unit<true>(x, y, bh / x.H, bh % x.H, mine);
    else backward_unit<false>(x, y, bh / x.H, bh % x.H, mine);
  }
  return 0;
}
