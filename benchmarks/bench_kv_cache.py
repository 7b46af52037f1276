"""KV-cache bytes per token for MHA / GQA / MQA / MLA (and window / linear) at one model size.

Read from the cache objects lmforge actually allocates (new_cache), not a formula, and
checked against a worked example (B=1, H=32, L=4096, d_head=128: MHA 64 MiB, MQA 2 MiB per layer
in bf16). Also times a 256-token cached decode of each variant at a small size.

    python benchmarks/bench_kv_cache.py
"""

from __future__ import annotations

import time

import torch

from lmforge.model.cache import KVCache, new_cache
from lmforge.model.config import ModelConfig

SIZE = dict(
    d_model=768,
    n_layer=12,
    n_head=12,
    max_seq_len=4096,
    pos="rope",
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
)  # fmt: skip  (the llama-160m shape)
VARIANTS = {
    "MHA (12 kv heads)": dict(n_kv_head=12),
    "GQA (4 kv heads)": dict(n_kv_head=4),
    "MQA (1 kv head)": dict(n_kv_head=1),
    "MLA (latent 256 + rope 32)": dict(attention="mla", kv_lora_rank=256, qk_rope_head_dim=32),
    "MHA + sliding window 512": dict(sliding_window=512),
    "linear attention (fp32 state)": dict(attention="linear"),  # fixed size: amortised
}


def main() -> None:
    layer = KVCache(1, 1, 32, 4096, 128, torch.bfloat16)
    mqa = KVCache(1, 1, 1, 4096, 128, torch.bfloat16)
    print(f"Worked example, one layer bf16: MHA {layer.nbytes() / 2**20:.0f} MiB "
          f"({layer.k.numel() * 2:,} elements), MQA {mqa.nbytes() / 2**20:.0f} MiB")  # fmt: skip
    length = 4096
    print(f"\nbf16 cache per token at {length} tokens, d_model=768, 12 layers, 12 heads x 64:")
    base = None
    for name, kw in VARIANTS.items():
        config = ModelConfig(**SIZE, **kw)
        cache = new_cache(config, 1, length, torch.bfloat16)
        per_token = cache.nbytes() / length
        base = base or per_token
        print(f"  {name:<30} {per_token:>10,.0f} B/token  {base / per_token:>7.1f}x smaller "
              f"than MHA   ({type(cache).__name__})")  # fmt: skip
    print("\ncached greedy decode of 256 tokens, tiny model (d=128, 4 layers), median of 3:")
    from lmforge.infer.engine import Engine
    from lmforge.infer.params import GenerationParams
    from lmforge.model.transformer import Transformer

    torch.set_num_threads(1)
    small = dict(d_model=128, n_layer=4, n_head=4, max_seq_len=300, vocab_size=256, pos="rope")
    params = GenerationParams(max_new_tokens=256, temperature=0.0)
    for name, kw in VARIANTS.items():
        kw = {**kw, "n_kv_head": {12: 4, 4: 2, 1: 1}[kw.get("n_kv_head", 12)]}  # 4 query heads
        if "kv_lora_rank" in kw:
            kw.update(kv_lora_rank=32, qk_rope_head_dim=16)
        if "sliding_window" in kw:
            kw["sliding_window"] = 64
        model = Transformer(ModelConfig(**small, **kw)).eval()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            Engine(model, max_batch=1, eos_ids=[]).generate([[1, 2, 3]], params)
            times.append(time.perf_counter() - t0)
        print(f"  {name:<30} {sorted(times)[1] * 1e3 / 256:>7.2f} ms/token")


if __name__ == "__main__":
    main()
