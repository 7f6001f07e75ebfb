// bertkit's CUDA kernels run on the CPU through the emulation (`shim/`): each new kernel before
// a device run spends time on it, and after its run (these all passed on an H200 on
// 2026-11-27, the backward in pieces excepted) as a check of every change to them:
//
// - the one-pass attention (`crates/kernels/src/cuda/flash.cu` and `flash_registers.cu`,
//   through the shim's `mma.sync` and `ldmatrix`, `shim/tensor_core.h`) against the attention
//   computed directly in f64 from the same bf16 inputs and dropout keys: the context, each
//   place's log-sum-exp and delta, and the gradients of the queries, keys and values by the
//   two backwards and by the joint one (rows of at most 128 places), at rows of several lengths
//   (a row of one token, rows ending inside a tile, padding, holes) over one to eight key
//   tiles, with and without dropout (its keep words, written by the forward, read by the
//   backwards: every one they read written);
// - LayerNorm 16 bytes a thread (`layer_norm_vec_*` in `kernels.cu`), a block a row and a warp
//   a row (`layer_norm_warp_*`, with the dropout's keep bytes handed from the forward to the
//   backward), against the kernels an element a thread (`layer_norm_forward`,
//   `layer_norm_backward`): f32, bf16 and f16, with and without a residual and dropout, rows
//   narrower than a block's threads;
// - the embedding lookup and its backward in pieces (`gather_rows*` in `kernels.cu`) against
//   the rows gathered by hand (the same bits, f32, bf16 and f16) and the pieces' f32 sums by
//   hand, in order;
// - the gradients' sum (`add_tensors`, the same file) against sums by hand, 16-byte aligned and
//   not;
// - the keyed dropout (`keyed_dropout`, the same file) against each element's keep drawn by hand
//   from `dropout.rs`'s keys, packed tokens and plain rows;
// - the embeddings' end (`embeddings_forward` and `embeddings_backward`, the same file: the
//   three rows summed, LayerNorm, dropout) against f64 by hand, f32, bf16 and f16 (not yet run
//   on a GPU);
// - a linear layer's end backward (`bias_act_backward`) on rows wider than a block's bias sums;
//   and the end 16 bytes a thread (`bias_act_rows_forward`, `bias_sums_vec`) against the
//   kernels an element a thread, bit for bit (f32, bf16, f16; with GELU in both forms and
//   without, with a bias and without);
// - the negative log-likelihood and its backward (`loss.cu`) against f64 (f32, bf16 and f16,
//   a vocabulary's width);
// - the optimiser's update in place (`update_*` in `crates/train/src/cuda_update.cu`) against
//   the update by hand, LAMB and AdamW, from the bucket's rows and from held gradients; and the
//   parameters it sets (f32, bf16, f16 rows) against the new weights cast by hand;
// - the gradient bucket made and added to in one launch (`pieces_to_flat`, the same file)
//   against the pieces copied, cast and added by hand: absent gradients, pieces of every size
//   across the blocks' stretches, each element type, a grid smaller than the index (blocks
//   that loop), unscaled on the way; and its squared norm against f64 by hand.
//
// Prints a line per compared tensor; exits 1 if any differs beyond its bound or holds a NaN (an
// element a kernel never wrote is a NaN). `bash bench/gpu/emulate/run.sh` builds and runs it.

#include "kernels.cu"
#include "cuda_update.cu"

#include <algorithm>
#include <random>

