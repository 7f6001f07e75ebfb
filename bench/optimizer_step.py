#!/usr/bin/env python3
"""The optimiser step alone on BERT-base's parameters: bertkit beside PyTorch, alternated.

bertkit: `bertkit bench optimizer --config base --rule adamw|lamb` (gradient flattening, the
global norm, clipping and the update; f32 master weights and moments). PyTorch: AdamW
(foreach, its default on the CPU) with `clip_grad_norm_` over tensors of the same shapes,
`torch.set_num_threads` = the machine's cores. PyTorch has no LAMB; the LAMB row has no peer.

Usage: bench/optimizer_step.py --bertkit target/release/bertkit --python PY [--rounds 3]
(PY: a Python with torch.)
"""
import argparse
import re
import subprocess

TORCH = r"""
import time, torch
torch.manual_seed(0)
torch.set_num_threads({threads})
h, i, v, layers = 768, 3072, 30522, 12
shapes = [(v, h), (512, h), (2, h), (h,), (h,)]
for _ in range(layers):
    shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (i, h), (i,), (h, i), (h,), (h,), (h,)]
shapes += [(h, h), (h,), (h, h), (h,), (h,), (h,), (v,), (2, h), (2,)]
params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
for p in params:
    p.grad = torch.randn(p.shape) * 1e-3
decay = [p for p in params if p.dim() > 1]
rest = [p for p in params if p.dim() == 1]
opt = torch.optim.AdamW([{{"params": decay, "weight_decay": 0.01}},
                         {{"params": rest, "weight_decay": 0.0}}], lr=1e-4, eps=1e-6)
times = []
for n in range({steps} + 1):
    t = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    if n:
        times.append(time.perf_counter() - t)
times.sort()
print(sum(p.numel() for p in params), times[len(times) // 2], times[0])
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bertkit", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(f"{'round':>5} {'bertkit adamw ms':>17} {'torch adamw ms':>15} {'ratio':>6} {'bertkit lamb ms':>16}")
    for r in range(args.rounds):
        def ours(rule):
            out = subprocess.run([args.bertkit, "bench", "optimizer", "--config", "base", "--rule",
                                  rule, "--steps", str(args.steps)], capture_output=True, text=True,
                                 check=True).stdout
            return float(re.search(r"median ([0-9.]+) ms", out).group(1))
        adamw = ours("adamw")
        out = subprocess.run([args.python, "-c", TORCH.format(threads=args.threads, steps=args.steps)],
                             capture_output=True, text=True, check=True).stdout.split()
        torch_ms = float(out[1]) * 1e3
        lamb = ours("lamb")
        print(f"{r + 1:>5} {adamw:>17.1f} {torch_ms:>15.1f} {torch_ms / adamw:>6.2f} {lamb:>16.1f}",
              flush=True)
    print(f"(torch parameters: {out[0]})")


if __name__ == "__main__":
    main()
