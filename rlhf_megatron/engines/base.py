"""MegatronEngine: one model on the current parallel layout, plus (when trainable) Megatron DDP,
the Megatron optimizer and an LR schedule. Actor, reference, critic and reward model build on it.

The engine runs every pass through Megatron's pipeline schedules (no-pipelining, 1F1B, or
interleaved 1F1B), over micro-batches cut by rows or by a token budget, optionally packed.
It holds no Ray: a worker owns the process, initialises the layout and calls these methods.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.data.packing import (
    PackedRows,
    block_causal_mask,
    pack_rows,
    round_up,
    split_by_token_budget,
)
from rlhf_megatron.engines.checkpoint import (
    load_chunk_weights,
    load_engine_checkpoint,
    save_engine_checkpoint,
    unwrap,
)
from rlhf_megatron.engines.chunked_logprobs import HiddenStates, emit_hidden_states, output_weight
from rlhf_megatron.engines.config import EngineConfig, distributed_optimizer_enabled
from rlhf_megatron.engines.context_parallel import CpSplit, context_parallel_group
from rlhf_megatron.engines.offload import Offloader, engine_state_tensors
from rlhf_megatron.engines.optimizer_state import install_state_initialiser
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.models import ARCHITECTURES, build_model_chunks, hf_to_megatron_args
from rlhf_megatron.models.builder import packs_by_cu_seqlens
from rlhf_megatron.models.checkpoint_meta import (
    ConvertedMetadata,
    adapters_only_refusal,
    base_weights_dir,
    check_adapters_base,
    is_megatron_checkpoint,
)
from rlhf_megatron.models.hf_checkpoint import load_hf_config
from rlhf_megatron.models.megatron_layout import global_layer_name, layer_offset_of, mapped_tensors
from rlhf_megatron.parallel import ParallelDims
from rlhf_megatron.platform import current_platform

logger = logging.getLogger(__name__)

# loss_fn(micro_batch, output_tensor) -> (loss for backward, per-micro-batch results)
LossFn = Callable[["MicroBatch", torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


@dataclass
class MicroBatch:
    """One micro-batch as Megatron consumes it.

    rows: the TokenBatch rows it holds, trimmed to their longest real length.
    tokens / position_ids: (b, s), or (1, T) when packed.
    attention_mask: None (plain causal) or (1, 1, T, T) bool, True = masked (packed, unfused
        attention only).
    packed: the packing bookkeeping, or None.
    packed_seq_params: Megatron's PackedSeqParams for THD attention (packed, TE or SDPA).
    cp: with context parallelism, this CP rank's share of the sequence dimension; tokens and
        position_ids then hold only this rank's (b, s / cp) or (1, T / cp) positions, and
        full_tokens the whole (b, s) / (1, T) sequence (each row or packed row padded to a
        multiple of 2*cp). None (and full_tokens = tokens) without CP.
    """

    rows: TokenBatch
    tokens: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    packed: PackedRows | None
    packed_seq_params: Any = None
    cp: CpSplit | None = None
    full_tokens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.full_tokens is None:
            self.full_tokens = self.tokens


class MegatronEngine:
    """A Megatron GPT model on this rank's shard of the current layout.

    hf_dir: HF checkpoint to load (directly into shards, through the mapping table), or a
        Megatron dist-checkpoint (from `checkpoint_tools hf-to-mcore` or an engine's
        `save_checkpoint`), recognised by its `rlhf_megatron_checkpoint.json`.
    dims: the layout; `initialize_layout(dims)` must have run in this process.
    trainable: wrap in DDP and build the optimizer and LR schedule.
    """

    def __init__(
        self, config: EngineConfig, *, hf_dir: str | Path, dims: ParallelDims, trainable: bool
    ) -> None:
        from megatron.core import parallel_state

        config.validate()
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("initialize_layout(dims) must run before an engine is built")
        self.config, self.dims, self.trainable = config, dims, trainable
        self.platform = current_platform()
        self.hf_dir = Path(hf_dir)
        # 1. HF config -> Megatron config for this layout (validates the layout against it).
        self.hf_config = self._load_hf_config(self.hf_dir)
        spec = ARCHITECTURES.for_hf_config(self.hf_config)
        self.args = hf_to_megatron_args(
            self.hf_config, spec, dims, params_dtype=config.params_dtype,
            max_sequence_length=config.max_sequence_length,
            recompute_activations=config.recompute_activations,
            cp_comm_type=config.cp_comm_type,
            local_spec=config.lora is not None,
        )
        self.vocab_size = self.args.vocab_size
        # Actor and reference read the last stage's hidden states out in chunks of tokens
        # (engines/chunked_logprobs.py); the critic's value head has no vocabulary to chunk.
        self.reads_hidden_states = False
        self.is_moe = bool(getattr(self.args.transformer_config, "num_moe_experts", None))
        if config.moe_aux_loss_coeff is not None:
            self._override_aux_loss_coeff(config.moe_aux_loss_coeff)
        # 2. Build this rank's chunks and fill them from the HF checkpoint.
        self.chunks = self._build_chunks()
        # 3. Trainable engines: DDP (fp32 main grads), optimizer, LR schedule.
        self.optimizer = self.scheduler = None
        self._offloader = Offloader(platform=self.platform)
        if trainable:
            self._wrap_for_training()
        else:
            for chunk in self.chunks:
                chunk.requires_grad_(False)
                chunk.eval()

    # ------------------------------------------------------------------ building
    def _override_aux_loss_coeff(self, coeff: float) -> None:
        """engine.moe_aux_loss_coeff replaces the HF config's router_aux_loss_coef."""
        if not self.is_moe:
            raise ConfigError("engine.moe_aux_loss_coeff is set but the model has no experts")
        tc = self.args.transformer_config
        tc.moe_aux_loss_coeff = coeff
        tc.moe_router_load_balancing_type = "aux_loss" if coeff > 0 else "none"

    @property
    def from_dist_checkpoint(self) -> bool:
        return is_megatron_checkpoint(self.hf_dir)

    def _load_hf_config(self, hf_dir: Path) -> Any:
        if self.from_dist_checkpoint:
            return ConvertedMetadata.read(hf_dir).hf_config_object()
        return load_hf_config(hf_dir)

    def _build_chunks(self) -> list[Any]:
        """Base weights from `base_dir` (HF or dist-checkpoint), then a LoRA actor's adapters:
        drawn fresh, or loaded when `hf_dir` is a LoRA run's checkpoint. An adapter-only
        checkpoint names its base (checked by fingerprint), which becomes `base_dir`."""
        from rlhf_megatron.models.hf_load import load_hf_into_model

        chunks = build_model_chunks(self.args)
        source = ConvertedMetadata.read(self.hf_dir) if self.from_dist_checkpoint else None
        self.base_dir = base_weights_dir(self.hf_dir)
        if self.base_dir != self.hf_dir:
            if not self._has_adapters:
                raise ConfigError(adapters_only_refusal(self.hf_dir))
            check_adapters_base(self.hf_dir, self.base_dir)
        if is_megatron_checkpoint(self.base_dir):
            load_chunk_weights(chunks, self.base_dir)
        else:
            load_hf_into_model(chunks, self.base_dir, self.args)
        self._apply_lora(chunks)
        if self._has_adapters and source is not None and source.lora is not None:
            load_chunk_weights(chunks, self.hf_dir, adapters_only=True)
        return self._to_device(chunks)

    @property
    def _has_adapters(self) -> bool:
        return self.config.lora is not None and self.trainable

    def _apply_lora(self, chunks: list[Any]) -> None:
        if not self._has_adapters:
            return
        from rlhf_megatron.models.lora import apply_lora

        apply_lora(chunks, self.config.lora, seed=self.config.seed)

    def _to_device(self, chunks: list[Any]) -> list[Any]:
        from megatron.core.transformer.module import Float16Module

        if self.platform.is_cuda:
            chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
        if self.config.params_dtype != torch.float32:
            # Float16Module casts inputs to bf16/fp16 and the last stage's outputs back to fp32.
            chunks = [Float16Module(self.args.transformer_config, chunk) for chunk in chunks]
        return chunks

    def _wrap_for_training(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer


        opt = self.config.optimizer
        distributed_optimizer = distributed_optimizer_enabled(opt, self.platform)
        if opt.use_distributed_optimizer and not distributed_optimizer:
            logger.info("optimizer %s on %s: the plain optimizer (Megatron's distributed "
                        "optimizer needs CUDA and Adam)", opt.name, self.platform.device_type)
        tc = self.args.transformer_config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=distributed_optimizer,
        )
        self.chunks = [
            # Megatron buckets only the first chunk (its convention for interleaved pipelines).
            DistributedDataParallel(tc, ddp_config, chunk, disable_bucketing=index > 0)
            for index, chunk in enumerate(self.chunks)
        ]
        optimizer_config = OptimizerConfig(
            optimizer=opt.name, lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
            adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
            sgd_momentum=opt.sgd_momentum, clip_grad=opt.clip_grad,
            bf16=tc.bf16, fp16=tc.fp16, params_dtype=tc.params_dtype,
            use_distributed_optimizer=distributed_optimizer,
            # Megatron's HybridDeviceOptimizer: master weights + moments stepped on the host.
            optimizer_cpu_offload=opt.cpu_offload and distributed_optimizer,
            optimizer_offload_fraction=1.0 if opt.cpu_offload and distributed_optimizer else 0.0,
        )
        # On CPU every group is gloo already; Megatron's extra gloo groups were not created.
        self.optimizer = get_megatron_optimizer(
            optimizer_config, self.chunks, use_gloo_process_groups=self.platform.is_cuda
        )
        # Checkpoint loads into this fresh optimizer need its (still empty) state initialisable.
        install_state_initialiser(self.optimizer)
        self.scheduler = self._build_scheduler()
        # The schedule calls these: DP all-reduce + tied-embedding sync, and loss scaling.
        tc.finalize_model_grads_func = finalize_model_grads
        tc.grad_scale_func = self.optimizer.scale_loss

    def _build_scheduler(self) -> Any:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        opt = self.config.optimizer
        return OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if opt.warmup_steps else opt.lr, max_lr=opt.lr,
            min_lr=opt.min_lr, lr_warmup_steps=opt.warmup_steps,
            lr_decay_steps=opt.warmup_steps + opt.total_steps, lr_decay_style=opt.lr_decay_style,
            start_wd=opt.weight_decay, end_wd=opt.weight_decay,
            wd_incr_steps=opt.warmup_steps + opt.total_steps, wd_incr_style="constant",
        )

    # ------------------------------------------------------------------ micro-batches
    def make_micro_batches(self, batch: TokenBatch) -> list[MicroBatch]:
        """Cut `batch` by rows (micro_batch_size) or by the token budget, then pack or trim."""
        if len(batch) == 0:
            raise ConfigError("the batch is empty")
        # Each row remembers its place so results can be put back in batch order.
        batch = batch.with_fields(_row_id=torch.arange(len(batch)))
        lengths = batch.lengths().tolist()
        longest = max(lengths)
        if longest > self.args.max_sequence_length:
            raise ConfigError(
                f"a sequence of {longest} tokens exceeds max_sequence_length="
                f"{self.args.max_sequence_length}"
            )
        budget = self.config.max_tokens_per_micro_batch
        if budget is not None:
            # Under CP each row grows to a multiple of 2*cp before it is split; budget that.
            pad_to = 2 * self.dims.cp if self.dims.cp > 1 else 1
            groups = split_by_token_budget([round_up(n, pad_to) for n in lengths], budget)
        else:
            size = self.config.micro_batch_size
            if len(batch) % size:
                raise ConfigError(
                    f"micro_batch_size={size} does not divide the batch of {len(batch)} rows"
                )
            groups = [list(range(i, i + size)) for i in range(0, len(batch), size)]
        return [self._prepare(batch.select(rows)) for rows in groups]

    def _prepare(self, rows: TokenBatch) -> MicroBatch:
        width = int(rows.lengths().max())
        rows = TokenBatch(
            rows.input_ids[:, :width], rows.attention_mask[:, :width], rows.loss_mask[:, :width],
            {k: v[:, :width] if v.dim() > 1 else v for k, v in rows.fields.items()},
        )
        device = self.platform.device()
        cp_size, cp_group = context_parallel_group()
        if not self.config.use_packing:
            if cp_size > 1:
                return self._split_dense(rows, width, cp_size, cp_group)
            positions = torch.arange(width).expand(len(rows), -1)
            rows = rows.to(device)  # loss functions combine these fields with model outputs
            return MicroBatch(rows, rows.input_ids, positions.to(device), None, None)
        packed = pack_rows(rows.input_ids, rows.attention_mask,
                           pad_to=2 * cp_size if cp_size > 1 else 1)
        rows = rows.to(device)
        tokens, positions = packed.tokens.to(device), packed.position_ids.to(device)

        if cp_size > 1:  # the unfused attention was refused at build time
            split = CpSplit.build(packed.padded_lengths.tolist(), cp_group)
            return MicroBatch(rows, split.local(tokens), split.local(positions), None, packed,
                              _thd_params(packed, device, cp=True), split, tokens)
        if packs_by_cu_seqlens(unwrap(self.chunks[0])):
            # TE's THD attention and the SDPA core attention keep rows apart through cu_seqlens
            # (no T x T mask); only Megatron's unfused attention needs the block mask.
            return MicroBatch(rows, tokens, positions, None, packed, _thd_params(packed, device))
        return MicroBatch(rows, tokens, positions, block_causal_mask(packed.lengths).to(device),
                          packed)

    def _split_dense(self, rows: TokenBatch, width: int, cp_size: int, group: Any) -> MicroBatch:
        """Dense rows under CP: pad (b, width) at the end to a multiple of 2*cp, keep this rank's
        two chunks of each row (Megatron's RoPE picks the same chunks' positions)."""
        device = self.platform.device()
        padded = round_up(width, 2 * cp_size)
        tokens = torch.nn.functional.pad(rows.input_ids, (0, padded - width)).to(device)
        positions = torch.arange(padded, device=device).expand(len(rows), -1)
        split = CpSplit.build([padded], group)
        return MicroBatch(rows.to(device), split.local(tokens), split.local(positions), None,
                          None, cp=split, full_tokens=tokens)

    # ------------------------------------------------------------------ running passes
    def run_micro_batches(
        self, micro_batches: list[MicroBatch], loss_fn: LossFn, *, forward_only: bool,
        routing: Any = None,
    ) -> list[dict[str, Any]]:
        """One pass of Megatron's schedule over `micro_batches`.

        Returns loss_fn's per-micro-batch results on the last pipeline stage, [] elsewhere.
        With forward_only=False the gradients accumulate into the DDP buffers (and are
        all-reduced over DP at the end by finalize_model_grads). `routing`: an MoE model's
        models.moe_replay.RoutingPass, told before and after each chunk's forward.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        results: list[dict[str, Any]] = []

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
            micro = next(data_iterator)
            if routing is not None:
                routing.before_forward(model, micro)
            output = model(micro.tokens, micro.position_ids, micro.attention_mask,
                           packed_seq_params=micro.packed_seq_params)
            if routing is not None:
                routing.after_forward(model, micro)

            def on_last_stage(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict]:
                loss, values = loss_fn(micro, output_tensor)
                results.append(values)
                return loss, {}

            return output, on_last_stage

        vpp = len(self.chunks) > 1
        if vpp and len(micro_batches) % self.dims.pp:
            raise ConfigError(
                f"interleaved pipelining needs a multiple of pp={self.dims.pp} micro-batches, "
                f"got {len(micro_batches)}"
            )
        data = [iter(micro_batches) for _ in self.chunks] if vpp else iter(micro_batches)
        context = torch.no_grad() if forward_only else torch.enable_grad()
        with context, self._output_layer_readout():
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=data,
                model=self.chunks,
                num_microbatches=len(micro_batches),
                # The whole sequence: Megatron divides it by cp for the p2p shapes.
                seq_length=max(m.full_tokens.shape[1] for m in micro_batches),
                micro_batch_size=max(m.tokens.shape[0] for m in micro_batches),
                forward_only=forward_only,
            )
        return results

    def _output_layer_readout(self) -> Any:
        """Within it, the last stage's model gives its final hidden states instead of logits
        (when this engine reads them out in chunks)."""
        if not self.reads_hidden_states:
            return nullcontext()
        last = [m for m in map(unwrap, self.chunks) if getattr(m, "post_process", False)]
        return emit_hidden_states(last)

    def last_stage_output(self, output: torch.Tensor) -> torch.Tensor | HiddenStates:
        """What a loss function got from the last stage: its logits, or its hidden states with
        the output layer's weight to read them out chunk by chunk."""
        if not self.reads_hidden_states:
            return output
        return HiddenStates(output, output_weight(unwrap(self.chunks[-1])),
                            self.config.logits_chunk_tokens)

    def loss_scale_for_sum(self, num_micro_batches: int) -> float:
        """Megatron divides each micro-batch loss by their count, multiplies it by cp, and DDP
        averages over DP x CP. Losses normalised by the global batch must be summed over DP
        instead (the CP ranks of one DP rank compute the same loss, each its own tokens' share
        of the gradient, engines/context_parallel.py), so multiply by count x DP."""
        from megatron.core import parallel_state

        dp = parallel_state.get_data_parallel_world_size(with_context_parallel=False)
        return float(num_micro_batches * dp)

    def optimizer_step(self) -> dict[str, float]:
        """Step the optimizer and the LR schedule; zero the grads for the next step."""
        assert self.optimizer is not None, "optimizer_step on an engine built with trainable=False"
        update_ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        lr = self.optimizer.param_groups[0]["lr"]
        self.zero_grad()
        return {"grad_norm": float(grad_norm or 0.0), "lr": float(lr),
                "update_skipped": float(not update_ok)}

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    # ------------------------------------------------------------------ colocation, checkpoints
    def offload(self) -> int:
        """Move params, grad buffers and optimizer state off the device (see engines/offload.py)
        and release the allocator's cached memory to the device. Returns the bytes moved off
        this rank's device (also `offloaded_bytes` until `onload()`)."""

        return self._offloader.offload(engine_state_tensors(self))

    @property
    def offloaded_bytes(self) -> int:
        """Bytes the current offload moved off this rank's device (0 when onloaded)."""
        return self._offloader.offloaded_bytes

    def onload(self) -> None:
        """Bring back exactly what `offload()` moved (bitwise)."""
        self._offloader.onload()

    def save_checkpoint(self, directory: str | Path, *, step: int) -> Path:
        return save_engine_checkpoint(self, directory, step=step)

    def load_checkpoint(self, directory: str | Path, *, load_optimizer: bool = True) -> int:
        return load_engine_checkpoint(self, directory, load_optimizer=load_optimizer)

    # ------------------------------------------------------------------ collectives
    def broadcast_from_last_stage(
        self, tensor: torch.Tensor | None, like: torch.Tensor
    ) -> torch.Tensor:
        """Give every pipeline stage the last stage's CPU `tensor` (shape and dtype of `like`)."""
        from megatron.core import parallel_state

        if self.dims.pp == 1:
            return tensor
        # NCCL moves device tensors only; gloo is happy either way.
        device = self.platform.device()
        buffer = (tensor if tensor is not None else torch.empty_like(like)).to(device)
        source = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(buffer, src=source, group=parallel_state.get_pipeline_model_parallel_group())
        return buffer.cpu()

    def all_reduce_dp(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """All-reduce a CPU tensor over the DP group; returns a CPU tensor. (Not over CP: the CP
        ranks of a DP rank hold the same rows and the same per-row results.)"""
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group(with_context_parallel=False)
        if dist.get_world_size(group) == 1:
            return tensor
        buffer = tensor.to(self.platform.device())
        dist.all_reduce(buffer, op=op, group=group)
        return buffer.cpu()

    def rows_in_batch_order(
        self, batch: TokenBatch, micro_batches: list[MicroBatch], pieces: list[torch.Tensor]
    ) -> torch.Tensor:
        """Put per-micro-batch (b, s) results back in batch order as one (bs, S) CPU tensor,
        on every pipeline stage (`pieces` exist on the last stage only)."""
        full = None
        if pieces:
            full = torch.zeros(len(batch), batch.seq_len)
            for micro, piece in zip(micro_batches, pieces):
                rows = micro.rows.fields["_row_id"].cpu()
                full[rows, : piece.shape[1]] = piece.detach().float().cpu()
        return self.broadcast_from_last_stage(full, like=torch.zeros(len(batch), batch.seq_len))

    def reduce_metrics(
        self, results: list[dict[str, float]], *, summed: set[str]
    ) -> dict[str, float]:
        """Per-micro-batch metrics (last pipeline stage) -> one dict on every rank.

        Names in `summed` are loss terms already normalised by the global batch: summed over
        micro-batches and DP ranks. The rest are averaged over micro-batches, then DP ranks.
        """
        from megatron.core import parallel_state

        names = self._metric_names(sorted(results[0]) if results else [])
        local = torch.zeros(len(names), dtype=torch.float64)
        for i, name in enumerate(names):
            if results:
                total = sum(r[name] for r in results)
                local[i] = total if name in summed else total / len(results)
        local = self.broadcast_from_last_stage(local if results else None, like=local)
        totals = self.all_reduce_dp(local.clone())
        dp = parallel_state.get_data_parallel_world_size(with_context_parallel=False)
        return {n: float(totals[i] if n in summed else totals[i] / dp) for i, n in enumerate(names)}

    def _metric_names(self, names: list[str]) -> list[str]:
        """The metric names known on the last stage, on every stage."""
        from megatron.core import parallel_state

        if self.dims.pp == 1:
            return names
        holder = [names]
        dist.broadcast_object_list(
            holder, src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return holder[0]

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(global Megatron name, parameter) of this rank's shard, over all chunks."""
        return self._named(lambda module: module.named_parameters())

    def named_weights(self, *, merged: bool = True) -> list[tuple[str, torch.Tensor]]:
        """`named_parameters` plus the buffers a mapping table names (a sigmoid router's expert
        bias): what an export or a refit sends. With LoRA, each adapted weight merged with its
        adapters (base + scale * B A) and the adapters themselves left out; `merged=False`: the
        frozen base weights as they are (what an adapter refit sends first, refit/export.py)."""
        if self.config.lora is None:
            return self._named(mapped_tensors)
        from rlhf_megatron.models.lora import merged_tensors

        if not merged:
            return self._named(lambda module: [(n, t) for n, t in mapped_tensors(module)
                                               if ".lora." not in f".{n}"])
        return self._named(lambda module: merged_tensors(module, mapped_tensors(module)))

    def named_adapters(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's LoRA adapter parameters under global Megatron names
        (`decoder.layers.<i>.<linear>.lora.<a|b>.<part>`); empty without LoRA."""
        return self._named(lambda module: [(n, p) for n, p in module.named_parameters()
                                           if ".lora." in f".{n}"])

    def _named(self, tensors: Any) -> list[tuple[str, torch.Tensor]]:
        from rlhf_megatron.models.moe_layers import expert_offset_of

        named = []
        for chunk in self.chunks:
            module = unwrap(chunk)
            offset, experts = layer_offset_of(module), expert_offset_of(module)
            named += [(global_layer_name(n, offset, experts), p) for n, p in tensors(module)]
        return named


def _thd_params(packed: PackedRows, device: torch.device, *, cp: bool = False) -> Any:
    """THD params of the whole packed sequence. Under CP the offsets stay global (TE and
    models/sdpa_cp.py split them per rank); the padded ones (rows padded to multiples of 2*cp)
    are what RoPE and the attention index by, the real ones what TE masks with."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = packed.cu_seqlens.to(device)
    if not cp:
        longest = int(packed.lengths.max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens,
                               cu_seqlens_kv=cu_seqlens, max_seqlen_q=longest,
                               max_seqlen_kv=longest)
    padded = packed.cu_seqlens_padded.to(device)
    longest = int(packed.padded_lengths.max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                           max_seqlen_q=longest, max_seqlen_kv=longest)
