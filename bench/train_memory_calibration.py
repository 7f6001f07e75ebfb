#!/usr/bin/env python3
"""Peak bytes of real training steps on the CPU against `bertkit plan`'s prediction.

Runs `bertkit bench memory` (a few optimiser steps of pipelines/pretrain-phase1.toml with the
binary's allocator counting live bytes) for each setting asked, one process per setting, and
prints measured and predicted peaks side by side. With --fit it also runs each fitting setting
at two micro-batch sizes and prints the per-sequence activation bytes their difference gives
(what plan.rs's coefficients are fitted to).

Usage: bench/train_memory_calibration.py --bertkit target/release/bertkit \\
           --phase1 out/demo/records/phase1 --phase2 out/demo/records/phase2 [--fit] [--only base]
Needs the demo's records (`make demo`).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

# (model, seq, checkpointing, precision, micro-batch)
TABLE = [
    (model, seq, every, precision, micro)
    for model in ("base", "large")
    for seq in (128, 512)
    for every in (0, 1)
    for precision in ("f32", "bf16", "fp16")
    for micro in [{("base", 128): 32, ("base", 512): 4, ("large", 128): 16, ("large", 512): 2}[(model, seq)]]
]


def six_layer_base(folder):
    """A transformers config.json of BERT-base with 6 layers (separates layer from non-layer bytes)."""
    path = os.path.join(folder, "base6.json")
    with open(path, "w") as f:
        json.dump({
            "architectures": ["BertForPreTraining"], "model_type": "bert", "vocab_size": 30522,
            "hidden_size": 768, "num_hidden_layers": 6, "num_attention_heads": 12,
            "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
            "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512,
            "type_vocab_size": 2, "initializer_range": 0.02, "layer_norm_eps": 1e-12,
        }, f)
    return path


def measure(args, model, seq, every, precision, micro, predictions=None, steps=2):
    records = args.phase1 if seq == 128 else args.phase2
    cmd = [args.bertkit, "bench", "memory", "--config", "pipelines/pretrain-phase1.toml",
           "--data", records, "--micro-batch", str(micro), "--precision", precision,
           "--checkpointing", str(every), "--device", "cpu", "--steps", str(steps),
           "--predictions", str(predictions or (20 if seq == 128 else 80)), "--json"]
    cmd += ["--model-config", model] if model.endswith(".json") else ["--preset", model]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bertkit", required=True)
    ap.add_argument("--phase1", required=True)
    ap.add_argument("--phase2", required=True)
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--only", help="a model (base or large) to restrict the table to")
    ap.add_argument("--precisions", default="f32,bf16,fp16", help="comma-separated")
    args = ap.parse_args()
    gib = 1024 ** 3
    if args.fit:
        with tempfile.TemporaryDirectory() as tmp:
            base6 = six_layer_base(tmp)
            print(f"{'setting':<28} {'state GiB':>9} {'bytes/sequence':>15}")
            for precision in ("f32", "bf16"):
                for model, seq, predictions, (m1, m2) in [
                    # Large enough that the activations, not the optimiser's update, make
                    # the peak at both sizes (the fused kernels keep ~5x fewer bytes than
                    # the composed graph these sizes were first chosen for).
                    ("base", 128, 20, (16, 32)), (base6, 128, 20, (16, 32)),
                    ("base", 128, 80, (16, 32)), ("base", 512, 80, (2, 4)),
                ]:
                    a = measure(args, model, seq, 0, precision, m1, predictions)
                    b = measure(args, model, seq, 0, precision, m2, predictions)
                    per = (b["measured_peak_bytes"] - a["measured_peak_bytes"]) / (m2 - m1)
                    name = f"{os.path.basename(model)} s{seq} p{predictions} {precision}"
                    print(f"{name:<28} {a['measured_state_bytes'] / gib:>9.3f} {per:>15.0f}", flush=True)
        return
    print(f"{'model':<6} {'seq':>4} {'ckpt':>4} {'prec':>5} {'micro':>5} {'measured GiB':>12} "
          f"{'predicted GiB':>13} {'error':>7}")
    for model, seq, every, precision, micro in TABLE:
        if (args.only and model != args.only) or precision not in args.precisions.split(","):
            continue
        r = measure(args, model, seq, every, precision, micro)
        m, p = r["measured_peak_bytes"] / gib, r["predicted_peak_bytes"] / gib
        print(f"{model:<6} {seq:>4} {every:>4} {precision:>5} {micro:>5} {m:>12.3f} {p:>13.3f} "
              f"{(p / m - 1) * 100:>+6.1f}%", flush=True)


if __name__ == "__main__":
    main()
