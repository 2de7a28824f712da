"""Every vLLM internal tapc touches, in one place: imports, methods it patches or calls, attributes
it reads on vLLM's objects, environment variables, custom ops and the forward calls `.source`
taps name. tests/project/test_vllm_surface.py resolves each the installed release has against it, so
that a vLLM that renamed or moved one fails there in one line naming it, not later as a wrong capture;
benchmarks/probes/probe_vllm_surface.py reads them statically from another release's wheel.

`name` is "module:path"; `kind` says how the path resolves:
- "object": `getattr` along the path (a class, function, method or class attribute);
- "field": the path's last part is an attribute of instances of the class before it (set in its
  methods, or a dataclass / pydantic field), which the class itself may not have;
- "env": an environment variable `vllm.envs` reads;
- "op": `torch.ops.vllm.<path>`, registered when the module is imported;
- "text": the path is a string that the module's source contains (an entry-point group);
- "call": "Class.forward:call", a call that `Class.forward` makes, named as tapc names it
  (tapc/plan/forwards.py `forward_calls`).
`versions`: the vLLM releases the name is known in, as "major.minor" (`release`). tapc requires
0.26, where every entry is known; 0.34's marks are read from its wheel by the probe, not from a run
of tapc there. The test resolves the entries marked with the installed release; the probe, those
marked with the wheel's, and lists the others apart.
"""
from __future__ import annotations

from typing import NamedTuple


class Internal(NamedTuple):
    name: str                    # "module:path"
    kind: str                    # object | field | env | op | text | call
    use: str                     # what tapc uses it for
    user: str                    # the tapc module that uses it
    versions: tuple[str, ...]    # the releases that have it ("0.26", "0.34")

    @property
    def module(self) -> str:
        return self.name.partition(":")[0]

    @property
    def path(self) -> str:
        return self.name.partition(":")[2]

    @property
    def dotted(self) -> str:
        """The name as a reader looks it up."""
        if self.kind == "op":
            return f"torch.ops.vllm.{self.path} (registered by {self.module})"
        if self.kind == "text":
            return f"{self.path!r} in {self.module}"
        if self.kind == "call":
            method, _, call = self.path.rpartition(":")
            return f"{self.module}.{method} call {call}"
        return f"{self.module}.{self.path}"


