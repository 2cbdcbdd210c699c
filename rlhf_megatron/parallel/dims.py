"""ParallelDims: the parallel layout of one engine, validated up front.

Megatron's rank order is tp-cp-ep-dp-pp; dp is derived: world = tp * cp * pp * dp.
(EP shares ranks with DP for MoE layers, so it must divide dp * cp; no dense model here uses it.)
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_megatron.errors import LayoutError


@dataclass(frozen=True)
class ParallelDims:
    """A validated parallel layout.

    world_size: number of ranks of this engine.
    tp: tensor-parallel size (splits attention heads and the FFN).
    pp: pipeline-parallel size (splits layers).
    vpp: virtual pipeline stages per rank (interleaved 1F1B), or None.
    cp: context-parallel size (splits each sequence; TE attention on GPU, else the SDPA
        all-gather-KV attention, models/sdpa_cp.py).
    ep: expert-parallel size (MoE only).
    dp: data-parallel size, derived as world_size // (tp * cp * pp).
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name}={value!r} must be a positive integer")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise LayoutError(f"vpp={self.vpp!r} must be a positive integer or None")
            if self.pp < 2 and self.vpp > 1:
                raise LayoutError(f"vpp={self.vpp} needs pp >= 2 (got pp={self.pp})")
        model_parallel = self.tp * self.cp * self.pp
        if self.world_size % model_parallel:
            raise LayoutError(
                f"world size {self.world_size} is not divisible by tp*cp*pp = "
                f"{self.tp}*{self.cp}*{self.pp} = {model_parallel}"
            )
        if (self.dp * self.cp) % self.ep:
            raise LayoutError(f"ep={self.ep} must divide dp*cp = {self.dp}*{self.cp}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def virtual_stages(self) -> int:
        return self.vpp or 1

    def validate_for_model(
        self, *, num_attention_heads: int, num_key_value_heads: int, num_layers: int
    ) -> None:
        """Check that the model's shapes split evenly over this layout."""
        if num_attention_heads % self.tp:
            raise LayoutError(
                f"num_attention_heads={num_attention_heads} is not divisible by tp={self.tp}"
            )
        if num_key_value_heads % self.tp:
            raise LayoutError(
                f"num_key_value_heads={num_key_value_heads} is not divisible by tp={self.tp}"
            )
        stages = self.pp * self.virtual_stages
        if num_layers % stages:
            raise LayoutError(
                f"num_layers={num_layers} is not divisible by pp*vpp = "
                f"{self.pp}*{self.virtual_stages} = {stages}"
            )

    def validate_for_platform(self, *, supports_context_parallel: bool, device_type: str) -> None:
        """For callers that require TE's context parallelism. `initialize_layout` no longer calls
        this: without TE, cp > 1 runs on the SDPA attention's all-gather-KV path."""
        if self.cp > 1 and not supports_context_parallel:
            raise LayoutError(
                f"cp={self.cp} needs Transformer Engine attention on CUDA; "
                f"this platform is {device_type} (use cp=1)"
            )

    def describe(self) -> str:
        vpp = f" vpp={self.vpp}" if self.vpp else ""
        return f"tp={self.tp} pp={self.pp}{vpp} cp={self.cp} ep={self.ep} dp={self.dp}"
