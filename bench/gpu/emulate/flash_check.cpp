// The one-pass attention kernels (`crates/model/src/kernels/cuda/flash.cu`) run on the CPU
// through the emulation (`shim/`), against the attention computed directly in f64 from the
// same bf16 inputs and the same dropout keys: the context, and the gradients of the queries,
// keys and values. Rows of several lengths (a row of one token, rows ending inside a tile,
// padding), one to three key tiles. Prints a line per compared tensor; exits 1 if any differs
// beyond the bound or holds a NaN (an element a kernel never wrote is a NaN).
//
// `bash bench/gpu/emulate/run.sh` builds and runs it (g++ 11 or later).

#include "flash.cu"

#include <algorithm>
#include <random>

namespace {

struct Case {
    const char* name;
    std::vector<int> lengths;
    int seq;
    int heads;
    bool dropout;
};

float bf(bf16 x) { return __bfloat162float(x); }

std::vector<bf16> random_bf16(size_t n, std::mt19937_64& rng) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<bf16> v(n);
    for (auto& x : v) x = __float2bfloat16(u(rng));
    return v;
}

// The largest |got - want| over the largest |want| (NaN if `got` holds one).
double worst(const std::vector<double>& got, const std::vector<double>& want) {
    double diff = 0.0, scale = 1e-30;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(got[i])) return NAN;
        diff = std::max(diff, std::fabs(got[i] - want[i]));
        scale = std::max(scale, std::fabs(want[i]));
    }
    return diff / scale;
}

