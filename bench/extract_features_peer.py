"""transformers' feature-extraction pipeline on lines of text: the peer of
`bertkit extract-features` (bench/extract_features.sh runs both).

    python extract_features_peer.py MODEL_DIR LINES.txt [--batch 32] [--max-length 128]

Prints one JSON line: lines, tokens, seconds, lines/s. The pipeline returns the last layer's
vector of every token (as Python lists); nothing is written to disk.
"""

import argparse
import json
import time

import torch
from transformers import pipeline


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("lines")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=128)
    args = ap.parse_args()
    with open(args.lines, encoding="utf-8") as f:
        lines = [l.rstrip("\n") for l in f]
    extract = pipeline("feature-extraction", model=args.model, device="cpu")
    cut = {"truncation": True, "max_length": args.max_length}
    extract(lines[:4], batch_size=args.batch, tokenize_kwargs=cut)
    started = time.perf_counter()
    with torch.inference_mode():
        out = extract(lines, batch_size=args.batch, tokenize_kwargs=cut)
    seconds = time.perf_counter() - started
    assert len(out) == len(lines)
    # Batched, the pipeline returns each line padded to its batch's longest: count real tokens.
    tokens = sum(len(ids) for ids in extract.tokenizer(lines, **cut)["input_ids"])
    print(json.dumps({
        "peer": "transformers pipeline('feature-extraction')",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "lines": len(lines),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "lines_per_s": round(len(lines) / seconds, 1),
    }))


if __name__ == "__main__":
    main()
