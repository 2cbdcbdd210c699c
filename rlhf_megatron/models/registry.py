"""Architecture registry keyed by the HF `architectures` field (never by substring).

An `ArchitectureSpec` says how one HF decoder family maps onto Megatron's GPTModel: which optional
pieces it has (qkv bias, per-head q/k norm) and which config values it cannot express.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_megatron.errors import ConfigError, UnsupportedArchitectureError


@dataclass(frozen=True)
class ArchitectureSpec:
    """How one HF causal-LM architecture becomes a Megatron GPTModel.

    hf_architecture: the exact string in config.json's `architectures` list.
    qkv_bias: given the HF config, whether q/k/v projections carry a bias.
    qk_layernorm: whether q and k get a per-head RMSNorm before RoPE: True (Qwen3), or given the
        HF config (GLM-4.5's `use_qk_norm`); read it through `qk_norm(hf_config)`.
    check_config: raises ConfigError for config values Megatron's GPTModel cannot reproduce.
    mapping_table: (spec, hf_config) -> the architecture's MappingTable (HF <-> Megatron names and
        layouts), used by the converter, the direct HF load and the refit.
    """

    hf_architecture: str
    qkv_bias: Callable[[Any], bool]
    qk_layernorm: bool | Callable[[Any], bool] = False
    check_config: Callable[[Any], None] | None = None
    mapping_table: Callable[[ArchitectureSpec, Any], Any] | None = None

    def qk_norm(self, hf_config: Any) -> bool:
        """Whether this config's q and k get a per-head RMSNorm."""
        if callable(self.qk_layernorm):
            return bool(self.qk_layernorm(hf_config))
        return self.qk_layernorm

    def mapping_table_for(self, hf_config: Any) -> Any:
        """This architecture's `MappingTable` for `hf_config`."""
        if self.mapping_table is None:
            raise UnsupportedArchitectureError(
                f"architecture {self.hf_architecture!r} has no mapping table"
            )
        return self.mapping_table(self, hf_config)


class ArchitectureRegistry:
    """Name -> spec. The package's registry is `ARCHITECTURES`; extensions call `register`."""

    def __init__(self) -> None:
        self._specs: dict[str, ArchitectureSpec] = {}

    def register(self, spec: ArchitectureSpec) -> ArchitectureSpec:
        if spec.hf_architecture in self._specs:
            raise ValueError(f"architecture {spec.hf_architecture!r} is already registered")
        self._specs[spec.hf_architecture] = spec
        return spec

    def names(self) -> list[str]:
        return sorted(self._specs)

    def get(self, hf_architecture: str) -> ArchitectureSpec:
        try:
            return self._specs[hf_architecture]
        except KeyError:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {hf_architecture!r}; supported: {', '.join(self.names())}"
            ) from None

    def for_hf_config(self, hf_config: Any) -> ArchitectureSpec:
        """The spec named by `hf_config.architectures` (exactly one entry expected)."""
        names = list(getattr(hf_config, "architectures", None) or [])
        if len(names) != 1:
            raise UnsupportedArchitectureError(
                f"config.json must name exactly one architecture, got {names!r}; "
                f"supported: {', '.join(self.names())}"
            )
        spec = self.get(names[0])
        if spec.check_config is not None:
            spec.check_config(hf_config)
        return spec


ARCHITECTURES = ArchitectureRegistry()


def uses_mla(hf_config: Any) -> bool:
    """Whether the config describes multi-latent attention (it has a kv_lora_rank: DeepSeek-V3)."""
    return getattr(hf_config, "kv_lora_rank", None) is not None


def require(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless `condition` holds (for `check_config` functions)."""
    if not condition:
        raise ConfigError(message)
