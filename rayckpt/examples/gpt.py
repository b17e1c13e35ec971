"""A small GPT-style language model and deterministic synthetic data for the training job.

Decoder-only: token + learned position embeddings, pre-LayerNorm blocks (causal
multi-head self-attention, GELU MLP), a final LayerNorm and an LM head. There is
no dropout, so a step is a fixed function of the parameters and the batch: a run
resumed from a checkpoint, with any worker count, continues the same trajectory.

The data is generated, never downloaded: the global batch of a step is a fixed
function of ``(seed, step)`` and rank ``r`` of ``W`` takes samples ``r::W``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["GPT", "GPTConfig", "per_rank_batch", "shard_model", "synthetic_batch"]

#: Largest stride of a synthetic sequence; the model learns it from the first two tokens.
MAX_STRIDE = 16
#: Synthetic tokens stay below this id (or the vocab size), so a large-vocab model learns
#: quickly at first (which ids occur), then slowly (how sequences continue).
DATA_ALPHABET = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    """Model shape. The default has about 27M parameters; ``tiny()`` about 110k."""

    vocab_size: int = 8192
    #: Tokens per sample, also the number of learned positions.
    seq_len: int = 128
    d_model: int = 512
    n_layers: int = 6
    n_heads: int = 8
    #: Hidden width of the MLP.
    d_ff: int = 2048
    #: Share the token embedding with the LM head (fewer parameters).
    tie_head: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")

    @classmethod
    def tiny(cls) -> GPTConfig:
        """About 110k parameters: for tests."""
        return cls(vocab_size=64, seq_len=32, d_model=64, n_layers=2, n_heads=4, d_ff=256)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_head:
            self.head.weight = self.tok_emb.weight

    def _init_weights(self) -> None:
        # GPT-2's scheme: N(0, 0.02), residual output projections scaled down by depth.
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = resid_std if name.endswith(("attn.proj", ".out")) else 0.02
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, t, vocab)`` for tokens ``(batch, t)``, ``t <= seq_len``."""
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over every position of every sample."""
        logits = self(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def num_params(self) -> int:
        """Distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())


def shard_model(model: GPT, mesh: DeviceMesh) -> GPT:
    """FSDP2: ``fully_shard`` each block, then the root (embeddings, final norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def per_rank_batch(global_batch: int, world_size: int) -> int:
    """Each of ``world_size`` workers' share of a global batch.

    Raises:
        ValueError: The batch does not split evenly: FSDP averages gradients across ranks, which
            equals the gradient of the global mean loss only when every rank holds as many samples.
    """
    if global_batch % world_size:
        raise ValueError(
            f"global batch {global_batch} is not divisible by {world_size} workers: every worker needs the same "
            f"number of samples for the averaged gradients to equal the global batch's; choose a global batch "
            f"that is a multiple of the worker count"
        )
    return global_batch // world_size


def synthetic_batch(
    step: int, global_batch: int, cfg: GPTConfig, rank: int = 0, world_size: int = 1, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(inputs, targets)`` of the global batch of ``step``, each ``(global_batch // W, cfg.seq_len)``.

    Sample ``i`` is an arithmetic sequence ``start + stride * j (mod A)``, with ``A =
    min(cfg.vocab_size, DATA_ALPHABET)`` and a start and stride drawn from a generator seeded
    by ``(seed, step)``, so the global batch depends on nothing else. Rank ``r`` takes samples ``r::world_size``. The
    batch must split evenly: FSDP averages gradients across ranks, which equals the
    gradient of the global mean loss only when every rank holds as many samples.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    per_rank_batch(global_batch, world_size)
    # The CPU generator keeps 32 bits of its seed: fold the run seed in with a large odd constant.
    gen = torch.Generator().manual_seed((step + seed * 0x9E3779B1) % 2**32)
    seq_len, alphabet = cfg.seq_len, min(cfg.vocab_size, DATA_ALPHABET)
    starts = torch.randint(0, alphabet, (global_batch,), generator=gen)
    strides = torch.randint(1, MAX_STRIDE + 1, (global_batch,), generator=gen)
    starts, strides = starts[rank::world_size], strides[rank::world_size]
    positions = torch.arange(seq_len + 1)
    tokens = (starts[:, None] + strides[:, None] * positions[None, :]) % alphabet
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