namespace {

struct Case {
    const char* name;
    std::vector<int> lengths;
    int seq;
    int heads;
    bool dropout;
    /// Places inside a row's length that are padding too (row, place): a mask with holes.
    std::vector<std::pair<int, int>> holes = {};
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

// A mask's keys at probability 0.1 (`DeviceDropout` as `dropout.rs` keys it), on.
Dropout tenth_dropout(uint64_t key, uint64_t first_row) {
    Dropout d{};
    d.key = key;
    d.first_row = first_row;
    d.threshold = (uint64_t)(0.1 * (1 << 24));
    d.scale = 1.0f / 0.9f;
    d.on = 1;
    return d;
}

// By hand from `dropout.rs`'s keys: the line of the token at `place` of rows `seq` long (the
// row's key from the place's row, the line's from its column), and whether element `j` of a
// line keeps (its 24-bit uniform from the line's key plus its index).
uint64_t token_line_by_hand(const Dropout& d, uint32_t place, int seq) {
    const uint64_t row = splitmix(d.key ^ splitmix(d.first_row + place / seq));
    return splitmix(row ^ splitmix((uint64_t)(place % seq) + 1));
}

bool kept_by_hand(const Dropout& d, uint64_t line, int j) {
    return (splitmix(line + (uint64_t)j) >> 40) >= d.threshold;
}

bool run(const Case& c) {
    const int batch = (int)c.lengths.size(), heads = c.heads, seq = c.seq;
    const int hidden = heads * FLASH_HEAD;
    // Each row's token places (the packing's order: row by row, place by place), then the
    // scatter from places to tokens (`tokens` for padding).
    std::vector<std::vector<int>> places(batch);
    for (int b = 0; b < batch; ++b)
        for (int i = 0; i < c.lengths[b]; ++i)
            if (std::find(c.holes.begin(), c.holes.end(), std::pair{b, i}) == c.holes.end())
                places[b].push_back(i);
    int tokens = 0;
    std::vector<int> row_start(batch);
    for (int b = 0; b < batch; ++b) {
        row_start[b] = tokens;
        tokens += (int)places[b].size();
    }
    std::vector<uint32_t> scatter(batch * seq, (uint32_t)tokens);
    for (int b = 0; b < batch; ++b)
        for (size_t k = 0; k < places[b].size(); ++k)
            scatter[b * seq + places[b][k]] = (uint32_t)(row_start[b] + k);
    std::mt19937_64 rng(1234 + seq);
    const auto qkv = random_bf16((size_t)tokens * 3 * hidden, rng);
    const auto grad = random_bf16((size_t)tokens * hidden, rng);
    const float scale = 0.125f;
    const Dropout d = c.dropout ? tenth_dropout(0x5eed5eedull, 3) : Dropout{};

    const bf16 unwritten{0x7fc1};  // a NaN
    const unsigned queries = (unsigned)(batch * heads * seq);
    const int tiles = (seq + FLASH_TILE - 1) / FLASH_TILE;
    const EmulatedDim grid{(unsigned)tiles, (unsigned)heads, (unsigned)batch};
    const EmulatedDim pair_grid{(unsigned)((seq + 2 * FLASH_TILE - 1) / (2 * FLASH_TILE)),
                                (unsigned)heads, (unsigned)batch};
    // The forward (with dropout, writing the keep words the backwards read).
    std::vector<bf16> context((size_t)tokens * hidden, unwritten);
    std::vector<float> lse((size_t)batch * heads * seq, NAN), delta(lse.size(), NAN);
    std::vector<uint32_t> keep(d.on ? (size_t)batch * heads * tiles * tiles * FLASH_THREADS : 0,
                               0xdeadbeefu);
    emulate_launch(pair_grid, FR_PAIR_THREADS, [&] {
        if (d.on) {
            flash_forward_bits_bf16(qkv.data(), context.data(), lse.data(), scatter.data(), tokens,
                                    batch, heads, seq, scale, d, keep.data());
        } else {
            flash_forward_bf16(qkv.data(), context.data(), lse.data(), scatter.data(), tokens,
                               batch, heads, seq, scale, d);
        }
    });
    // The delta: every place written (0 for padding), each within f32's rounding of its 64
    // products' sum in f64.
    emulate_launch({(queries * 8 + 255) / 256, 1, 1}, 256, [&] {
        flash_delta_bf16(context.data(), grad.data(), delta.data(), scatter.data(), tokens, batch,
                         heads, seq);
    });
    size_t delta_off = 0;
    for (int b = 0; b < batch; ++b)
        for (int h = 0; h < heads; ++h)
            for (int i = 0; i < seq; ++i) {
                const size_t q = ((size_t)b * heads + h) * seq + i;
                const uint32_t t = scatter[(size_t)b * seq + i];
                double sum = 0.0, magnitude = 0.0;
                if (t < (uint32_t)tokens)
                    for (int e = 0; e < FLASH_HEAD; ++e) {
                        const size_t at = (size_t)t * hidden + h * FLASH_HEAD + e;
                        const double term = (double)to_f32(context[at]) * (double)to_f32(grad[at]);
                        sum += term;
                        magnitude += std::fabs(term);
                    }
                const double bound = FLASH_HEAD * std::ldexp(1.0, -24) * magnitude;
                delta_off += !(std::fabs((double)delta[q] - sum) <= bound);
            }
    // The keys' and values' backward and the queries'.
    std::vector<bf16> grad_qkv((size_t)tokens * 3 * hidden, unwritten);
    emulate_launch(grid, FLASH_THREADS, [&] {
        if (d.on) {
            flash_backward_kv_bits_bf16(qkv.data(), grad.data(), lse.data(), delta.data(),
                                        grad_qkv.data(), scatter.data(), tokens, batch, heads,
                                        seq, scale, d, keep.data());
        } else {
            flash_backward_kv_bf16(qkv.data(), grad.data(), lse.data(), delta.data(),
                                   grad_qkv.data(), scatter.data(), tokens, batch, heads, seq,
                                   scale, d);
        }
    });
    emulate_launch(grid, FLASH_THREADS, [&] {
        if (d.on) {
            flash_backward_q_bits_bf16(qkv.data(), grad.data(), lse.data(), delta.data(),
                                       grad_qkv.data(), scatter.data(), tokens, batch, heads, seq,
                                       scale, d, keep.data());
        } else {
            flash_backward_q_bf16(qkv.data(), grad.data(), lse.data(), delta.data(),
                                  grad_qkv.data(), scatter.data(), tokens, batch, heads, seq,
                                  scale, d);
        }
    });
    // The joint backward (rows of at most 128 places: one block of eight warps a row's head,
    // the delta its own).
    const bool joint_runs = seq <= FR_PAIR_ROWS;
    std::vector<bf16> joint(grad_qkv.size(), unwritten);
    if (joint_runs) {
        emulate_launch({1, (unsigned)heads, (unsigned)batch}, FR_PAIR_THREADS, [&] {
            if (d.on) {
                flash_backward_joint_bits_bf16(qkv.data(), context.data(), grad.data(), lse.data(),
                                               joint.data(), scatter.data(), tokens, batch, heads,
                                               seq, scale, d, keep.data());
            } else {
                flash_backward_joint_bf16(qkv.data(), context.data(), grad.data(), lse.data(),
                                          joint.data(), scatter.data(), tokens, batch, heads, seq,
                                          scale, d);
            }
        }, sizeof(FrJointShared));
    }
    // Every keep word the backwards read written: a row's pairs of tiles before its end.
    size_t keep_unwritten = 0;
    if (d.on) {
        for (int b = 0; b < batch; ++b) {
            const int end = places[b].empty() ? 0 : places[b].back() + 1;
            for (int h = 0; h < heads; ++h)
                for (int qt = 0; qt * FLASH_TILE < end; ++qt)
                    for (int kt = 0; kt * FLASH_TILE < end; ++kt)
                        for (int w = 0; w < FLASH_THREADS; ++w)
                            keep_unwritten += keep[fr_bits_at(b, h, heads, tiles, qt) +
                                                   (size_t)kt * FLASH_THREADS + w] == 0xdeadbeefu;
        }
    }

    // The reference, in f64.
    std::vector<double> want_context((size_t)tokens * hidden, 0.0);
    std::vector<double> want_lse(lse.size(), NAN);
    std::vector<double> want_grad((size_t)tokens * 3 * hidden, 0.0);
    auto at = [&](int t, int part, int h, int e) {
        return (size_t)t * 3 * hidden + (size_t)part * hidden + h * FLASH_HEAD + e;
    };
    // Token `t0 + i` of row `b` is at place `places[b][i]`: the dropout's keys take places.
    for (int b = 0; b < batch; ++b) {
        const int len = (int)places[b].size(), t0 = row_start[b];
        for (int h = 0; h < heads; ++h) {
            std::vector<double> p((size_t)len * len), keep((size_t)len * len, 1.0);
            for (int i = 0; i < len; ++i) {
                const uint64_t line =
                    d.on ? line_key(line_key(row_key(d, b), h), places[b][i]) : 0;
                double m = -INFINITY;
                for (int j = 0; j < len; ++j) {
                    double s = 0.0;
                    for (int e = 0; e < FLASH_HEAD; ++e)
                        s += (double)bf(qkv[at(t0 + i, 0, h, e)]) * bf(qkv[at(t0 + j, 1, h, e)]);
                    p[i * len + j] = s * scale;
                    m = std::max(m, s * scale);
                    if (d.on) keep[i * len + j] = keep_factor(d, line, places[b][j]);
                }
                double sum = 0.0;
                for (int j = 0; j < len; ++j) sum += p[i * len + j] = std::exp(p[i * len + j] - m);
                for (int j = 0; j < len; ++j) p[i * len + j] /= sum;
                want_lse[((size_t)b * heads + h) * seq + places[b][i]] = m + std::log(sum);
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
    const auto report_all = [&](const char* form, const std::vector<bf16>& ctx,
                                const std::vector<bf16>& gqkv) {
        std::printf("  %s\n", form);
        std::vector<double> got(ctx.size());
        std::transform(ctx.begin(), ctx.end(), got.begin(), bf);
        report("context", got, want_context);
        for (int part = 0; part < 3; ++part) {
            std::vector<double> g, w;
            for (int t = 0; t < tokens; ++t)
                for (int k = 0; k < hidden; ++k) {
                    g.push_back(bf(gqkv[(size_t)t * 3 * hidden + (size_t)part * hidden + k]));
                    w.push_back(want_grad[(size_t)t * 3 * hidden + (size_t)part * hidden + k]);
                }
            report(part == 0 ? "dq" : part == 1 ? "dk" : "dv", g, w);
        }
    };
    report_all("the forward, the delta and the two backwards:", context, grad_qkv);
    if (joint_runs) report_all("the joint backward:", context, joint);
    // Each token place's log-sum-exp against f64's; every other place's written.
    double lse_worst = 0.0;
    for (size_t i = 0; i < lse.size(); ++i) {
        if (std::isnan(lse[i])) {
            lse_worst = INFINITY;
        } else if (!std::isnan(want_lse[i])) {
            lse_worst = std::max(lse_worst, std::fabs((double)lse[i] - want_lse[i]));
        }
    }
    const bool lse_ok = lse_worst <= 1e-4;
    ok = ok && lse_ok;
    std::printf("  %-28s %-8s %.3e  (bound 1e-4) %s\n", c.name, "lse", lse_worst,
                lse_ok ? "ok" : "FAILED");
    std::printf("  %-28s %-8s %zu off their sums in f64 by more than f32's rounding %s\n", c.name,
                "delta", delta_off, delta_off ? "FAILED" : "ok");
    if (d.on) {
        std::printf("  %-28s %-8s %zu keep words read but not written %s\n", c.name, "bits",
                    keep_unwritten, keep_unwritten ? "FAILED" : "ok");
    }
    return ok && delta_off == 0 && keep_unwritten == 0;
}

// The lookup of `rows` (one per token) in a `[table_rows, cols]` table and the backward of a
// gradient through it, in `T`, against the same done by hand.
template <typename T>
bool check_gather(const char* name, int table_rows, int cols, int tokens) {
    std::mt19937_64 rng(99 + cols);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<T> table((size_t)table_rows * cols), grad((size_t)tokens * cols);
    for (auto& x : table) x = from_f32<T>(u(rng));
    for (auto& x : grad) x = from_f32<T>(u(rng));
    std::vector<uint32_t> rows(tokens);
    for (int t = 0; t < tokens; ++t) rows[t] = (uint32_t)((t * 7 + t / 3) % (table_rows - 1));
    // RowIndex's groups: the tokens ordered by row (stably), where each row's start, the rows.
    std::vector<uint32_t> order(tokens);
    for (int t = 0; t < tokens; ++t) order[t] = t;
    std::stable_sort(order.begin(), order.end(),
                     [&](uint32_t a, uint32_t b) { return rows[a] < rows[b]; });
    std::vector<uint32_t> starts, distinct;
    for (int i = 0; i < tokens; ++i) {
        if (i == 0 || rows[order[i]] != rows[order[i - 1]]) {
            starts.push_back(i);
            distinct.push_back(rows[order[i]]);
        }
    }
    starts.push_back(tokens);
    const int groups = (int)distinct.size();

    std::vector<T> out((size_t)tokens * cols);
    const size_t n = (size_t)tokens * cols;
    emulate_launch({(unsigned)std::min<size_t>((n + 255) / 256, 7), 1, 1}, 256, [&] {
        gather_rows<T>(table.data(), rows.data(), out.data(), tokens, cols);
    });
    const unsigned threads = std::min(1024u, (unsigned)(((cols + 3) / 4 + 31) / 32 * 32));
    size_t gathered_wrong = 0;
    for (int t = 0; t < tokens; ++t)
        for (int c = 0; c < cols; ++c)
            gathered_wrong += to_f32(out[(size_t)t * cols + c]) !=
                              to_f32(table[(size_t)rows[t] * cols + c]);
    // The backward in pieces (RowGroups' split_rows, pieces of at most 5 tokens here) against
    // the same sums by hand: each piece in f32 in token order, then each row's pieces in order.
    const uint32_t piece = 5;
    std::vector<uint32_t> piece_starts, row_pieces;
    for (int k = 0; k < groups; ++k) {
        row_pieces.push_back((uint32_t)piece_starts.size());
        for (uint32_t i = starts[k]; i < starts[k + 1]; i += piece) piece_starts.push_back(i);
    }
    row_pieces.push_back((uint32_t)piece_starts.size());
    piece_starts.push_back(starts.back());
    const int pieces = (int)piece_starts.size() - 1;
    std::vector<float> partial((size_t)pieces * cols, std::nanf(""));
    std::vector<T> in_pieces((size_t)table_rows * cols, from_f32<T>(0.0f));
    emulate_launch({(unsigned)std::min(pieces, 6), 1, 1}, threads, [&] {
        gather_rows_backward_pieces<T>(grad.data(), order.data(), piece_starts.data(),
                                       partial.data(), pieces, cols);
    });
    emulate_launch({(unsigned)std::min(groups, 4), 1, 1}, threads, [&] {
        gather_rows_backward_rows<T>(partial.data(), row_pieces.data(), distinct.data(),
                                     in_pieces.data(), groups, cols);
    });
    size_t pieces_wrong = 0;
    for (int r = 0; r < table_rows; ++r)
        for (int c = 0; c < cols; ++c) {
            std::vector<int> mine;
            for (int t = 0; t < tokens; ++t)
                if ((int)rows[t] == r) mine.push_back(t);
            float sum = 0.0f;
            for (size_t p0 = 0; p0 < mine.size(); p0 += piece) {
                float part = 0.0f;
                for (size_t i = p0; i < std::min(mine.size(), p0 + piece); ++i)
                    part += to_f32(grad[(size_t)mine[i] * cols + c]);
                sum += part;
            }
            pieces_wrong += !(to_f32(in_pieces[(size_t)r * cols + c]) == to_f32(from_f32<T>(sum)));
        }
    std::printf("  %-28s %-8s %zu of %zu elements differ %s\n", name, "output", gathered_wrong, n,
                gathered_wrong ? "FAILED" : "ok");
    std::printf("  %-28s %-8s %zu of %zu elements differ %s (%d pieces)\n", name, "pieces",
                pieces_wrong, (size_t)table_rows * cols, pieces_wrong ? "FAILED" : "ok", pieces);
    return gathered_wrong == 0 && pieces_wrong == 0;
}

// A linear layer's end backward (`bias_act_backward` in `kernels.cu`) on rows wider than one
// block's bias sums (`BIAS_CHUNK` columns: a block per chunk as well), with GELU (`act` 1) or
// without, against f64 by hand: the activation's gradient and the bias's, from the blocks'
// partial sums.
bool check_bias(const char* name, int rows, int cols, int act, unsigned blocks) {
    std::mt19937_64 rng(5 + cols + act);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    std::vector<float> y((size_t)rows * cols), grad((size_t)rows * cols), bias(cols);
    for (auto* v : {&y, &grad, &bias}) for (auto& e : *v) e = u(rng);
    std::vector<float> grad_y(act ? (size_t)rows * cols : 0);
    std::vector<float> partial((size_t)blocks * cols, std::nanf(""));
    const unsigned chunks = (unsigned)((cols + BIAS_CHUNK - 1) / BIAS_CHUNK);
    emulate_launch({blocks, chunks, 1}, 256, [&] {
        bias_act_backward<float>(y.data(), bias.data(), grad.data(),
                                 act ? grad_y.data() : nullptr, partial.data(), rows, cols, act);
    }, std::min(cols, BIAS_CHUNK) * sizeof(float));
    std::vector<double> got_b(cols, 0.0), want_b(cols, 0.0), got_g, want_g;
    for (unsigned k = 0; k < blocks; ++k)
        for (int c = 0; c < cols; ++c) got_b[c] += partial[(size_t)k * cols + c];
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) {
            const size_t at = (size_t)r * cols + c;
            double g = grad[at];
            if (act) {
                const double v = (double)y[at] + bias[c];
                const double cdf = 0.5 * (1.0 + std::erf(v / std::sqrt(2.0)));
                g *= cdf + v * std::exp(-0.5 * v * v) / std::sqrt(2.0 * 3.14159265358979323846);
                got_g.push_back(grad_y[at]);
                want_g.push_back(g);
            }
            want_b[c] += g;
        }
    bool ok = true;
    const auto report = [&](const char* what, const std::vector<double>& g,
                            const std::vector<double>& want) {
        const double e = worst(g, want);
        ok = ok && e <= 1e-5;
        std::printf("  %-28s %-8s %.3e  (bound 1e-05) %s\n", name, what, e,
                    e <= 1e-5 ? "ok" : "FAILED");
    };
    if (act) report("dy", got_g, want_g);
    report("dbias", got_b, want_b);
    return ok;
}

// A linear layer's end 16 bytes a thread (`bias_act_rows_forward`, `bias_sums_vec` in
// `kernels.cu`) against the kernels an element a thread, on the same inputs: the output, the
// activation's gradient and the blocks' partial bias sums, bit for bit (the same arithmetic
// per element, each column's rows summed in the same order). `threads` fewer than a row's
// pieces makes a thread take several; `blocks` fewer than the rows, a block several rows.
template <typename T>
bool check_bias_vec(const char* name, int rows, int cols, int act, bool with_bias,
                    unsigned blocks, unsigned threads) {
    std::mt19937_64 rng(11 + cols + act);
    std::uniform_real_distribution<float> u(-3.0f, 3.0f);
    std::vector<T> y((size_t)rows * cols), grad((size_t)rows * cols), bias(cols);
    for (auto* v : {&y, &grad, &bias}) for (auto& e : *v) e = from_f32<T>(u(rng));
    const T* b = with_bias ? bias.data() : nullptr;
    const size_t n = (size_t)rows * cols;
    const T unwritten = from_f32<T>(std::nanf(""));
    std::vector<T> out(n, unwritten);
    emulate_launch({blocks, 1, 1}, 256, [&] {
        bias_act_forward<T>(y.data(), b, out.data(), rows, cols, act);
    });
    // The forward with a thread's columns fixed (`bias_act_rows_forward`), on one stretch of
    // pieces and on two (`blockIdx.y`): the same bits.
    std::vector<T> out_rows(n, unwritten), out_rows2(n, unwritten);
    emulate_launch({blocks, 1, 1}, threads, [&] {
        bias_act_rows_forward<T>(y.data(), b, out_rows.data(), rows, cols, act);
    });
    emulate_launch({blocks, 2, 1}, threads, [&] {
        bias_act_rows_forward<T>(y.data(), b, out_rows2.data(), rows, cols, act);
    });
    std::vector<T> grad_y(act ? n : 0, unwritten);
    std::vector<float> partial((size_t)blocks * cols, std::nanf(""));
    const unsigned chunks = (unsigned)((cols + BIAS_CHUNK - 1) / BIAS_CHUNK);
    const size_t shared = std::min(cols, BIAS_CHUNK) * sizeof(float);
    emulate_launch({blocks, chunks, 1}, 256, [&] {
        bias_act_backward<T>(y.data(), b, grad.data(), act ? grad_y.data() : nullptr,
                             with_bias ? partial.data() : nullptr, rows, cols, act);
    }, shared);
    // Bits, NaNs included (an element either kernel never wrote stays a NaN in both or fails).
    const auto differ = [](const auto& a, const auto& b2) {
        size_t wrong = 0;
        for (size_t i = 0; i < a.size(); ++i) {
            const double x = to_f32(a[i]), z = to_f32(b2[i]);
            if (std::isnan(x) || std::isnan(z) || memcmp(&a[i], &b2[i], sizeof a[i]) != 0) ++wrong;
        }
        return wrong;
    };
    bool ok = true;
    const auto report = [&](const char* what, size_t wrong, size_t of) {
        ok = ok && wrong == 0;
        std::printf("  %-28s %-8s %zu of %zu differ %s\n", name, what, wrong, of,
                    wrong ? "FAILED" : "ok");
    };
    report("by rows", differ(out, out_rows) + differ(out, out_rows2), 2 * n);
    if (with_bias && act == 0) {
        // The bias's sums alone in registers (`bias_sums_vec`, blocks of BIAS_SUMS_THREADS, the
        // rows of each block in the same order): the same partial sums, to the bit.
        std::vector<float> partial_sums(partial.size(), std::nanf(""));
        const unsigned pieces = (unsigned)(cols / Vec16<T>::N);
        emulate_launch({blocks, (pieces + BIAS_SUMS_THREADS - 1) / BIAS_SUMS_THREADS, 1},
                       BIAS_SUMS_THREADS, [&] {
            bias_sums_vec<T>(grad.data(), partial_sums.data(), rows, cols);
        });
        report("sums", differ(partial, partial_sums), partial.size());
    }
    if (act && cols % Vec16<T>::N == 0) {
        // With the activation (`bias_act_sums_vec`, `bias_sums_vec<T, true>`): its slopes and
        // (with a bias) its partial sums, the same bits as `bias_act_backward`'s.
        std::vector<T> grad_y_sums(n, unwritten);
        std::vector<float> partial_sums(partial.size(), std::nanf(""));
        const unsigned pieces = (unsigned)(cols / Vec16<T>::N);
        emulate_launch({blocks, (pieces + BIAS_SUMS_THREADS - 1) / BIAS_SUMS_THREADS, 1},
                       BIAS_SUMS_THREADS, [&] {
            bias_sums_vec<T, true>(grad.data(), with_bias ? partial_sums.data() : nullptr, rows,
                                   cols, y.data(), b, grad_y_sums.data(), act);
        });
        report("dy, sums", differ(grad_y, grad_y_sums), n);
        if (with_bias) report("act sums", differ(partial, partial_sums), partial.size());
    }
    return ok;
}

// LayerNorm 16 bytes a thread (`layer_norm_vec_*`, `layer_norm_warp_*`) against the kernels an
// element a thread (`layer_norm_forward`, `layer_norm_backward`), on the same rows, with or
// without a residual and dropout, the weight's and bias's gradients summed by the lanes'
// column sums (`column_sums_lanes`): the same values up to the order of the f32 sums (`bound`, relative to the largest; in f16 and bf16 at most 1% of the elements
// differing).
template <typename T>
bool check_norm(const char* name, int rows, int hidden, bool residual, bool dropout,
                unsigned blocks, double bound) {
    std::mt19937_64 rng(11 + hidden + residual + 2 * dropout);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    const size_t n = (size_t)rows * hidden;
    std::vector<T> x(n), res(n), grad(n), weight(hidden), bias(hidden);
    for (auto* v : {&x, &res, &grad}) for (auto& e : *v) e = from_f32<T>(u(rng));
    for (auto& e : weight) e = from_f32<T>(1.0f + 0.25f * u(rng));
    for (auto& e : bias) e = from_f32<T>(0.5f * u(rng));
    const int seq = 16;
    std::vector<uint32_t> places(rows);
    for (int r = 0; r < rows; ++r) places[r] = (uint32_t)(3 * r + 1);
    const Dropout d = dropout ? tenth_dropout(0xabcdefull, 5) : Dropout{};
    const T* r = residual ? res.data() : nullptr;
    const uint32_t* p = dropout ? places.data() : nullptr;
    const float eps = 1e-12f;
    constexpr int per = Vec16<T>::N;
    const unsigned old_threads = (unsigned)std::clamp((hidden + 3) / 4 / 32 * 32 + 32, 32, 1024);
    const unsigned vec_threads = (unsigned)(((hidden / per) + 31) / 32 * 32);
    const T nan = from_f32<T>(NAN);
    std::vector<T> y_old(n, nan), y_vec(n, nan);
    emulate_launch({(unsigned)rows, 1, 1}, old_threads, [&] {
        layer_norm_forward<T>(x.data(), r, weight.data(), bias.data(), y_old.data(), rows, hidden,
                              eps, d, p, seq);
    }, (hidden + 32) * sizeof(float));
    emulate_launch({(unsigned)std::min(rows, 7), 1, 1}, vec_threads, [&] {
        layer_norm_vec_forward<T>(x.data(), r, weight.data(), bias.data(), y_vec.data(), rows,
                                  hidden, eps, d, p, seq);
    });
    // The forward a warp per row (`layer_norm_warp_forward`): two blocks of four warps, so
    // that a warp takes several rows.
    std::vector<T> y_warp(n, nan);
    emulate_launch({2, 1, 1}, 128, [&] {
        layer_norm_warp_forward<T>(x.data(), r, weight.data(), bias.data(), y_warp.data(), rows,
                                   hidden, eps, d, p, seq);
    });
    // The backward, then each form's parameter gradients through its column sums.
    // (`partial`: the blocks' parameter sums, kept for the forms compared with them below.)
    const auto backward = [&](bool vec, std::vector<T>& grad_sum, std::vector<T>& grad_x,
                              std::vector<T>& params, std::vector<float>& partial) {
        if (vec) {
            emulate_launch({blocks, 1, 1}, vec_threads, [&] {
                layer_norm_vec_backward<T>(x.data(), r, weight.data(), grad.data(),
                                           grad_sum.data(), grad_x.data(), partial.data(), rows,
                                           hidden, eps, d, p, seq);
            });
            emulate_launch({(unsigned)((2 * hidden + 31) / 32), 1, 1}, 1024, [&] {
                column_sums_lanes<T>(partial.data(), params.data(), (int)blocks, 2 * hidden);
            });
        } else {
            emulate_launch({blocks, 1, 1}, old_threads, [&] {
                layer_norm_backward<T>(x.data(), r, weight.data(), grad.data(), grad_sum.data(),
                                       grad_x.data(), partial.data(), rows, hidden, eps, d, p,
                                       seq);
            }, (3 * hidden + 32) * sizeof(float));
            emulate_launch({(unsigned)((2 * hidden + 31) / 32), 1, 1}, 1024, [&] {
                column_sums_lanes<T>(partial.data(), params.data(), (int)blocks, 2 * hidden);
            });
        }
    };
    std::vector<T> gs_old(n, nan), gx_old(n, nan), pa_old(2 * hidden, nan);
    std::vector<T> gs_vec(n, nan), gx_vec(n, nan), pa_vec(2 * hidden, nan);
    std::vector<float> partial_old((size_t)blocks * 2 * hidden, NAN), partial_vec(partial_old);
    backward(false, gs_old, gx_old, pa_old, partial_old);
    backward(true, gs_vec, gx_vec, pa_vec, partial_vec);
    // The vector backward with each row's loads at once (`layer_norm_vec_backward<T, true>`):
    // the vector backward's bits.
    std::vector<T> gs_ahead(n, nan), gx_ahead(n, nan);
    std::vector<float> partial_ahead(partial_vec.size(), NAN);
    emulate_launch({blocks, 1, 1}, vec_threads, [&] {
        layer_norm_vec_backward<T, true>(x.data(), r, weight.data(), grad.data(), gs_ahead.data(),
                                         gx_ahead.data(), partial_ahead.data(), rows, hidden, eps,
                                         d, p, seq);
    });
    size_t ahead_differ = 0;
    for (size_t i = 0; i < n; ++i) {
        ahead_differ += to_f32(gs_ahead[i]) != to_f32(gs_vec[i]) ||
                        to_f32(gx_ahead[i]) != to_f32(gx_vec[i]) || std::isnan(to_f32(gs_ahead[i]));
    }
    for (size_t i = 0; i < partial_vec.size(); ++i) {
        ahead_differ += !(partial_ahead[i] == partial_vec[i]);
    }
    bool ok = ahead_differ == 0;
    std::printf("  %-28s %-8s %zu values differ from the vector backward's %s\n", name, "ahead",
                ahead_differ, ahead_differ ? "FAILED" : "ok");
    // The backward a warp per row (`layer_norm_warp_backward`): two blocks of four warps, each warp several rows, its parameter sums through the
    // lanes' column sums; drawing the keeps and, with dropout, reading the warp forward's keep
    // bytes (the same values: the same keeps). Against the backward ahead below.
    std::vector<T> gs_warp(n, nan), gx_warp(n, nan), pa_warp(2 * hidden, nan);
    std::vector<T> gs_warp_bits(n, nan), gx_warp_bits(n, nan), pa_warp_bits(2 * hidden, nan);
    const auto warp_backward = [&](const uint8_t* keep, std::vector<T>& grad_sum,
                                   std::vector<T>& grad_x, std::vector<T>& params) {
        const unsigned warp_blocks = 2;
        std::vector<float> partial((size_t)warp_blocks * 2 * hidden, NAN);
        emulate_launch({warp_blocks, 1, 1}, 32 * NORM_WARP_BACKWARD_WARPS, [&] {
            if (keep) {
                layer_norm_warp_backward<T, true>(x.data(), r, weight.data(), grad.data(),
                                                  grad_sum.data(), grad_x.data(), partial.data(),
                                                  rows, hidden, eps, d, p, seq, keep);
            } else {
                layer_norm_warp_backward<T>(x.data(), r, weight.data(), grad.data(),
                                            grad_sum.data(), grad_x.data(), partial.data(), rows,
                                            hidden, eps, d, p, seq);
            }
        });
        emulate_launch({(unsigned)((2 * hidden + 31) / 32), 1, 1}, 1024, [&] {
            column_sums_lanes<T>(partial.data(), params.data(), (int)warp_blocks, 2 * hidden);
        });
    };
    warp_backward(nullptr, gs_warp, gx_warp, pa_warp);
    if (dropout) {
        std::vector<uint8_t> keep((size_t)rows * (hidden / per), 0x5a);
        std::vector<T> y_keep(n, nan);
        emulate_launch({2, 1, 1}, 128, [&] {
            layer_norm_warp_forward<T, true>(x.data(), r, weight.data(), bias.data(),
                                             y_keep.data(), rows, hidden, eps, d, p, seq,
                                             keep.data());
        });
        warp_backward(keep.data(), gs_warp_bits, gx_warp_bits, pa_warp_bits);
        size_t bits_differ = 0;
        for (size_t i = 0; i < n; ++i) {
            bits_differ += to_f32(y_keep[i]) != to_f32(y_warp[i]);
            bits_differ += to_f32(gs_warp_bits[i]) != to_f32(gs_warp[i]) ||
                           to_f32(gx_warp_bits[i]) != to_f32(gx_warp[i]);
        }
        for (int j = 0; j < 2 * hidden; ++j) {
            bits_differ += to_f32(pa_warp_bits[j]) != to_f32(pa_warp[j]);
        }
        ok = ok && bits_differ == 0;
        std::printf("  %-28s %-8s %zu values differ from the warp forms drawing the keeps %s\n",
                    name, "warp bits", bits_differ, bits_differ ? "FAILED" : "ok");
    }
    const auto report = [&](const char* what, const std::vector<T>& got,
                            const std::vector<T>& want) {
        std::vector<double> g(got.size()), w(want.size());
        size_t differ = 0;
        for (size_t i = 0; i < got.size(); ++i) {
            g[i] = to_f32(got[i]);
            w[i] = to_f32(want[i]);
            differ += g[i] != w[i];
        }
        const double e = worst(g, w);
        // In f16 and bf16 the two forms' f32 results round to the same element but where they
        // straddle a rounding boundary: at most 1% may differ (a wrong sum moves many more).
        const bool passed = e <= bound && (sizeof(T) == 4 || differ * 100 <= got.size());
        ok = ok && passed;
        std::printf("  %-28s %-8s %.3e  (bound %.0e; %zu of %zu differ) %s\n", name, what, e,
                    bound, differ, got.size(), passed ? "ok" : "FAILED");
    };
    report("y", y_vec, y_old);
    report("y, warp", y_warp, y_old);
    report("dsum", gs_vec, gs_old);
    report("dx", gx_vec, gx_old);
    report("dparams", pa_vec, pa_old);
    report("dsum, warp", gs_warp, gs_vec);
    report("dx, warp", gx_warp, gx_vec);
    report("dparams, warp", pa_warp, pa_vec);
    return ok;
}

// The keyed dropout (`keyed_dropout` in `kernels.cu`) of a packed `[tokens, width]` tensor
// (token `t` at place `places[t]` of rows `seq` long) and of a `[rows, width]` one, on a grid
// smaller than the rows, against each element's keep drawn by hand from `dropout.rs`'s keys:
// the row's key from the place's row (or the row), the line's from the place's column (or
// none), the element's uniform from the line's key plus its index.
template <typename T>
bool check_keyed_dropout(const char* name, int rows, int width, bool packed) {
    std::mt19937_64 rng(17 + width);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    std::vector<T> x((size_t)rows * width), out(x.size(), from_f32<T>(NAN));
    for (auto& e : x) e = from_f32<T>(u(rng));
    const int seq = 7;
    std::vector<uint32_t> places(rows);
    for (int t = 0; t < rows; ++t) places[t] = (uint32_t)(2 * t + t / 3);  // holes, rows skipped
    const Dropout d = tenth_dropout(0x1234abcdull, 9);
    emulate_launch({3, 1, 1}, 64, [&] {
        keyed_dropout<T>(x.data(), out.data(), rows, width, d, packed ? places.data() : nullptr,
                         seq);
    });
    size_t wrong = 0, kept = 0;
    for (int r = 0; r < rows; ++r) {
        // (Plain rows: the row's key alone is the line.)
        const uint64_t line = packed ? token_line_by_hand(d, places[r], seq)
                                     : splitmix(d.key ^ splitmix(d.first_row + (uint64_t)r));
        for (int j = 0; j < width; ++j) {
            const bool keep = kept_by_hand(d, line, j);
            kept += keep;
            // (A dropped element is x times 0, as on the CPU: -0 where x is negative.)
            const T want = from_f32<T>(to_f32(x[(size_t)r * width + j]) * (keep ? d.scale : 0.0f));
            wrong += std::memcmp(&want, &out[(size_t)r * width + j], sizeof(T)) != 0;
        }
    }
    const bool ok = wrong == 0 && kept * 10 > x.size() * 8 && kept * 10 < x.size() * 10;
    std::printf("  %-28s %-8s %zu of %zu differ, %zu kept %s\n", name, "output", wrong, x.size(),
                kept, ok ? "ok" : "FAILED");
    return ok;
}

// The embeddings' end (`embeddings_forward` and `embeddings_backward` in `kernels.cu`): tokens
// reading rows of three f32 tables (words repeated, both token types, positions from the
// tokens' places), the weight and bias as `[2, hidden]` of `T`, dropout keyed by the places,
// against the same computed in f64 by hand (the sum, its mean and variance, the dropout's keeps
// drawn from `dropout.rs`'s keys); the backward's parameter gradients through `column_sums_lanes`.
// On a grid of `blocks` blocks of four warps (fewer warps than tokens: a warp takes several).
template <typename T>
bool check_embeddings(const char* name, int tokens, int hidden, bool dropout, unsigned blocks,
                      double bound) {
    std::mt19937_64 rng(23 + hidden + dropout);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const int vocab = 50, types_n = 2, seq = 16;
    std::vector<float> words((size_t)vocab * hidden), types((size_t)types_n * hidden),
        positions((size_t)seq * hidden);
    for (auto* v : {&words, &types, &positions}) for (auto& e : *v) e = u(rng);
    std::vector<T> params(2 * (size_t)hidden), grad((size_t)tokens * hidden);
    for (int j = 0; j < hidden; ++j) {
        params[j] = from_f32<T>(1.0f + 0.25f * u(rng));
        params[hidden + j] = from_f32<T>(0.5f * u(rng));
    }
    for (auto& e : grad) e = from_f32<T>(u(rng));
    std::vector<uint32_t> word_rows(tokens), type_rows(tokens), position_rows(tokens),
        places(tokens);
    for (int t = 0; t < tokens; ++t) {
        places[t] = (uint32_t)(2 * t + t / 3);  // holes: padding between tokens
        word_rows[t] = (uint32_t)((t * 7 + t / 3) % vocab);
        type_rows[t] = (uint32_t)((places[t] % seq) >= seq / 2);
        position_rows[t] = places[t] % seq;
    }
    const Dropout d = dropout ? tenth_dropout(0x5eedull, 3) : Dropout{};
    const float eps = 1e-12f;
    const size_t n = (size_t)tokens * hidden;
    std::vector<T> y(n, from_f32<T>(NAN));
    emulate_launch({blocks, 1, 1}, 128, [&] {
        embeddings_forward<T>(words.data(), types.data(), positions.data(), word_rows.data(),
                              type_rows.data(), position_rows.data(), params.data(), y.data(),
                              tokens, hidden, eps, d, places.data(), seq);
    });
    std::vector<float> grad_sum(n, NAN), partial((size_t)blocks * 2 * hidden, NAN);
    std::vector<float> grad_params(2 * (size_t)hidden, NAN);
    emulate_launch({blocks, 1, 1}, 128, [&] {
        embeddings_backward<T>(words.data(), types.data(), positions.data(), word_rows.data(),
                               type_rows.data(), position_rows.data(), params.data(), grad.data(),
                               grad_sum.data(), partial.data(), tokens, hidden, eps, d,
                               places.data(), seq);
    });
    emulate_launch({(unsigned)((2 * hidden + 31) / 32), 1, 1}, 1024, [&] {
        column_sums_lanes<float>(partial.data(), grad_params.data(), (int)blocks, 2 * hidden);
    });
    // The same in f64.
    std::vector<double> want_y(n), want_sum(n), want_params(2 * (size_t)hidden, 0.0);
    size_t kept = 0;
    for (int t = 0; t < tokens; ++t) {
        std::vector<double> v(hidden), keep(hidden, 1.0);
        double mean = 0.0, var = 0.0;
        for (int j = 0; j < hidden; ++j) {
            v[j] = (double)words[(size_t)word_rows[t] * hidden + j] +
                   types[(size_t)type_rows[t] * hidden + j] +
                   positions[(size_t)position_rows[t] * hidden + j];
            mean += v[j];
        }
        mean /= hidden;
        for (int j = 0; j < hidden; ++j) var += (v[j] - mean) * (v[j] - mean);
        const double rstd = 1.0 / std::sqrt(var / hidden + eps);
        if (dropout) {
            const uint64_t line = token_line_by_hand(d, places[t], seq);
            for (int j = 0; j < hidden; ++j) {
                const bool k = kept_by_hand(d, line, j);
                kept += k;
                keep[j] = k ? (double)d.scale : 0.0;
            }
        }
        double a = 0.0, b = 0.0;
        std::vector<double> normed(hidden), dn(hidden);
        for (int j = 0; j < hidden; ++j) {
            const double w = to_f32(params[j]), bias = to_f32(params[hidden + j]);
            normed[j] = (v[j] - mean) * rstd;
            want_y[(size_t)t * hidden + j] = (normed[j] * w + bias) * keep[j];
            const double g = to_f32(grad[(size_t)t * hidden + j]) * keep[j];
            want_params[j] += g * normed[j];
            want_params[hidden + j] += g;
            dn[j] = g * w;
            a += dn[j];
            b += dn[j] * normed[j];
        }
        a /= hidden;
        b /= hidden;
        for (int j = 0; j < hidden; ++j) {
            want_sum[(size_t)t * hidden + j] = rstd * (dn[j] - a - normed[j] * b);
        }
    }
    bool ok = !dropout || (kept * 10 > n * 8 && kept * 10 < n * 10);
    const auto report = [&](const char* what, std::vector<double> got,
                            const std::vector<double>& want, double b) {
        const double e = worst(got, want);
        const bool passed = e <= b;
        ok = ok && passed;
        std::printf("  %-28s %-8s %.3e  (bound %.0e) %s\n", name, what, e, b,
                    passed ? "ok" : "FAILED");
    };
    std::vector<double> got_y(n);
    for (size_t i = 0; i < n; ++i) got_y[i] = to_f32(y[i]);
    report("y", got_y, want_y, bound);
    // The gradients are f32 whatever `T` is (from `T`'s gradient, as the reference's).
    report("dsum", std::vector<double>(grad_sum.begin(), grad_sum.end()), want_sum, 1e-5);
    report("dparams", std::vector<double>(grad_params.begin(), grad_params.end()), want_params,
           1e-5);
    return ok;
}

// `a + b` over `n` elements (`add_tensors` in `kernels.cu`) from `offset` elements into the
// buffers (an offset that breaks 16-byte alignment takes the element-a-thread path), on a
// grid smaller than the work, against the sums by hand in f32 rounded once.
template <typename T>
bool check_add(const char* name, size_t n, size_t offset, unsigned grid) {
    std::mt19937_64 rng(7 + n);
    std::uniform_real_distribution<float> u(-4.0f, 4.0f);
    std::vector<T> a(n + offset), b(n + offset), out(n + offset, from_f32<T>(0.0f));
    for (auto& x : a) x = from_f32<T>(u(rng));
    for (auto& x : b) x = from_f32<T>(u(rng));
    emulate_launch({grid, 1, 1}, 64, [&] {
        add_tensors<T>(a.data() + offset, b.data() + offset, out.data() + offset, n);
    });
    size_t wrong = 0;
    for (size_t i = offset; i < n + offset; ++i)
        wrong += !(to_f32(out[i]) == to_f32(from_f32<T>(to_f32(a[i]) + to_f32(b[i]))));
    for (size_t i = 0; i < offset; ++i) wrong += to_f32(out[i]) != 0.0f;
    std::printf("  %-28s %-8s %zu of %zu elements differ %s\n", name, "sum", wrong, n,
                wrong ? "FAILED" : "ok");
    return wrong == 0;
}

// `join_rows` (`kernels.cu`): parts of `sizes` 16-byte pieces (each at its own place in one
// buffer of random bytes) joined into one buffer, against the parts' bytes one after another;
// the output starts as 0xAB bytes and is a piece longer, so a piece left unwritten, written
// twice from the wrong part, or written past the end shows.
bool check_join(const char* name, std::vector<unsigned> sizes, unsigned grid) {
    std::mt19937_64 rng(41 + sizes.size());
    size_t total = 0;
    for (unsigned n : sizes) total += n;
    // The parts a piece apart in their buffer, as tensors of their own would lie.
    std::vector<uint4> src(total + sizes.size());
    for (auto& piece : src) {
        const uint64_t lo = rng(), hi = rng();
        std::memcpy(&piece, &lo, 8);
        std::memcpy(reinterpret_cast<char*>(&piece) + 8, &hi, 8);
    }
    JoinParts parts{};
    parts.count = (int)sizes.size();
    std::vector<const uint4*> firsts;
    size_t at = 0, end = 0;
    for (size_t k = 0; k < sizes.size(); ++k) {
        parts.src[k] = src.data() + at;
        firsts.push_back(src.data() + at);
        end += sizes[k];
        parts.end[k] = end;
        at += sizes[k] + 1;
    }
    std::vector<uint4> dst(total + 1);
    std::memset(dst.data(), 0xAB, dst.size() * sizeof(uint4));
    emulate_launch({grid, 1, 1}, 64, [&] { join_rows(parts, dst.data()); });
    size_t wrong = 0, p = 0;
    for (size_t k = 0; k < sizes.size(); ++k)
        for (unsigned i = 0; i < sizes[k]; ++i, ++p)
            wrong += std::memcmp(&dst[p], firsts[k] + i, sizeof(uint4)) != 0;
    uint4 canary;
    std::memset(&canary, 0xAB, sizeof canary);
    wrong += std::memcmp(&dst[total], &canary, sizeof canary) != 0;
    std::printf("  %-28s %-8s %zu of %zu pieces differ %s\n", name, "join", wrong, total + 1,
                wrong ? "FAILED" : "ok");
    return wrong == 0;
}

// Two steps of the update of a `[3, rows, numel]` state in place against the update by hand
// (`cpu_update.rs`'s f32 arithmetic an element, LAMB's squared norms in f64): the moments to
// the bit, the weights within f32's rounding (the trust ratio's norms summed in another order),
// the trust ratios (`trust_ratios`, on a grid smaller than the rows) against the kernels' own
// partial norms summed by hand, and the parameters set at the second step (a row of each
// element type) as their weights cast. `held`: the kernels read each row's gradient where it is
// held (a row of each element type, times 1/4 as read; the first row absent at the second
// step: `update_moments_held`, `update_one_pass_held`) instead of the bucket's rows, the
// reference the values the bucket would hold.
bool check_update(const char* name, bool lamb, bool decayed, bool held = false) {
    const int rows = 3, numel = 2 * CHUNK + 777;
    const size_t total = (size_t)rows * numel;
    std::mt19937_64 rng(7 + lamb + 2 * decayed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> w(total), m(total, 0.0f), v(total, 0.0f), g(total);
    for (auto& x : w) x = 0.02f * normal(rng);
    std::vector<float> state(3 * total);  // weights, first, second moments
    // The parameters the update sets, a row of each element type.
    std::vector<float> p32(numel, NAN);
    std::vector<bf16> p16(numel);
    std::vector<__half> ph(numel);
    const DeviceTensor params[rows] = {{(uint64_t)p32.data(), ELEMENT_F32, 0},
                                       {(uint64_t)p16.data(), ELEMENT_BF16, 0},
                                       {(uint64_t)ph.data(), ELEMENT_F16, 0}};
    std::copy(w.begin(), w.end(), state.begin());
    const int blocks = (numel + CHUNK - 1) / CHUNK;
    const EmulatedDim grid{(unsigned)blocks, (unsigned)rows, 1};
    size_t moments_differ = 0, weights_off = 0, ratios_wrong = 0, params_differ = 0;
    // The held rows (f32, bf16, f16) and their table.
    std::vector<float> h32(numel);
    std::vector<bf16> h16(numel);
    std::vector<__half> hh(numel);
    DeviceTensor held_rows[rows] = {{(uint64_t)h32.data(), ELEMENT_F32, 0},
                                    {(uint64_t)h16.data(), ELEMENT_BF16, 0},
                                    {(uint64_t)hh.data(), ELEMENT_F16, 0}};
    const float unscale = 0.25f;
    for (int step = 1; step <= 2; ++step) {
        for (auto& x : g) x = 1e-3f * normal(rng);
        if (held) {
            // Each row held in its type (at 4x, as at a loss scale of 4), `g` what the bucket
            // would hold: the held value times 1/4 (exact).
            for (int j = 0; j < numel; ++j) {
                h32[j] = 4.0f * g[j];
                h16[j] = __float2bfloat16(4.0f * g[numel + j]);
                hh[j] = __float2half(4.0f * g[2 * numel + j]);
                g[j] = h32[j] * unscale;
                g[numel + j] = __bfloat162float(h16[j]) * unscale;
                g[2 * numel + j] = __half2float(hh[j]) * unscale;
            }
            if (step == 2) {
                held_rows[0].address = 0;
                std::fill(g.begin(), g.begin() + numel, 0.0f);
            }
        }
        const double b1 = 0.9, b2 = 0.999;
        Constants c{};
        c.clip = 0.5f;
        c.b1 = (float)b1;
        c.one_b1 = (float)(1.0 - b1);
        c.b2 = (float)b2;
        c.one_b2 = (float)(1.0 - b2);
        c.inv_bc1 = (float)(1.0 / (1.0 - std::pow(b1, step)));
        c.inv_bc2 = (float)(1.0 / (1.0 - std::pow(b2, step)));
        c.eps = 1e-6f;
        c.decay = decayed ? 0.01f : 0.0f;
        c.decayed = decayed;
        c.trust_ratio = lamb;
        const float lr = 1e-3f;
        // By hand.
        for (int r = 0; r < rows; ++r) {
            std::vector<float> u(numel);
            double w2 = 0.0, u2 = 0.0;
            for (int j = 0; j < numel; ++j) {
                const size_t i = (size_t)r * numel + j;
                const float gi = g[i] * c.clip;
                m[i] = m[i] * c.b1 + gi * c.one_b1;
                v[i] = v[i] * c.b2 + gi * gi * c.one_b2;
                u[j] = (m[i] * c.inv_bc1) / (sqrtf(v[i] * c.inv_bc2) + c.eps);
                if (decayed) u[j] = u[j] + w[i] * c.decay;
                w2 += (double)w[i] * w[i];
                u2 += (double)u[j] * u[j];
            }
            const double wn = std::sqrt(w2), un = std::sqrt(u2);
            const float ratio = lamb && wn > 0.0 && un > 0.0 ? (float)(wn / un) : 1.0f;
            for (int j = 0; j < numel; ++j) {
                const size_t i = (size_t)r * numel + j;
                w[i] = w[i] - u[j] * ratio * lr;
            }
        }
        // The kernels.
        std::vector<double> norms((size_t)rows * blocks * 2, 0.0);
        const DeviceTensor* set = step == 1 ? nullptr : params;
        if (!lamb) {
            emulate_launch(grid, THREADS, [&] {
                if (held) {
                    update_one_pass_held(state.data(), held_rows, unscale, rows, numel, lr, c,
                                         set);
                } else {
                    update_one_pass(state.data(), g.data(), rows, numel, lr, c, set);
                }
            });
        } else {
            emulate_launch(grid, THREADS, [&] {
                if (held) {
                    update_moments_held(state.data(), held_rows, unscale, norms.data(), rows,
                                        numel, c);
                } else {
                    update_moments(state.data(), g.data(), norms.data(), rows, numel, c);
                }
            });
            std::vector<float> ratios(rows, NAN);
            emulate_launch({2, 1, 1}, THREADS,
                           [&] { trust_ratios(norms.data(), rows, blocks, ratios.data()); });
            for (int r = 0; r < rows; ++r) {
                double w2 = 0.0, u2 = 0.0;
                for (int b = 0; b < blocks; ++b) {
                    w2 += norms[((size_t)r * blocks + b) * 2];
                    u2 += norms[((size_t)r * blocks + b) * 2 + 1];
                }
                const double want = std::sqrt(w2) / std::sqrt(u2);
                ratios_wrong += !(std::fabs(ratios[r] - want) <= 1e-6 * want);
            }
            emulate_launch(grid, THREADS, [&] {
                update_weights(state.data(), rows, numel, lr, c, set, ratios.data());
            });
        }
        for (size_t i = 0; i < total; ++i) {
            moments_differ += !(state[total + i] == m[i]) + !(state[2 * total + i] == v[i]);
            weights_off += !(std::fabs(state[i] - w[i]) <= 1e-6f * std::fabs(w[i]) + 1e-12f);
        }
    }
    // Set at the second step, from its weights.
    for (int j = 0; j < numel; ++j) {
        params_differ += !(p32[j] == state[j]);
        params_differ +=
            __bfloat162float(p16[j]) != __bfloat162float(__float2bfloat16(state[numel + j]));
        params_differ += __half2float(ph[j]) != __half2float(__float2half(state[2 * numel + j]));
    }
    std::printf("  %-28s %-8s %zu of %zu moments differ after 2 steps %s\n", name, "moments",
                moments_differ, 2 * total, moments_differ ? "FAILED" : "ok");
    std::printf("  %-28s %-8s %zu of %zu weights off by more than f32's rounding %s\n", name,
                "weights", weights_off, total, weights_off ? "FAILED" : "ok");
    std::printf("  %-28s %-8s %zu of %zu parameters differ from their weights %s\n", name,
                "params", params_differ, total, params_differ ? "FAILED" : "ok");
    if (lamb)
        std::printf("  %-28s %-8s %zu of %d trust ratios differ from the sums by hand %s\n", name,
                    "ratios", ratios_wrong, 2 * rows, ratios_wrong ? "FAILED" : "ok");
    return moments_differ == 0 && weights_off == 0 && params_differ == 0 && ratios_wrong == 0;
}

// `numel` values from `want` held in a new buffer of `held` as type `T` (`to` rounds each,
// `from` reads it back into `want`, so that `want` is what the buffer holds): its address.
template <typename T, typename To, typename From>
uint64_t held_as(std::vector<std::vector<T>>& held, float* want, size_t numel, To to, From from) {
    held.emplace_back(numel);
    for (size_t j = 0; j < numel; ++j) {
        held.back()[j] = to(want[j]);
        want[j] = from(held.back()[j]);
    }
    return (uint64_t)held.back().data();
}

// Gradients of `shape`'s sizes and element types (-1: absent) held in `f32s`, `bf16s` and
// `f16s`, drawn from `rng` times `scale` (absent ones zeros), as the pieces of one index over
// `flat` (`total` elements, which `values` receives as the gradients hold them).
struct HeldPieces {
    std::vector<std::vector<float>> f32s;
    std::vector<std::vector<bf16>> bf16s;
    std::vector<std::vector<__half>> f16s;
    std::vector<float> flat, values;
    std::vector<Piece> pieces;
    size_t total = 0;

    HeldPieces(const std::vector<std::pair<size_t, int>>& shape, uint64_t seed, float scale) {
        std::mt19937_64 rng(seed);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (auto [numel, type] : shape) total += numel;
        flat.assign(total, NAN);
        values.assign(total, 0.0f);
        f32s.reserve(shape.size());
        bf16s.reserve(shape.size());
        f16s.reserve(shape.size());
        size_t start = 0;
        for (auto [numel, type] : shape) {
            DeviceTensor t{0, type < 0 ? ELEMENT_F32 : type, 0};
            float* v = &values[start];
            for (size_t j = 0; j < numel; ++j) v[j] = type < 0 ? 0.0f : scale * normal(rng);
            if (type == ELEMENT_F32) {
                f32s.emplace_back(v, v + numel);
                t.address = (uint64_t)f32s.back().data();
            } else if (type == ELEMENT_BF16) {
                t.address = held_as(bf16s, v, numel, __float2bfloat16, __bfloat162float);
            } else if (type == ELEMENT_F16) {
                t.address = held_as(f16s, v, numel, __float2half, __half2float);
            }
            pieces.push_back({t, (uint64_t)(flat.data() + start), start, numel});
            start += numel;
        }
    }
};

// The flat buffer `pieces_to_flat` fills, against each piece copied and cast by hand: every
// element written (the buffer starts as NaN), the same bits (the casts to f32 are exact).
bool check_pieces(const char* name, unsigned grid) {
    // (numel, type; -1: absent): pieces inside one block's stretch, across several, empty.
    HeldPieces held({{5, ELEMENT_F32}, {PIECES_CHUNK, ELEMENT_BF16}, {1, ELEMENT_F16},
                     {20000, -1}, {0, ELEMENT_F32}, {3, ELEMENT_F32}, {100, -1},
                     {9000, ELEMENT_F16}, {PIECES_CHUNK - 3, ELEMENT_BF16}, {17, ELEMENT_F32}},
                    11, 1.0f);
    const size_t total = held.total;
    std::vector<float>& flat = held.flat;
    const std::vector<float>& want = held.values;
    const std::vector<Piece>& pieces = held.pieces;
    emulate_launch({grid, 1, 1}, THREADS,
                   [&] { pieces_to_flat(pieces.data(), (int)pieces.size(), total, 1.0f, 0); });
    size_t differ = 0;
    for (size_t i = 0; i < total; ++i) differ += !(flat[i] == want[i]);
    std::printf("  %-28s %-8s %zu of %zu values differ %s\n", name, "made", differ, total,
                differ ? "FAILED" : "ok");
    // The same gradients added again, unscaled by 1/4: only the present pieces, one after
    // another in the kernel's index, each still pointing at its part of the bucket.
    std::vector<Piece> present;
    std::vector<float> sum = want;
    uint64_t index = 0;
    for (const Piece& p : pieces) {
        if (p.tensor.address == 0) continue;
        present.push_back({p.tensor, p.flat, index, p.numel});
        for (size_t j = 0; j < p.numel; ++j) {
            const size_t i = p.start + j;
            sum[i] = want[i] + want[i] * 0.25f;
        }
        index += p.numel;
    }
    emulate_launch({grid, 1, 1}, THREADS, [&] {
        pieces_to_flat(present.data(), (int)present.size(), index, 0.25f, 1);
    });
    size_t added = 0;
    for (size_t i = 0; i < total; ++i) added += !(flat[i] == sum[i]);
    std::printf("  %-28s %-8s %zu of %zu values differ %s\n", name, "added", added, total,
                added ? "FAILED" : "ok");
    return differ == 0 && added == 0;
}

// The bucket's squared norm in two launches (`squares_partial`, `sum_partials`) against the
// squares added in f64 by hand (the order differs: within 1e-12 of the sum).
bool check_squares(const char* name, unsigned blocks) {
    const size_t n = 200000 + 77;
    std::mt19937_64 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> x(n);
    double want = 0.0;
    for (auto& v : x) {
        v = normal(rng);
        want += (double)v * (double)v;
    }
    std::vector<double> partials(blocks, NAN);
    double got = NAN;
    emulate_launch({blocks, 1, 1}, THREADS, [&] { squares_partial(x.data(), n, partials.data()); });
    emulate_launch({1, 1, 1}, THREADS, [&] { sum_partials(partials.data(), (int)blocks, &got); });
    const double error = std::fabs(got - want) / want;
    const bool ok = error < 1e-12;
    std::printf("  %-28s %-8s %.3e  (bound 1e-12) %s\n", name, "norm", error, ok ? "ok" : "FAILED");
    return ok;
}

// The squared norm of held gradients (`pieces_squares_partial`, `sum_partials`): pieces of each
// element type (and absent ones) times `unscale`, against the same in f64 by hand and against
// the bucket `pieces_to_flat` makes from them measured by `squares_partial` (orders differ:
// within 1e-12).
bool check_held_squares(const char* name, unsigned blocks, float unscale) {
    HeldPieces held({{5, ELEMENT_F32}, {PIECES_CHUNK, ELEMENT_BF16}, {1, ELEMENT_F16},
                     {20000, -1}, {0, ELEMENT_F32}, {3, ELEMENT_F32}, {9000, ELEMENT_F16},
                     {3 * PIECES_CHUNK + 11, ELEMENT_BF16}, {17, ELEMENT_F32}},
                    13, 8.0f);
    const size_t total = held.total;
    const std::vector<Piece>& pieces = held.pieces;
    std::vector<float>& flat = held.flat;
    double want = 0.0;
    for (float v : held.values) {
        const double x = v * unscale;
        want += x * x;
    }
    std::vector<double> partials(blocks, NAN), bucket_partials(blocks, NAN);
    double got = NAN, bucket = NAN;
    emulate_launch({blocks, 1, 1}, THREADS, [&] {
        pieces_squares_partial(pieces.data(), (int)pieces.size(), total, unscale, partials.data());
    });
    emulate_launch({1, 1, 1}, THREADS, [&] { sum_partials(partials.data(), (int)blocks, &got); });
    emulate_launch({3, 1, 1}, THREADS, [&] {
        pieces_to_flat(pieces.data(), (int)pieces.size(), total, unscale, 0);
    });
    emulate_launch({blocks, 1, 1}, THREADS,
                   [&] { squares_partial(flat.data(), total, bucket_partials.data()); });
    emulate_launch({1, 1, 1}, THREADS,
                   [&] { sum_partials(bucket_partials.data(), (int)blocks, &bucket); });
    const double error = std::fabs(got - want) / want, from_bucket = std::fabs(got - bucket) / want;
    const bool ok = error < 1e-12 && from_bucket < 1e-12;
    std::printf("  %-28s %-8s %.3e against f64, %.3e against the bucket's  (bound 1e-12) %s\n",
                name, "norm", error, from_bucket, ok ? "ok" : "FAILED");
    return ok;
}

// The negative log-likelihood of `rows` rows of `classes` logits in `T` and its backward
// (`loss.cu`), against the same in f64 from the same inputs.
template <typename T>
bool check_nll(const char* name, int rows, int classes) {
    const int width = classes;
    std::mt19937_64 rng(5 + classes);
    std::uniform_real_distribution<float> u(-4.0f, 4.0f);
    std::vector<T> logits((size_t)rows * width);
    for (size_t i = 0; i < logits.size(); ++i) {
        logits[i] = (int)(i % width) < classes ? from_f32<T>(u(rng)) : from_f32<T>(NAN);
    }
    std::vector<uint32_t> labels(rows);
    std::vector<float> grad(rows);
    for (int r = 0; r < rows; ++r) {
        labels[r] = (uint32_t)((r * 31 + 7) % classes);
        grad[r] = u(rng);
    }
    std::vector<float> nll(rows, NAN), lse(rows, NAN);
    const unsigned threads = std::min(1024u, (unsigned)(((classes + 3) / 4 + 31) / 32 * 32));
    emulate_launch({5, 1, 1}, threads, [&] {
        nll_forward<T>(logits.data(), labels.data(), nll.data(), lse.data(), rows, classes);
    });
    std::vector<T> grad_logits(logits.size(), from_f32<T>(NAN));
    emulate_launch({5, 1, 1}, threads, [&] {
        nll_backward<T>(logits.data(), labels.data(), lse.data(), grad.data(),
                        grad_logits.data(), rows, classes);
    });
    std::vector<double> got_nll(nll.begin(), nll.end()), want_nll(rows), got_grad, want_grad;
    for (int r = 0; r < rows; ++r) {
        const T* x = &logits[(size_t)r * width];
        double m = -INFINITY, s = 0.0;
        for (int c = 0; c < classes; ++c) m = std::max(m, (double)to_f32(x[c]));
        for (int c = 0; c < classes; ++c) s += std::exp(to_f32(x[c]) - m);
        const double l = m + std::log(s);
        want_nll[r] = l - to_f32(x[labels[r]]);
        for (int c = 0; c < width; ++c) {
            got_grad.push_back(to_f32(grad_logits[(size_t)r * width + c]));
            want_grad.push_back(c < classes ? grad[r] * (std::exp(to_f32(x[c]) - l) -
                                                         (c == (int)labels[r]))
                                            : 0.0);
        }
    }
    const double bound = std::is_same<T, float>::value ? 1e-5 : 1e-2;
    bool ok = true;
    for (auto [what, w] : {std::pair{"output", worst(got_nll, want_nll)},
                           std::pair{"dlogits", worst(got_grad, want_grad)}}) {
        const bool passed = w <= bound;
        ok = ok && passed;
        std::printf("  %-28s %-8s %.3e  (bound %.0e) %s\n", name, what, w, bound,
                    passed ? "ok" : "FAILED");
    }
    return ok;
}

}  // namespace

int main() {
    const Case cases[] = {
        {"3 rows (130, 64, 1), eval", {130, 64, 1}, 130, 2, false},
        {"3 rows (130, 64, 1), dropout", {130, 64, 1}, 130, 2, true},
        {"rows of 64, 63 and 200", {64, 63, 200}, 200, 1, true},
        // Masks with holes (a row's first place, places inside and across tiles).
        {"masks with holes, dropout", {150, 90}, 150, 2, true, {{0, 0}, {0, 63}, {0, 64}, {1, 40}}},
        // The same without dropout (the straight forms' entry points without it).
        {"masks with holes, eval", {150, 90}, 150, 2, false, {{0, 0}, {0, 63}, {0, 64}, {1, 40}}},
        // Phase 2's length: eight key tiles, one row ending inside its fifth.
        {"rows of 512 and 300, dropout", {512, 300}, 512, 1, true},
        // BERT-large's heads (hidden 1,024: the keys' and values' columns far into each row).
        {"16 heads, rows of 128, dropout", {128, 97}, 128, 16, true},
        // Rows of at most 128 places (the joint backward): one ending inside the second tile,
        // one of a whole tile, one token, one of padding only; holes in both tiles; one tile.
        {"rows of 100, 64, 1, 0, dropout", {100, 64, 1, 0}, 100, 2, true},
        {"holes, rows of 120, eval", {120, 70}, 120, 2, false, {{0, 0}, {0, 63}, {0, 64}, {1, 40}}},
        {"rows of 50 and 7, dropout", {50, 7}, 50, 3, true},
        // SQuAD's length: six key tiles, the second row ending inside the fourth (the last two
        // padding only), holes in the third.
        {"rows of 384 and 200, holes", {384, 200}, 384, 2, true, {{0, 130}, {0, 191}, {1, 150}}},
    };
    bool ok = true;
    std::printf("one-pass attention (flash.cu) on the CPU emulation against f64:\n");
    for (const auto& c : cases) ok = run(c) && ok;
    std::printf("embedding lookup (gather_rows, kernels.cu) against the rows by hand:\n");
    ok = check_gather<float>("gather_rows f32", 50, 70, 300) && ok;
    ok = check_gather<bf16>("gather_rows bf16", 50, 1030, 200) && ok;
    ok = check_gather<f16>("gather_rows f16", 50, 130, 200) && ok;
    std::printf("a linear layer's end backward (bias_act_backward, kernels.cu) against f64:\n");
    ok = check_bias("bias, 2 chunks", 7, BIAS_CHUNK + 300, 0, 3) && ok;
    ok = check_bias("bias + GELU, 2 chunks", 5, BIAS_CHUNK + 40, 1, 2) && ok;
    ok = check_bias("bias + GELU, one chunk", 9, 1000, 1, 4) && ok;
    std::printf("a linear layer's end 16 bytes a thread (bias_act_rows_forward, bias_sums_vec) against an element a thread:\n");
    ok = check_bias_vec<bf16>("bf16, bias + GELU", 13, 4096, 1, true, 5, 256) && ok;
    ok = check_bias_vec<bf16>("bf16, bias, 2 chunks", 6, BIAS_CHUNK + 64, 0, true, 4, 128) && ok;
    ok = check_bias_vec<bf16>("bf16, bias, 37 rows of 3072", 37, 3072, 0, true, 3, 128) && ok;
    ok = check_bias_vec<float>("f32, bias, 23 rows of 200", 23, 200, 0, true, 2, 64) && ok;
    ok = check_bias_vec<bf16>("bf16, GELU (tanh), no bias", 7, 1024, 2, false, 3, 64) && ok;
    ok = check_bias_vec<f16>("f16, bias + GELU", 9, 768, 1, true, 9, 32) && ok;
    ok = check_bias_vec<float>("f32, bias + GELU (tanh)", 11, 200, 2, true, 4, 32) && ok;
    ok = check_bias_vec<float>("f32, GELU, no bias", 5, 1028, 1, false, 2, 256) && ok;
    // (Rows enough for four a thread ahead in `bias_sums_vec`'s loop with an activation.)
    ok = check_bias_vec<bf16>("bf16, bias + GELU, 37 rows", 37, 2048, 1, true, 3, 256) && ok;
    ok = check_bias_vec<float>("f32, GELU (tanh), 29 rows", 29, 200, 2, false, 2, 64) && ok;
    std::printf("LayerNorm 16 bytes a thread (layer_norm_vec_*, kernels.cu) against the block per row:\n");
    ok = check_norm<bf16>("norm bf16, residual, dropout", 37, 1024, true, true, 5, 8e-3) && ok;
    ok = check_norm<bf16>("norm bf16, plain", 9, 768, false, false, 4, 8e-3) && ok;
    ok = check_norm<float>("norm f32, residual, dropout", 13, 200, true, true, 3, 1e-5) && ok;
    ok = check_norm<f16>("norm f16, residual", 11, 96, true, false, 11, 2e-3) && ok;
    std::printf("the gradients' sum (add_tensors, kernels.cu) against the sums by hand:\n");
    ok = check_add<float>("add f32, aligned", 10007, 0, 3) && ok;
    ok = check_add<float>("add f32, unaligned", 1001, 1, 2) && ok;
    ok = check_add<bf16>("add bf16, aligned", 8 * 1000 + 5, 0, 3) && ok;
    ok = check_add<bf16>("add bf16, unaligned", 999, 3, 2) && ok;
    ok = check_add<f16>("add f16, aligned", 4096, 0, 5) && ok;
    std::printf("tensors joined along their rows (join_rows, kernels.cu) against their bytes:\n");
    // (A layer's three projection weights at BERT-large's size in bf16, 131,072 pieces each;
    // a LayerNorm's weight and bias; parts of one piece; a grid that loops.)
    ok = check_join("three weights, looping", {131072, 131072, 131072}, 7) && ok;
    ok = check_join("two of 128 pieces", {128, 128}, 3) && ok;
    ok = check_join("three small, uneven", {1, 5, 2}, 1) && ok;
    ok = check_join("two, more threads", {3, 700}, 40) && ok;
    std::printf("the keyed dropout (keyed_dropout, kernels.cu) against the keys by hand:\n");
    ok = check_keyed_dropout<bf16>("dropout bf16, packed tokens", 29, 1024, true) && ok;
    ok = check_keyed_dropout<float>("dropout f32, rows", 11, 300, false) && ok;
    ok = check_keyed_dropout<f16>("dropout f16, packed tokens", 13, 96, true) && ok;
    std::printf("the embeddings' end (embeddings_*, kernels.cu) against f64:\n");
    ok = check_embeddings<bf16>("embeddings bf16, dropout", 37, 1024, true, 3, 8e-3) && ok;
    ok = check_embeddings<float>("embeddings f32", 29, 200, false, 2, 1e-5) && ok;
    ok = check_embeddings<f16>("embeddings f16, dropout", 11, 96, true, 4, 2e-3) && ok;
    ok = check_embeddings<bf16>("embeddings bf16, rows of 768", 9, 768, true, 1, 8e-3) && ok;
    std::printf("negative log-likelihood (loss.cu) against f64:\n");
    ok = check_nll<float>("nll f32", 37, 517) && ok;
    ok = check_nll<bf16>("nll bf16", 23, 30522) && ok;
    ok = check_nll<f16>("nll f16", 23, 30522) && ok;
    std::printf("optimiser update in place (cuda_update.cu) against the update by hand:\n");
    ok = check_update("LAMB, decayed", true, true) && ok;
    ok = check_update("LAMB, not decayed", true, false) && ok;
    ok = check_update("AdamW, decayed", false, true) && ok;
    ok = check_update("AdamW, not decayed", false, false) && ok;
    ok = check_update("LAMB, held gradients", true, true, true) && ok;
    ok = check_update("LAMB, held, not decayed", true, false, true) && ok;
    ok = check_update("AdamW, held", false, true, true) && ok;
    std::printf("the gradient bucket in one launch (cuda_update.cu) against copies by hand:\n");
    ok = check_pieces("a block per stretch", 8) && ok;
    ok = check_pieces("two blocks, looping", 2) && ok;
    std::printf("the bucket's squared norm (cuda_update.cu) against f64 by hand:\n");
    ok = check_squares("3 blocks, looping", 3) && ok;
    ok = check_squares("64 blocks", 64) && ok;
    std::printf("held gradients' squared norm (cuda_update.cu) against f64 and the bucket's:\n");
    ok = check_held_squares("3 blocks, looping, 1/4", 3, 0.25f) && ok;
    ok = check_held_squares("64 blocks, unscaled", 64, 1.0f) && ok;
    std::printf(ok ? "all within bounds\n" : "FAILED\n");
    return ok ? 0 : 1;
}
