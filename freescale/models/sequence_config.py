"""`ModelConfig`: the reference sequence model's options and their checks
(`freescale.models.sequence` builds the model, `freescale.models.blocks` its
blocks; both read this)."""

from __future__ import annotations

from dataclasses import dataclass

from freescale.kernels.attention.cross import HEAD_DIMS
from freescale.models.attention import CROSS_IMPLS, IMPLS
from freescale.models.contract import check_objective
from freescale.models.dropout import check_rate


@dataclass(frozen=True)
class ModelConfig:
    """The options of the reference sequence model (`sequence.build` takes them by name)."""

    num_items: int = 10_000
    num_actions: int = 4
    dim: int = 64
    heads: int = 2
    layers: int = 2
    mlp_ratio: int = 2
    dense_dim: int = 0
    # auto | reference | varlen | cudnn (`freescale.models.attention`): auto is
    # reference on the CPU; on CUDA cudnn for the causal self-attention where it
    # runs (sm90+, nvidia-cudnn-frontend installed), else varlen
    attention: str = "auto"
    # auto | reference | varlen | triton: the candidate -> UIH cross-attention
    # (`attention.cross_attention_impl`): auto is triton on CUDA unless
    # attention is reference or varlen, which it then follows
    cross_attention: str = "auto"
    # dropout (`freescale.models.dropout`, training steps only): on the history's
    # embeddings, on each block's attention output and MLP output
    emb_dropout: float = 0.0
    attn_dropout: float = 0.0
    ffn_dropout: float = 0.0
    # the training loss (`RecModel.loss`): bce per candidate, or softmax over
    # each sample's candidates (one positive against its sampled negatives)
    loss: str = "bce"

    def __post_init__(self) -> None:
        for name in ("emb_dropout", "attn_dropout", "ffn_dropout"):
            check_rate(name, getattr(self, name))
        check_objective(self.loss)
        for name in ("num_items", "num_actions", "dim", "heads", "layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"model dim ({self.dim}) must be divisible by heads ({self.heads})")
        if self.dense_dim < 0:
            raise ValueError("model dense_dim must be >= 0")
        if self.attention not in IMPLS:
            raise ValueError(
                f"model attention must be one of {', '.join(IMPLS)}; got {self.attention!r}"
            )
        if self.cross_attention not in CROSS_IMPLS:
            raise ValueError(
                f"model cross_attention must be one of {', '.join(CROSS_IMPLS)}; "
                f"got {self.cross_attention!r}"
            )
        if self.cross_attention == "triton" and self.dim // self.heads not in HEAD_DIMS:
            raise ValueError(
                f"model.cross_attention=triton needs a head dim (model.dim / model.heads) "
                f"in {HEAD_DIMS}, got {self.dim // self.heads}"
            )
        if self.attention == "cudnn":
            from freescale.kernels.attention.cudnn_sdpa import head_dim_problem

            why = head_dim_problem(self.dim // self.heads)
            if why:
                raise ValueError(f"model.attention=cudnn needs {why}: model.dim / model.heads")
