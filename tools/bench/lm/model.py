"""A small byte-level GPT: 256-symbol embedding, learned positions, pre-norm blocks of causal
self-attention and a 4x MLP, the output head tied to the embedding. Built the same on every
rank from one seed (``build``), so every backend and variant starts from identical weights."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

VOCAB = 256


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    context: int = 128
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def params(self) -> int:
        """Parameter count, without building the model (the harness sizes the link rate by it)."""
        d = self.d_model
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return VOCAB * d + self.context * d + self.layers * block + 2 * d


def build(torch, cfg: ModelConfig):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg.d_model
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, cfg.heads, d // cfg.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class ByteGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, cfg.d_model)
            self.pos = nn.Embedding(cfg.context, cfg.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.layers))
            self.ln = nn.LayerNorm(cfg.d_model)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            return self.ln(x) @ self.tok.weight.t()   # tied head: logits over the 256 byte values

    if cfg.d_model % cfg.heads:
        raise ValueError(f"[bench] d_model {cfg.d_model} is not a multiple of heads {cfg.heads}")
    torch.manual_seed(cfg.seed)
    model = ByteGPT()
    # GPT-2's scaled init of the residual projections keeps early steps stable at any depth.
    for name, p in model.named_parameters():
        if name.endswith(("proj.weight", "out.weight")):
            torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))
        elif p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    return model


def loss_fn(torch, logits, targets):
    """Mean cross-entropy in nats per byte."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
