"""PyTorch + transformers doing what `bench/gpu/side_by_side.sh` has bertkit do, on the same
device and shapes: one JSON line per measurement on stdout.

    python torch_peer.py pretrain --config large --seq 128 --batch 64 --predictions 20 --steps 12
    python torch_peer.py infer    --config large --seq 128 --batch 64
    python torch_peer.py squad    --config large --seq 384 --batch 32 --steps 20
    python torch_peer.py glue     --config large --seq 128 --batch 32 --steps 20
    python torch_peer.py forward  --model DIR --input ids.safetensors --bertkit out.safetensors

Each runs on `--device` (cuda by default; cpu for a dry run of the plumbing), `--dtype` bf16 by
default: training under autocast with f32 master weights (as bertkit's mixed precision keeps
them), inference with the weights in bf16. Attention is PyTorch's SDPA, what transformers uses
by default. Pre-training computes the masked-LM head on the masked positions only (gathered,
as bertkit and NVIDIA's recipe do; transformers' stock head would compute all positions) and
uses AdamW (fused on CUDA). Speeds are medians over the steps after `--warmup`.
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import (
    BertConfig,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertModel,
)

SIZES = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


def config(name, seq):
    if name in SIZES:
        c = BertConfig(**SIZES[name], max_position_embeddings=max(512, seq))
    else:
        c = BertConfig.from_json_file(name)
    c._attn_implementation = "sdpa"
    return c


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_bytes(device):
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else None


def timed(steps, warmup, device, step):
    """Median seconds of `step()` over the steps after `warmup`."""
    seconds = []
    for i in range(steps):
        sync(device)
        started = time.perf_counter()
        step(i)
        sync(device)
        if i >= warmup:
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def emit(**fields):
    fields["torch"] = torch.__version__
    print(json.dumps(fields), flush=True)


def pretrain(args, device):
    c = config(args.config, args.seq)
    model = BertForPreTraining(c).to(device).train()
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(5, c.vocab_size, (args.batch, args.seq), generator=g).to(device)
    types = torch.zeros_like(ids)
    mask = torch.ones_like(ids)
    positions = torch.stack(
        [torch.randperm(args.seq - 2, generator=g)[: args.predictions] + 1 for _ in range(args.batch)]
    ).to(device)
    labels = torch.randint(5, c.vocab_size, (args.batch, args.predictions), generator=g).to(device)
    nsp = torch.randint(0, 2, (args.batch,), generator=g).to(device)
    dtype = getattr(torch, args.dtype)

    def step(_):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = model.bert(input_ids=ids, token_type_ids=types, attention_mask=mask)
            hidden = out.last_hidden_state
            picked = torch.gather(hidden, 1, positions.unsqueeze(-1).expand(-1, -1, hidden.size(-1)))
            mlm = model.cls.predictions(picked)
            nsp_logits = model.cls.seq_relationship(out.pooler_output)
            loss = F.cross_entropy(mlm.float().reshape(-1, c.vocab_size), labels.reshape(-1)) + F.cross_entropy(
                nsp_logits.float(), nsp
            )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = timed(args.steps, args.warmup, device, step)
    emit(work="pretrain", seq=args.seq, batch=args.batch, dtype=args.dtype,
         seq_per_s=round(args.batch / seconds, 2), step_seconds=round(seconds, 4),
         peak_bytes=peak_bytes(device))


def infer(args, device):
    c = config(args.config, args.seq)
    dtype = getattr(torch, args.dtype)
    model = BertModel(c).to(device=device, dtype=dtype).eval()
    ids = torch.randint(5, c.vocab_size, (args.batch, args.seq)).to(device)

    def step(_):
        with torch.inference_mode():
            model(input_ids=ids)

    seconds = timed(args.steps, args.warmup, device, step)
    emit(work="infer", seq=args.seq, batch=args.batch, dtype=args.dtype,
         seq_per_s=round(args.batch / seconds, 2), peak_bytes=peak_bytes(device))


def finetune(args, device, work, model, targets):
    """Fine-tuning steps of `model` on random ids of the asked shape, `targets` (the forward's
    label arguments, made from a generator) its labels: AdamW, fused on CUDA."""
    model = model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-5, fused=device.type == "cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(5, vocab, (args.batch, args.seq), generator=g).to(device)
    labels = {k: v(g).to(device) for k, v in targets.items()}
    dtype = getattr(torch, args.dtype)

    def step(_):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=ids, **labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = timed(args.steps, args.warmup, device, step)
    emit(work=work, seq=args.seq, batch=args.batch, dtype=args.dtype,
         steps_per_s=round(1 / seconds, 3), windows_per_s=round(args.batch / seconds, 2),
         peak_bytes=peak_bytes(device))


def squad(args, device):
    positions = lambda g: torch.randint(0, args.seq, (args.batch,), generator=g)
    finetune(args, device, "squad", BertForQuestionAnswering(config(args.config, args.seq)),
             {"start_positions": positions, "end_positions": positions})


def glue(args, device):
    """MRPC's shape: pairs of sentences padded to `--seq` (run_glue.py's default), 2 labels."""
    c = config(args.config, args.seq)
    c.num_labels = 2
    classes = lambda g: torch.randint(0, 2, (args.batch,), generator=g)
    finetune(args, device, "glue", BertForSequenceClassification(c), {"labels": classes})


def forward(args, device):
    from safetensors.torch import load_file

    model = BertModel.from_pretrained(args.model, attn_implementation="sdpa").to(device).eval()
    inputs = load_file(args.input)
    mask = inputs["attention_mask"].to(device)
    with torch.inference_mode():
        out = model(input_ids=inputs["input_ids"].to(device), attention_mask=mask,
                    token_type_ids=inputs.get("token_type_ids", torch.zeros_like(mask)).to(device))
    theirs = load_file(args.bertkit)["last_hidden_state"].to(device).float()
    real = mask.bool()
    diff = (out.last_hidden_state.float()[real] - theirs[real]).abs().max().item()
    emit(work="forward", max_abs_diff=diff, tokens=int(real.sum().item()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work", choices=["pretrain", "infer", "squad", "glue", "forward"])
    ap.add_argument("--config", default="large")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--predictions", type=int, default=20)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model")
    ap.add_argument("--input")
    ap.add_argument("--bertkit")
    args = ap.parse_args()
    args.dtype = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}.get(args.dtype, args.dtype)
    device = torch.device(args.device)
    torch.manual_seed(0)
    works = {"pretrain": pretrain, "infer": infer, "squad": squad, "glue": glue, "forward": forward}
    works[args.work](args, device)


if __name__ == "__main__":
    main()
