"""Deterministic parameter values that bertkit's tests and the PyTorch scripts making their
reference fixtures both compute (mirrored by `bertkit_test_support::reference_value`).

Every value is exact in binary up to one f64 rounding of `scale * u`, so Python and Rust agree
bit for bit, in f64 and after a cast to f32. Names are bertkit's (transformers' without the
`bert.` prefix of a model with a head).
"""


def name_hash(name: str) -> int:
    h = 0
    for b in name.encode("utf-8"):
        h = (h * 31 + b) % 65521
    return h


def reference_value(name: str, index: int) -> float:
    x = (index * 2654435761 + name_hash(name) * 40503) % 2**32
    x ^= x >> 15
    x = (x * 2246822519) % 2**32
    x ^= x >> 13
    u = (x >> 16) / 65536.0 - 0.5
    if name.endswith("LayerNorm.weight"):
        return 1.0 + 0.2 * u
    return 0.1 * u


def reference_tensor(torch, name: str, shape, dtype):
    """A torch tensor of `shape` holding `reference_value(name, i)` in row-major order."""
    numel = 1
    for d in shape:
        numel *= d
    values = [reference_value(name, i) for i in range(numel)]
    return torch.tensor(values, dtype=torch.float64).reshape(shape).to(dtype)


def canonical(name: str) -> str:
    """bertkit's name for a transformers parameter name."""
    return name[len("bert."):] if name.startswith("bert.") else name
