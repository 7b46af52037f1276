"""Encoder-decoder transformer for translation (Vaswani et al. 2017, "Attention Is All You
Need"), and a built-in synthetic task.

    encoder:  x = Emb(src) + PE;  N × [x += SelfAttn(LN x) (padding mask);  x += FFN(LN x)]
    decoder:  y = Emb(shift_right(tgt)) + PE;
              N × [y += MaskedSelfAttn(LN y);  y += CrossAttn(LN y <- memory);  y += FFN(LN y)]
    logits = W · LN(y)
 Training is teacher forcing: the decoder reads the target shifted right behind <BOS> and predicts
every target token at once. `forward` returns logits (never softmax probabilities: the loss takes
logits, as torch's cross_entropy does) and never modifies its inputs. Decoding, greedy or beam
search, caches the decoder's self-attention keys/values and the cross-attention keys/values of the
memory (computed once per source), so each step costs one token.

The task (`NumberTask`): English number words <-> digits, "three hundred twelve" <-> "312", with
held-out numbers for an honest exact-match score.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.attention import causal_mask
from lmforge.model.cross_attention import CrossAttention
from lmforge.model.feedforward import build_mlp
from lmforge.model.norms import LayerNorm
from lmforge.model.positions import sinusoidal_table


@dataclass
class Seq2SeqConfig:
    vocab_size: int = 64
    d_model: int = 128
    n_head: int = 4
    n_encoder_layer: int = 2
    n_decoder_layer: int = 2
    d_ff: int = 512
    max_len: int = 64
    dropout: float = 0.0
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def to_dict(self) -> dict:
        return asdict(self)


def shift_right(tgt: torch.Tensor, bos_id: int, pad_id: int) -> torch.Tensor:
    """Decoder input: <BOS> then the target without its last token (a new tensor)."""
    bos = torch.full_like(tgt[:, :1], bos_id)
    out = torch.cat([bos, tgt[:, :-1]], dim=1)
    return out.masked_fill(out == -100, pad_id)


class EncoderLayer(nn.Module):
    def __init__(self, c: Seq2SeqConfig):
        super().__init__()
        self.attn_norm, self.mlp_norm = LayerNorm(c.d_model), LayerNorm(c.d_model)
        self.attn = CrossAttention(c.d_model, c.n_head, dropout=c.dropout)
        self.mlp = build_mlp("gelu", c.d_model, c.d_ff, True, c.dropout)

    def forward(self, x, mask):
        x = x + self.attn(self.attn_norm(x), mask=mask)
        return x + self.mlp(self.mlp_norm(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: Seq2SeqConfig):
        super().__init__()
        self.self_norm, self.cross_norm = LayerNorm(c.d_model), LayerNorm(c.d_model)
        self.mlp_norm = LayerNorm(c.d_model)
        self.self_attn = CrossAttention(c.d_model, c.n_head, dropout=c.dropout)
        self.cross_attn = CrossAttention(c.d_model, c.n_head, dropout=c.dropout)
        self.mlp = build_mlp("gelu", c.d_model, c.d_ff, True, c.dropout)

    def forward(self, y, memory_kv, memory_mask, cache: dict | None = None):
        """cache: {"k", "v"} of earlier decoder positions (grown in place) or None (training)."""
        h = self.self_norm(y)
        if cache is None:
            y = y + self.self_attn(h, is_causal=True)
        else:
            k, v = self.self_attn.memory_kv(h)
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
            y = y + self.self_attn(h, mask=causal_mask(h.shape[1], k.shape[2], h.device), kv=(k, v))
        y = y + self.cross_attn(self.cross_norm(y), mask=memory_mask, kv=memory_kv)
        return y + self.mlp(self.mlp_norm(y))


class Seq2Seq(nn.Module):
    """Encoder-decoder transformer with a shared source/target vocabulary and tied embeddings."""

    def __init__(self, config: Seq2SeqConfig):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.register_buffer("pe", sinusoidal_table(c.max_len, c.d_model), persistent=False)
        self.encoder = nn.ModuleList(EncoderLayer(c) for _ in range(c.n_encoder_layer))
        self.decoder = nn.ModuleList(DecoderLayer(c) for _ in range(c.n_decoder_layer))
        self.enc_norm, self.dec_norm = LayerNorm(c.d_model), LayerNorm(c.d_model)
        self.drop = nn.Dropout(c.dropout)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)

    def _embed(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        scale = self.config.d_model**0.5  # Vaswani et al.: embeddings scaled against the PE
        return self.drop(self.embed(ids) * scale + self.pe[start : start + ids.shape[1]])

    def encode(self, src: torch.Tensor):
        """Memory [B,S,d] and its padding mask [B,1,1,S] (True = real token)."""
        mask = (src != self.config.pad_id)[:, None, None, :]
        x = self._embed(src)
        for layer in self.encoder:
            x = layer(x, mask)
        return self.enc_norm(x), mask

    def decode(self, tgt_in, memory, memory_mask, caches=None, start: int = 0):
        y = self._embed(tgt_in, start)
        for i, layer in enumerate(self.decoder):
            kv = caches[i]["memory_kv"] if caches else layer.cross_attn.memory_kv(memory)
            y = layer(y, kv, memory_mask, caches[i] if caches else None)
        return F.linear(self.dec_norm(y), self.embed.weight)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: logits [B, T, vocab] for decoder inputs tgt_in (already shifted)."""
        memory, mask = self.encode(src)
        return self.decode(tgt_in, memory, mask)

    def loss(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of tgt (ending in EOS, padded with -100) under teacher forcing."""
        logits = self(src, shift_right(tgt, self.config.bos_id, self.config.pad_id))
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100)

    def _caches(self, memory):
        return [{"memory_kv": layer.cross_attn.memory_kv(memory)} for layer in self.decoder]

    @torch.no_grad()
    def greedy(self, src: torch.Tensor, max_new_tokens: int = 32) -> list[list[int]]:
        """Greedy decoding with the cache; each row stops at EOS (not included)."""
        c = self.config
        memory, mask = self.encode(src)
        caches = self._caches(memory)
        token = torch.full((src.shape[0], 1), c.bos_id, dtype=torch.long, device=src.device)
        out, done = [], torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        for step in range(min(max_new_tokens, c.max_len)):
            token = self.decode(token, memory, mask, caches, start=step)[:, -1].argmax(-1)
            out.append(token)
            done |= token == c.eos_id
            if bool(done.all()):
                break
            token = token[:, None]
        return [_until_eos(row, c.eos_id) for row in torch.stack(out, 1).tolist()]

    @torch.no_grad()
    def beam_search(
        self, src: torch.Tensor, beam: int = 4, max_new_tokens: int = 32, length_penalty=1.0
    ) -> list[list[int]]:
        """Beam search per source row, with the cache; score = log p / length^length_penalty."""
        return [self._beam_one(src[i : i + 1], beam, max_new_tokens, length_penalty)
                for i in range(src.shape[0])]  # fmt: skip

    def _beam_one(self, src, beam, max_new_tokens, alpha) -> list[int]:
        c = self.config
        memory, mask = self.encode(src)
        memory, mask = memory.expand(beam, -1, -1), mask.expand(beam, -1, -1, -1)
        caches = self._caches(memory)
        seqs = [[] for _ in range(beam)]
        scores = torch.full((beam,), float("-inf"), device=src.device)
        scores[0] = 0.0  # all beams start identical: expand only the first
        token = torch.full((beam, 1), c.bos_id, dtype=torch.long, device=src.device)
        finished: list[tuple[float, list[int]]] = []
        for step in range(min(max_new_tokens, c.max_len)):
            logp = self.decode(token, memory, mask, caches, start=step)[:, -1].log_softmax(-1)
            total = (scores[:, None] + logp).flatten()
            top, idx = total.topk(2 * beam)
            rows, toks = idx // logp.shape[-1], idx % logp.shape[-1]
            keep_rows, keep_toks, keep_scores = [], [], []
            for s, r, t in zip(top.tolist(), rows.tolist(), toks.tolist()):
                if t == c.eos_id:
                    finished.append((s / (len(seqs[r]) + 1) ** alpha, seqs[r]))
                elif len(keep_rows) < beam:
                    keep_rows.append(r), keep_toks.append(t), keep_scores.append(s)
            best_open = max(keep_scores) / (step + 2) ** alpha if keep_scores else float("-inf")
            if len(finished) >= beam and max(f[0] for f in finished) >= best_open:
                break
            index = torch.tensor(keep_rows, device=src.device)
            for cache in caches:  # reorder the self-attention cache to the surviving beams
                cache["k"], cache["v"] = cache["k"][index], cache["v"][index]
            seqs = [seqs[r] + [t] for r, t in zip(keep_rows, keep_toks)]
            scores = torch.tensor(keep_scores, device=src.device)
            token = torch.tensor(keep_toks, device=src.device)[:, None]
        if not finished:
            finished = [(scores[0].item(), seqs[0])]
        return max(finished, key=lambda f: f[0])[1]


def _until_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos)] if eos in row else row


# ---- the built-in task: number words <-> digits ---------------------------------------------
ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
        "fifteen sixteen seventeen eighteen nineteen").split()  # fmt: skip
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """English words for 0 <= n < 1,000,000 ("three hundred twelve", no "and")."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else " " + ONES[n % 10])
    if n < 1000:
        rest = "" if n % 100 == 0 else " " + number_words(n % 100)
        return ONES[n // 100] + " hundred" + rest
    rest = "" if n % 1000 == 0 else " " + number_words(n % 1000)
    return number_words(n // 1000) + " thousand" + rest


class NumberTask:
    """Words -> digits (or digits -> words with reverse=True) over [0, max_number), with a fixed
    random split of held-out numbers. Tokens: specials, then the 10 digits, then the words."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self, max_number: int = 10000, test_fraction: float = 0.1, seed: int = 0,
                 reverse: bool = False):  # fmt: skip
        words = [*ONES, *TENS[2:], "hundred", "thousand"]
        self.vocab = [*self.SPECIALS, *"0123456789", *words]
        self.index = {tok: i for i, tok in enumerate(self.vocab)}
        numbers = list(range(max_number))
        random.Random(seed).shuffle(numbers)
        n_test = max(1, int(len(numbers) * test_fraction))
        self.test, self.train = numbers[:n_test], numbers[n_test:]
        self.reverse = reverse

    def pair(self, n: int) -> tuple[list[int], list[int]]:
        words = [self.index[w] for w in number_words(n).split()]
        digits = [self.index[d] for d in str(n)]
        return (digits, words) if self.reverse else (words, digits)

    def batch(self, numbers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """src [B,S] padded with <pad>, tgt [B,T] ending in <eos>, padded with -100."""
        pairs = [self.pair(n) for n in numbers]
        s, t = max(len(p[0]) for p in pairs), max(len(p[1]) for p in pairs) + 1
        src = torch.zeros(len(pairs), s, dtype=torch.long)
        tgt = torch.full((len(pairs), t), -100, dtype=torch.long)
        for i, (a, b) in enumerate(pairs):
            src[i, : len(a)] = torch.tensor(a)
            tgt[i, : len(b) + 1] = torch.tensor([*b, 2])
        return src, tgt

    def decode(self, ids: list[int]) -> str:
        return (" " if self.reverse else "").join(self.vocab[i] for i in ids)

    def translation_accuracy(self, model: Seq2Seq, numbers: list[int], beam: int = 1) -> float:
        """Fraction of `numbers` translated exactly (greedy, or beam search if beam > 1)."""
        model.eval()
        hits = 0
        for i in range(0, len(numbers), 256):
            chunk = numbers[i : i + 256]
            src, _ = self.batch(chunk)
            outs = model.beam_search(src, beam) if beam > 1 else model.greedy(src)
            hits += sum(out == self.pair(n)[1] for out, n in zip(outs, chunk))
        return hits / len(numbers)
