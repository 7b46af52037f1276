"""Wall time of nanoGPT's README CPU recipe: lmforge vs a nanoGPT-equivalent loop, same process.

The reference reproduces what nanoGPT's train.py does on a CPU for
`config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1
--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
--lr_decay_iters=2000 --dropout=0.0`: its GPT (bias-free LayerNorm, fused c_attn, SDPA causal,
GELU MLP, tied head), a fresh np.memmap per batch, AdamW without fused/foreach on CPU, an
evaluation of 20 random batches per split every 250 iterations (iteration 0 included), and
iterations 0..max_iters inclusive. Both runs see the same data and hyper-parameters.

    python benchmarks/bench_pretrain_nanogpt.py [--iters 2000] [--repeats 1]

Prints each wall time, tokens/s, final val loss and the ratio ours / reference (target <= 0.77).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lmforge.data.corpus import shared_data_dir  # noqa: E402
from lmforge.train.config import TrainConfig, build_config  # noqa: E402
from lmforge.train.pretrain import Pretrainer  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "shakespeare-char.yaml"


class RefBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, bias=False)
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.ln_2 = nn.LayerNorm(d, bias=False)
        self.c_fc = nn.Linear(d, 4 * d, bias=False)
        self.mlp_proj = nn.Linear(4 * d, d, bias=False)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class RefGPT(nn.Module):
    def __init__(self, vocab: int, block: int, layers: int, heads: int, d: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(RefBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def reference_run(data_dir: Path, iters: int, vocab: int) -> tuple[float, float]:
    """nanoGPT's train.py loop on CPU. Returns (wall seconds, final val loss)."""
    torch.manual_seed(1337)
    block, batch, eval_iters, eval_interval = 64, 12, 20, 250
    lr, min_lr, warmup = 1e-3, 1e-4, 100

    def get_batch(split):
        data = np.memmap(data_dir / f"{split}.bin", dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - block, (batch,))
        x = torch.stack([torch.from_numpy(data[i : i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block].astype(np.int64)) for i in ix])  # fmt: skip  # noqa: E501
        return x, y

    model = RefGPT(vocab, block, 4, 4, 128)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99))

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = {}
        for split in ("train", "val"):
            losses = [model(*get_batch(split)).item() for _ in range(eval_iters)]
            out[split] = sum(losses) / eval_iters
        model.train()
        return out

    def get_lr(it):
        if it < warmup:
            return lr * (it + 1) / (warmup + 1)
        if it > iters:
            return min_lr
        ratio = (it - warmup) / (iters - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)

    start = time.perf_counter()
    x, y = get_batch("train")
    val = float("nan")
    for it in range(iters + 1):
        for group in opt.param_groups:
            group["lr"] = get_lr(it)
        if it % eval_interval == 0:
            val = estimate_loss()["val"]
        loss = model(x, y)
        x, y = get_batch("train")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # log_interval=1
    return time.perf_counter() - start, val


def ours_run(out_dir: Path, iters: int) -> tuple[float, float, Pretrainer]:
    cfg = build_config(
        TrainConfig, CONFIG,
        {"out_dir": str(out_dir), "max_iters": iters, "lr_decay_iters": iters, "progress": False},
    )  # fmt: skip
    trainer = Pretrainer(cfg, log=lambda *_: None)
    start = time.perf_counter()
    result = trainer.run()
    return time.perf_counter() - start, result["val_loss"], trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if not (shared_data_dir() / "tinyshakespeare.txt").is_file():
        sys.exit(f"skipped: {shared_data_dir() / 'tinyshakespeare.txt'} not found")
    tokens = (args.iters + 1) * 12 * 64
    ours, ref = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            wall, val, trainer = ours_run(Path(tmp) / f"ours{r}", args.iters)
            ours.append(wall)
            print(f"lmforge:   {wall:7.1f} s  {tokens / wall:8,.0f} tok/s  val loss {val:.4f}")
            data_dir = Path(tmp) / f"ours{r}" / "data"
            wall, val = reference_run(data_dir, args.iters, trainer.tokenizer.vocab_size)
            ref.append(wall)
            print(f"reference: {wall:7.1f} s  {tokens / wall:8,.0f} tok/s  val loss {val:.4f}")
    ratio = statistics.median(ours) / statistics.median(ref)
    print(f"wall-time ratio lmforge / nanoGPT-equivalent: {ratio:.2f} (target <= 0.77)")


if __name__ == "__main__":
    main()