bool run(const Case& c) {
    const int batch = (int)c.lengths.size(), heads = c.heads, seq = c.seq;
    const int hidden = heads * FLASH_HEAD;
    int tokens = 0;
    std::vector<uint32_t> scatter(batch * seq);
    std::vector<int> row_start(batch);
    for (int b = 0; b < batch; ++b) {
        row_start[b] = tokens;
        for (int i = 0; i < seq; ++i) scatter[b * seq + i] = i < c.lengths[b] ? tokens + i : 0;
        tokens += c.lengths[b];
    }
    for (auto& s : scatter) (void)s;
    for (int b = 0; b < batch; ++b)
        for (int i = c.lengths[b]; i < seq; ++i) scatter[b * seq + i] = (uint32_t)tokens;
    std::mt19937_64 rng(1234 + seq);
    const auto qkv = random_bf16((size_t)tokens * 3 * hidden, rng);
    const auto grad = random_bf16((size_t)tokens * hidden, rng);
    const float scale = 0.125f;
    Dropout d{};
    if (c.dropout) {
        d.key = 0x5eed5eedull;
        d.first_row = 3;
        d.threshold = (uint64_t)(0.1 * (1 << 24));
        d.scale = 1.0f / 0.9f;
        d.on = 1;
    }

    const bf16 unwritten{0x7fc1};  // a NaN
    std::vector<bf16> context((size_t)tokens * hidden, unwritten);
    std::vector<float> lse((size_t)batch * heads * seq, NAN), delta(lse.size(), NAN);
    std::vector<bf16> grad_qkv((size_t)tokens * 3 * hidden, unwritten);
    const EmulatedDim grid{(unsigned)((seq + FLASH_TILE - 1) / FLASH_TILE), (unsigned)heads,
                           (unsigned)batch};
    emulate_launch(grid, FLASH_THREADS, [&] {
        flash_attention_forward_bf16(qkv.data(), context.data(), lse.data(), scatter.data(),
                                     tokens, batch, heads, seq, scale, d);
    });
    const unsigned queries = (unsigned)(batch * heads * seq);
    emulate_launch({(queries + 7) / 8, 1, 1}, 256, [&] {
        flash_attention_delta_bf16(context.data(), grad.data(), delta.data(), scatter.data(),
                                   tokens, batch, heads, seq);
    });
    emulate_launch(grid, FLASH_THREADS, [&] {
        flash_attention_backward_kv_bf16(qkv.data(), grad.data(), lse.data(), delta.data(),
                                         grad_qkv.data(), scatter.data(), tokens, batch, heads,
                                         seq, scale, d);
    });
    emulate_launch(grid, FLASH_THREADS, [&] {
        flash_attention_backward_q_bf16(qkv.data(), grad.data(), lse.data(), delta.data(),
                                        grad_qkv.data(), scatter.data(), tokens, batch, heads,
                                        seq, scale, d);
    });

    // The reference, in f64.
    std::vector<double> want_context((size_t)tokens * hidden, 0.0);
    std::vector<double> want_grad((size_t)tokens * 3 * hidden, 0.0);
    auto at = [&](int t, int part, int h, int e) {
        return (size_t)t * 3 * hidden + (size_t)part * hidden + h * FLASH_HEAD + e;
    };
    for (int b = 0; b < batch; ++b) {
        const int len = c.lengths[b], t0 = row_start[b];
        for (int h = 0; h < heads; ++h) {
            std::vector<double> p((size_t)len * len), keep((size_t)len * len, 1.0);
            for (int i = 0; i < len; ++i) {
                const uint64_t line = d.on ? line_key(line_key(row_key(d, b), h), i) : 0;
                double m = -INFINITY;
                for (int j = 0; j < len; ++j) {
                    double s = 0.0;
                    for (int e = 0; e < FLASH_HEAD; ++e)
                        s += (double)bf(qkv[at(t0 + i, 0, h, e)]) * bf(qkv[at(t0 + j, 1, h, e)]);
                    p[i * len + j] = s * scale;
                    m = std::max(m, s * scale);
                    if (d.on) keep[i * len + j] = keep_factor(d, line, j);
                }
                double sum = 0.0;
                for (int j = 0; j < len; ++j) sum += p[i * len + j] = std::exp(p[i * len + j] - m);
                for (int j = 0; j < len; ++j) p[i * len + j] /= sum;
                for (int e = 0; e < FLASH_HEAD; ++e) {
                    double o = 0.0;
                    for (int j = 0; j < len; ++j)
                        o += p[i * len + j] * keep[i * len + j] * bf(qkv[at(t0 + j, 2, h, e)]);
                    want_context[(size_t)(t0 + i) * hidden + h * FLASH_HEAD + e] = o;
                }
            }
            for (int i = 0; i < len; ++i) {
                const bf16* g = &grad[(size_t)(t0 + i) * hidden + h * FLASH_HEAD];
                std::vector<double> dp(len);
                double dsum = 0.0;
                for (int j = 0; j < len; ++j) {
                    double v = 0.0;
                    for (int e = 0; e < FLASH_HEAD; ++e)
                        v += (double)bf(g[e]) * bf(qkv[at(t0 + j, 2, h, e)]);
                    dp[j] = v;
                    dsum += p[i * len + j] * keep[i * len + j] * v;
                }
                for (int j = 0; j < len; ++j) {
                    const double ds = p[i * len + j] * (dp[j] * keep[i * len + j] - dsum) * scale;
                    for (int e = 0; e < FLASH_HEAD; ++e) {
                        want_grad[at(t0 + i, 0, h, e)] += ds * bf(qkv[at(t0 + j, 1, h, e)]);
                        want_grad[at(t0 + j, 1, h, e)] += ds * bf(qkv[at(t0 + i, 0, h, e)]);
                        want_grad[at(t0 + j, 2, h, e)] +=
                            p[i * len + j] * keep[i * len + j] * bf(g[e]);
                    }
                }
            }
        }
    }

    const double bound = 2e-2;
    bool ok = true;
    auto report = [&](const char* what, const std::vector<double>& got,
                      const std::vector<double>& want) {
        const double w = worst(got, want);
        const bool passed = w <= bound;
        ok = ok && passed;
        std::printf("  %-28s %-8s %.3e  (bound %.0e) %s\n", c.name, what, w, bound,
                    passed ? "ok" : "FAILED");
    };
    std::vector<double> got(context.size());
    std::transform(context.begin(), context.end(), got.begin(), bf);
    report("context", got, want_context);
    for (int part = 0; part < 3; ++part) {
        std::vector<double> g, w;
        for (int t = 0; t < tokens; ++t)
            for (int k = 0; k < hidden; ++k) {
                g.push_back(bf(grad_qkv[(size_t)t * 3 * hidden + (size_t)part * hidden + k]));
                w.push_back(want_grad[(size_t)t * 3 * hidden + (size_t)part * hidden + k]);
            }
        report(part == 0 ? "dq" : part == 1 ? "dk" : "dv", g, w);
    }
    return ok;
}

}  // namespace

int main() {
    const Case cases[] = {
        {"3 rows (130, 64, 1), eval", {130, 64, 1}, 130, 2, false},
        {"3 rows (130, 64, 1), dropout", {130, 64, 1}, 130, 2, true},
        {"rows of 64, 63 and 200", {64, 63, 200}, 200, 1, true},
    };
    bool ok = true;
    std::printf("one-pass attention (flash.cu) on the CPU emulation against f64:\n");
    for (const auto& c : cases) ok = run(c) && ok;
    std::printf(ok ? "all within bounds\n" : "FAILED\n");
    return ok ? 0 : 1;
}