# One line an internal: name | kind | use | user | versions (space-separated); "#" lines group them.
_TABLE = """
# The worker: tapc's subclass of vLLM's, and what it reads at load.
vllm.v1.worker.gpu_worker:Worker | object | the base class of TapWorker | tapc/worker/worker.py | 0.26 0.34
vllm.v1.worker.gpu_worker:Worker.load_model | object | installing the taps after the load | tapc/worker/worker.py | 0.26 0.34
vllm.v1.worker.gpu_worker:Worker.model_runner | field | the runner to patch | tapc/worker/worker.py | 0.26 0.34
vllm.v1.worker.gpu_worker:Worker.device | field | where tapc's buffers go | tapc/worker/worker.py | 0.26 0.34
vllm.v1.worker.worker_base:WorkerBase.vllm_config | field | the engine's config | tapc/worker/worker.py | 0.26 0.34
vllm.config:VllmConfig.additional_config | field | the plan, to the workers | tapc/api/engine_args.py | 0.26 0.34
vllm.config:VllmConfig.scheduler_config | field | batch limits | tapc/worker/worker.py | 0.26 0.34
vllm.config:VllmConfig.parallel_config | field | the executor backend | tapc/worker/worker.py | 0.26 0.34
vllm.config:VllmConfig.cache_config | field | the KV block size | tapc/worker/worker.py | 0.26 0.34
vllm.config:VllmConfig.model_config | field | the HF config of the meta model | tapc/plan/metamodel.py | 0.26 0.34
vllm.config:VllmConfig.lora_config | field | LoRA wrapping on meta | tapc/plan/metamodel.py | 0.26 0.34
vllm.config:VllmConfig.max_concurrent_batches | object | sizing the fill's tables | tapc/worker/worker.py | 0.26 0.34
vllm.config:SchedulerConfig.max_num_seqs | field | sizing the tables | tapc/worker/worker.py | 0.26 0.34
vllm.config:SchedulerConfig.max_num_batched_tokens | field | sizing LoRA slots on meta | tapc/plan/metamodel.py | 0.26 0.34
vllm.config:ParallelConfig.distributed_executor_backend | field | prefix rows need the single-process executor | tapc/worker/worker.py | 0.26 0.34
vllm.config:CacheConfig.block_size | field | prefix rows by KV block | tapc/worker/worker.py | 0.26 0.34
vllm.config:CacheConfig.enable_prefix_caching | field | whether served prompts share KV | tapc/serving/http.py | 0.26 0.34
vllm.config:ModelConfig.hf_config | field | the meta model's config | tapc/plan/metamodel.py | 0.26 0.34
vllm.config:ModelConfig.get_vocab_size | object | LoRA slots on meta | tapc/plan/metamodel.py | 0.26 0.34
vllm.config:ModelConfig.max_model_len | field | a served session's limit | tapc/serving/http.py | 0.26 0.34
vllm.config:ModelConfig.uses_mrope | object | positions of M-RoPE models | tapc/worker/runner.py | 0.26 0.34
vllm.config:ModelConfig.uses_xdrope_dim | object | positions of XD-RoPE models | tapc/worker/runner.py | 0.26
vllm.config:CompilationConfig | object | Python blocks' splitting ops | tapc/api/engine_args.py | 0.26 0.34
vllm.config:CompilationConfig._attention_ops | object | vLLM's default splitting ops | tapc/api/engine_args.py | 0.26 0.34
vllm.config:CompilationConfig.splitting_ops | field | where graphs break at blocks | tapc/api/engine_args.py | 0.26 0.34
vllm.config:set_current_vllm_config | object | building the meta model | tapc/plan/metamodel.py | 0.26 0.34
# Parallel groups.
vllm.distributed:get_pp_group | object | this worker's pipeline stage | tapc/worker/worker.py | 0.26 0.34
vllm.distributed:get_tensor_model_parallel_rank | object | this worker's shard | tapc/worker/worker.py | 0.26 0.34
vllm.distributed:get_tensor_model_parallel_world_size | object | checking the plan's sizes | tapc/worker/worker.py | 0.26 0.34
vllm.distributed:get_tp_group | object | all-gathers for blocks at sharded points | tapc/worker/worker.py | 0.26 0.34
vllm.distributed:init_distributed_environment | object | a one-rank group for the meta model | tapc/plan/metamodel.py | 0.26 0.34
vllm.distributed:initialize_model_parallel | object | a one-rank group for the meta model | tapc/plan/metamodel.py | 0.26 0.34
vllm.distributed.utils:get_pp_indices | object | the layers of a pipeline stage | tapc/worker/worker.py | 0.26 0.34
vllm.distributed.parallel_state:get_world_group | object | whether a worker is on the API's node | tapc/worker/worker.py | 0.26 0.34
vllm.distributed.parallel_state:in_the_same_node_as | object | whether a worker is on the API's node | tapc/worker/worker.py | 0.26 0.34
vllm.distributed.parallel_state:GroupCoordinator.world_size | field | group sizes | tapc/worker/worker.py | 0.26 0.34
vllm.distributed.parallel_state:GroupCoordinator.rank_in_group | field | this worker's stage | tapc/worker/worker.py | 0.26 0.34
vllm.distributed.parallel_state:GroupCoordinator.cpu_group | field | the node check's group | tapc/worker/worker.py | 0.26 0.34
vllm.distributed.parallel_state:GroupCoordinator.all_gather | object | blocks at sharded points | tapc/worker/worker.py | 0.26 0.34
# The V2 model runner (dense models): its step methods are patched (runner_v2.py).
vllm.v1.worker.gpu.model_runner:GPUModelRunner | object | which adapter a runner gets | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model | object | one step: schedule, then end the step | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_inputs | object | the step's row layout | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.model_runner:GPUModelRunner.capture_model | object | capturing graphs that blocks break or a switch edits | tapc/worker/patches.py | 0.26 0.34
vllm.v1.worker.gpu.model_runner:GPUModelRunner.get_model | object | the model to install taps in | tapc/worker/assemble.py | 0.26 0.34
vllm.v1.worker.gpu.model_runner:GPUModelRunner.input_buffers | field | the positions buffer | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.model_runner:GPUModelRunner.req_states | field | prompt lengths by request state | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.model_runner:GPUModelRunner.cudagraph_manager | field | the FULL graphs captured | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.model_runner:GPUModelRunner.sampler | field | the sampler to tap logits and samples | tapc/worker/points.py | 0.26 0.34
vllm.v1.worker.gpu.model_runner:GPUModelRunner.model_config | field | M-RoPE positions | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.model_runner:GPUModelRunner.max_num_tokens | field | sizing the tables | tapc/worker/worker.py | 0.26 0.34
vllm.v1.worker.gpu.input_batch:InputBuffers.positions | field | the model's positions | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.states:RequestState.prompt_len | field | prompt lengths | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.input_batch:InputBatch.req_ids | field | the step's requests | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.input_batch:InputBatch.query_start_loc_np | field | the step's rows | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.input_batch:InputBatch.num_computed_tokens_np | field | rows already computed | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.input_batch:InputBatch.idx_mapping_np | field | batch order to request state | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.input_batch:InputBatch.num_tokens_after_padding | field | the padded rows | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.graphs | field | the FULL graphs captured | tapc/worker/runner_v2.py | 0.26 0.34
vllm.v1.worker.gpu.cudagraph_utils:BatchExecutionDescriptor.num_tokens | field | a graph's batch size | tapc/worker/worker.py | 0.26 0.34
vllm.v1.worker.gpu.sample.output:SamplerOutput.sampled_token_ids | field | the samples point | tapc/worker/patches.py | 0.26 0.34
# The V1 model runner (MoE, hybrid and pooling models; gone in 0.34).
vllm.v1.worker.gpu_model_runner:GPUModelRunner | object | which adapter a runner gets | tapc/worker/runner_v1.py | 0.26
vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model | object | one step: schedule, then end the step | tapc/worker/runner_v1.py | 0.26
vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward | object | the step's final row layout | tapc/worker/runner_v1.py | 0.26
vllm.v1.worker.gpu_model_runner:GPUModelRunner._dummy_run | object | resetting tables for dummy runs | tapc/worker/runner_v1.py | 0.26
vllm.v1.worker.gpu_model_runner:GPUModelRunner.capture_model | object | capturing graphs that blocks break or a switch edits | tapc/worker/patches.py | 0.26
vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_model | object | the model to install taps in | tapc/worker/assemble.py | 0.26
vllm.v1.worker.gpu_model_runner:GPUModelRunner.input_batch | field | the persistent batch | tapc/worker/runner_v1.py | 0.26
vllm.v1.worker.gpu_model_runner:GPUModelRunner.query_start_loc | field | the step's rows | tapc/worker/runner_v1.py | 0.26
vllm.v1.worker.gpu_model_runner:GPUModelRunner.positions | field | the model's positions | tapc/worker/runner_v1.py | 0.26
vllm.v1.worker.gpu_model_runner:GPUModelRunner.model | field | the FULL graph wrapper | tapc/worker/runner_v1.py | 0.26
vllm.v1.worker.gpu_model_runner:GPUModelRunner.sampler | field | the sampler to tap logits and samples | tapc/worker/points.py | 0.26
vllm.v1.worker.gpu_model_runner:GPUModelRunner.model_config | field | M-RoPE positions | tapc/worker/runner_v1.py | 0.26
vllm.v1.worker.gpu_model_runner:GPUModelRunner.max_num_tokens | field | sizing the tables | tapc/worker/worker.py | 0.26
vllm.v1.worker.gpu_input_batch:InputBatch.num_reqs | object | the batch's requests | tapc/worker/runner_v1.py | 0.26
vllm.v1.worker.gpu_input_batch:InputBatch.req_ids | object | the batch's requests | tapc/worker/runner_v1.py | 0.26
vllm.v1.worker.gpu_input_batch:InputBatch.num_computed_tokens_cpu | field | rows already computed | tapc/worker/runner_v1.py | 0.26
vllm.v1.worker.gpu_input_batch:InputBatch.num_prompt_tokens | field | prompt lengths | tapc/worker/runner_v1.py | 0.26
vllm.v1.utils:CpuGpuBuffer.np | field | host copies of runner buffers | tapc/worker/runner_v1.py | 0.26 0.34
vllm.compilation.cuda_graph:CUDAGraphWrapper.concrete_cudagraph_entries | field | V1's FULL graphs | tapc/worker/runner_v1.py | 0.26 0.34
vllm.compilation.cuda_graph:CUDAGraphEntry.cudagraph | field | V1's FULL graphs | tapc/worker/runner_v1.py | 0.26 0.34
vllm.forward_context:BatchDescriptor.num_tokens | field | a V1 graph's batch size | tapc/worker/worker.py | 0.26 0.34
vllm.v1.outputs:SamplerOutput.sampled_token_ids | field | the samples point | tapc/worker/patches.py | 0.26 0.34
# The scheduler's output, read before each step (runner.py).
vllm.v1.core.sched.output:SchedulerOutput.scheduled_new_reqs | field | admitting new requests | tapc/worker/runner.py | 0.26 0.34
vllm.v1.core.sched.output:SchedulerOutput.scheduled_cached_reqs | field | resumed requests (V1) | tapc/worker/runner.py | 0.26 0.34
vllm.v1.core.sched.output:SchedulerOutput.finished_req_ids | field | retiring requests | tapc/worker/runner.py | 0.26 0.34
vllm.v1.core.sched.output:SchedulerOutput.preempted_req_ids | field | retiring preempted requests | tapc/worker/runner.py | 0.26 0.34
vllm.v1.core.sched.output:CachedRequestData.resumed_req_ids | field | resumed requests (V1) | tapc/worker/runner.py | 0.26
vllm.v1.core.sched.output:NewRequestData.req_id | field | a request's id | tapc/worker/runner.py | 0.26 0.34
vllm.v1.core.sched.output:NewRequestData.sampling_params | field | a request's taps (extra_args) | tapc/worker/runner.py | 0.26 0.34
vllm.v1.core.sched.output:NewRequestData.prompt_token_ids | field | a request's prompt length | tapc/worker/runner.py | 0.26 0.34
vllm.sampling_params:SamplingParams.extra_args | field | a request's taps, to the workers | tapc/worker/runner.py | 0.26 0.34
vllm.sampling_params:SamplingParams.max_tokens | field | sizing a request's captures | tapc/worker/runner.py | 0.26 0.34
vllm.sampling_params:RequestOutputKind | object | a harvest's final-only outputs | tapc/harvest/feed.py | 0.26 0.34
# The prefix-cache lookup, limited for kept prefix rows (patches.py, prefixrows.py).
vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks | object | limiting prefix hits to kept rows | tapc/worker/patches.py | 0.26 0.34
vllm.v1.core.kv_cache_manager:KVCacheManager.num_kv_cache_groups | field | one block size only | tapc/worker/patches.py | 0.26 0.34
vllm.v1.request:Request.block_hashes | field | the prefix blocks a lookup sees | tapc/worker/patches.py | 0.26 0.34
vllm.v1.request:Request.request_id | field | a request's id | tapc/worker/patches.py | 0.26 0.34
vllm.v1.request:Request.sampling_params | field | a request's taps | tapc/worker/patches.py | 0.26 0.34
# Graph capture helpers.
vllm.utils.torch_utils:weak_ref_tensor | object | blocks that break a graph | tapc/worker/graphs.py | 0.26 0.34
vllm.utils.torch_utils:get_accelerator_view_from_cpu_tensor | object | device views of host tables | tapc/worker/buffers.py | 0.26 0.34
# MoE runners, their gates and routers (install.py, plan/metamodel.py).
vllm.model_executor.layers.fused_moe.runner.moe_runner_interface:MoERunnerInterface | object | modules inside the fused-MoE op | tapc/plan/metamodel.py | 0.26 0.34
vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner.gate | field | the gate the runner calls | tapc/worker/install.py | 0.26 0.34
vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner._fse_fuse_gate | field | gates fused with the shared expert's | tapc/worker/install.py | 0.26 0.34
vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner.shared_experts | field | the shared expert inside the op | tapc/plan/metamodel.py | 0.26 0.34
vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner.router | field | the `<runner>.router` tap point | tapc/plan/metamodel.py | 0.26 0.34
vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner.do_naive_dispatch_combine | object | rows dispatched between gate and router | tapc/worker/install.py | 0.26 0.34
vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner.moe_config | field | context parallel size | tapc/worker/install.py | 0.26 0.34
vllm.model_executor.layers.fused_moe.config:FusedMoEConfig.pcp_size | field | context parallel size | tapc/worker/install.py | 0.26 0.34
vllm.model_executor.layers.fused_moe.router.base_router:BaseRouter.select_experts | object | router taps | tapc/worker/install.py | 0.26 0.34
vllm.model_executor.layers.fused_moe.router.base_router:BaseRouter.top_k | field | what is a router | tapc/plan/metamodel.py | 0.26 0.34
vllm.model_executor.layers.fused_moe.runner.moe_runner:moe_forward | op | modules inside it get no taps | tapc/plan/resolve.py | 0.26 0.34
# Layers the planner recognizes.
vllm.model_executor.layers.linear:LinearBase | object | widths of linear outputs | tapc/plan/forwards.py | 0.26 0.34
vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding | object | widths of embeddings | tapc/plan/forwards.py | 0.26 0.34
# Attention patterns (worker/install.py `_Pattern`): the backend's forward is wrapped, its cache and metadata read.
vllm.model_executor.layers.attention.attention:Attention.impl | field | attention patterns: the backend wrapped | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionImpl | object | attention patterns: the cache layout read | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.forward | object | attention patterns, after the attention | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.num_heads | field | attention patterns: heads | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.head_size | field | attention patterns: keys in the cache | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.scale | field | attention patterns: the logits' scale | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.kv_cache_dtype | field | attention patterns refuse a quantized cache | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.sliding_window | field | attention patterns refuse a window | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.logits_soft_cap | field | attention patterns refuse a soft cap | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.alibi_slopes | field | attention patterns refuse ALiBi | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.sinks | field | attention patterns refuse sinks | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.dcp_world_size | field | attention patterns refuse decode context parallelism | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionMetadata.query_start_loc | field | attention patterns: each row's request | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionMetadata.seq_lens | field | attention patterns: each row's position | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionMetadata.block_table | field | attention patterns: where the keys lie | tapc/worker/install.py | 0.26 0.34
vllm.v1.attention.backends.flash_attn:FlashAttentionBackend.get_kv_cache_shape | object | attention patterns: [blocks, kv_heads, block_size, 2 x head_size] | tapc/worker/install.py | 0.26
vllm.model_executor.layers.attention.mla_attention:MLAAttention | object | MLA modules not run on every row | tapc/plan/metamodel.py | 0.26 0.34
vllm.model_executor.layers.attention.mla_attention:MLAAttention.kv_b_proj | field | prefill-only projection | tapc/plan/metamodel.py | 0.26 0.34
vllm.model_executor.layers.attention.mla_attention:get_attn_backend | object | a stand-in backend for MLA on meta | tapc/plan/metamodel.py | 0.26 0.34
vllm.model_executor.layers.attention.mla_attention:get_mla_prefill_backend | object | a stand-in backend for MLA on meta | tapc/plan/metamodel.py | 0.26 0.34
vllm.lora.model_manager:create_lora_manager | object | LoRA wrapping on meta | tapc/plan/metamodel.py | 0.26 0.34
vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA | object | LoRA base layers get no taps | tapc/plan/metamodel.py | 0.26 0.34
vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA.base_layer | field | LoRA base layers get no taps | tapc/plan/metamodel.py | 0.26 0.34
# The meta model (plan/metamodel.py) and vLLM's names (installed.py).
vllm.platforms:_current_platform | object | the CPU platform for the meta model | tapc/plan/metamodel.py | 0.26 0.34
vllm.platforms.cpu:CpuPlatform | object | the CPU platform for the meta model | tapc/plan/metamodel.py | 0.26 0.34
vllm.engine.arg_utils:EngineArgs | object | engine argument names; the meta model's config | tapc/installed.py | 0.26 0.34
vllm.engine.arg_utils:EngineArgs.create_engine_config | object | the meta model's config | tapc/plan/metamodel.py | 0.26 0.34
vllm.engine.arg_utils:EngineArgs.worker_cls | field | tapc's worker | tapc/api/engine_args.py | 0.26 0.34
vllm.engine.arg_utils:EngineArgs.additional_config | field | the plan, to the workers | tapc/api/engine_args.py | 0.26 0.34
vllm.engine.arg_utils:AsyncEngineArgs | object | AsyncVLLM's engine | tapc/api/async_llm.py | 0.26 0.34
vllm.model_executor.model_loader.utils:initialize_model | object | the meta model | tapc/plan/metamodel.py | 0.26 0.34
vllm.model_executor.models:ModelRegistry | object | the architectures vLLM knows | tapc/installed.py | 0.26 0.34
vllm.model_executor.models.registry:_ModelRegistry.get_supported_archs | object | the architectures vLLM knows | tapc/installed.py | 0.26 0.34
# Engines, requests and serving.
vllm:LLM | object | VLLM's engine | tapc/api/llm.py | 0.26 0.34
vllm:LLM.collective_rpc | object | calls to tapc's workers | tapc/api/llm.py | 0.26 0.34
vllm:SamplingParams | object | requests | tapc/api/session.py | 0.26 0.34
vllm.v1.engine.async_llm:AsyncLLM | object | AsyncVLLM's engine | tapc/api/async_llm.py | 0.26 0.34
vllm.v1.engine.async_llm:AsyncLLM.collective_rpc | object | calls to tapc's workers | tapc/api/async_llm.py | 0.26 0.34
vllm.v1.engine.async_llm:AsyncLLM.engine_core | field | each data-parallel engine | tapc/api/async_llm.py | 0.26 0.34
vllm.v1.engine.core_client:MPClient.core_engines | field | each data-parallel engine | tapc/api/async_llm.py | 0.26 0.34
vllm.v1.engine.core_client:AsyncMPClient._call_utility_async | object | collective_rpc on one data-parallel engine | tapc/api/async_llm.py | 0.26 0.34
vllm.v1.engine.exceptions:EngineDeadError | object | a dead engine's error | tapc/api/llm.py | 0.26 0.34
vllm.tokenizers:get_tokenizer | object | `tapc run`'s prompts | tapc/cli.py | 0.26 0.34
vllm.engine.protocol:EngineClient.model_config | field | a served engine's limits | tapc/serving/http.py | 0.26 0.34
vllm.engine.protocol:EngineClient.vllm_config | field | a served engine's prefix caching | tapc/serving/http.py | 0.26 0.34
vllm.plugins.endpoint_plugins.interface:EndpointPlugin.attach_router | object | tapc's routes in `vllm serve` | tapc/serving/http.py | 0.26 0.34
vllm.plugins.endpoint_plugins.interface:EndpointPlugin.init_state | object | tapc's server state in `vllm serve` | tapc/serving/http.py | 0.26 0.34
vllm.plugins:vllm.endpoint_plugins | text | tapc's endpoint plugin group | tapc/serving/launch.py | 0.26 0.34
vllm.plugins:vllm.general_plugins | text | plugins VLLM_PLUGINS allows | tapc/serving/launch.py | 0.26 0.34
vllm.entrypoints.cli.main:main | object | `tapc serve` runs `vllm serve` | tapc/serving/launch.py | 0.26 0.34
# Environment variables.
vllm.envs:VLLM_PP_LAYER_PARTITION | env | pipeline stages' layers | tapc/plan/sharding.py | 0.26 0.34
vllm.envs:VLLM_PLUGINS | env | letting tapc's plugin load | tapc/serving/launch.py | 0.26 0.34
vllm.envs:VLLM_LOGGING_LEVEL | env | quiet tree builds | tapc/plan/tree.py | 0.26 0.34
vllm.envs:VLLM_USE_V2_MODEL_RUNNER | env | which runner dense models get | tapc/worker/worker.py | 0.26
# Custom ops vLLM splits graphs at besides attention: a list of splitting ops replaces vLLM's, so
# tapc's list names them (api/engine_args.py reads them from here).
vllm.model_executor.layers.attention.attention:unified_kv_cache_update | op | a splitting op beside tapc's | tapc/api/engine_args.py | 0.26 0.34
vllm.model_executor.layers.attention.mla_attention:unified_mla_kv_cache_update | op | a splitting op beside tapc's | tapc/api/engine_args.py | 0.26 0.34
# `.source` calls the docs name (docs/dsl.md), as plans name them.
vllm.model_executor.models.llama:LlamaAttention.forward:qkv_split_0 | call | q, k, v before rotary | tapc/worker/source.py | 0.26 0.34
vllm.model_executor.models.qwen3:Qwen3Attention.forward:qkv_split_0 | call | q, k, v before rotary | tapc/worker/source.py | 0.26 0.34
"""


def _entry(line: str) -> Internal:
    name, kind, use, user, versions = line.split(" | ")
    return Internal(name, kind, use, user, tuple(versions.split()))


INTERNALS: tuple[Internal, ...] = tuple(_entry(line) for line in _TABLE.strip().splitlines()
                                        if not line.startswith("#"))


def release(version: str) -> str:
    """The release a vLLM version is of, as `versions` names it: "0.26.0" and "0.26.1rc2" -> "0.26"."""
    return ".".join(version.split(".")[:2])
