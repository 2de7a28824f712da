"""A toy model, runner and scheduler that stand in for vLLM on the CPU (not a test module).

The toy model has vLLM's shapes where the engine looks: a flat [tokens, hidden] slab, decoder
layers `model.layers.i` returning (hidden_states, residual), a linear returning (out, bias).
It has no attention, so a row depends only on its own token and position: the reference for a
request is the model run on that request's tokens alone.

`ToyRunner` plays vLLM's V2 runner (execute_model calls self.prepare_inputs; the worker's V2
adapter, runner_v2.py, wraps both), `ToyRunnerV1` its V1 runner (a persistent batch in slot
order, condensed when requests leave; execute_model calls self._model_forward; runner_v1.py),
`ToyCopyOut` plays the worker's copy-out on the CPU (the rest of the worker is its own, made
as the worker makes it: `hooks_for`), and `run` plays the
scheduler: a token budget per step (chunked prefill), decode one token per step, requests
arriving late, finishing at max_tokens, and optionally one preemption (recompute from 0).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace as NS

import numpy as np
import torch

from tapc import settings
from tapc.wire.protocol import WireRequest
from tapc.api.requests import TapRequest, check
from tapc.worker.buffers import Buffers
from tapc.worker.segmentcopy import Repeated, copy_segments
from tapc.worker.runner_v1 import V1Adapter
from tapc.worker.runner_v2 import V2Adapter
from tapc.plan.planner import build_plan
from tapc.api.session import TapSession
from tapc.plan.tree import ModuleTree, Node, SourceOp

HIDDEN, INTER, LAYERS, VOCAB = 16, 24, 3, 50
HALF = 10
MAX_ROWS = 1024   # the toy runners' positions buffers (a step runs at most this many rows)
# MLP.forward's calls as the plan names them (tapc.plan.forwards.forward_calls), with their widths.
MLP_SOURCE = (SourceOp("self_up_proj_0", "self.up_proj(x)", 0, (INTER,), HIDDEN, linear=True),
              SourceOp("h_split_0", "h.split(...)", 0, (HALF, INTER - HALF), INTER),
              SourceOp("self_down_proj_0", "self.down_proj(...)", 0, (HIDDEN,), INTER, linear=True),
              SourceOp("torch_tanh_0", "torch.tanh(...)", 0, None, None),
              SourceOp("torch_cat_0", "torch.cat(...)", 0, None, None))


class Linear(torch.nn.Module):
    """Like vLLM's linear layers: returns (out, bias)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)

    def forward(self, x):
        return x @ self.weight.T, None


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = Linear(HIDDEN, INTER)
        self.down_proj = Linear(INTER, HIDDEN)
        self.half = HALF

    def forward(self, x):
        h, _ = self.up_proj(x)
        a, b = h.split([self.half, INTER - self.half], dim=-1)
        out, _ = self.down_proj(torch.tanh(torch.cat([a, b * 0.5], dim=-1)))
        return out


class Layer(torch.nn.Module):
    def __init__(self, mlp=MLP):
        super().__init__()
        self.mlp = mlp()

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states if residual is None else hidden_states + residual
        return self.mlp(residual * 0.5), residual


class RMSNorm(torch.nn.Module):
    """vLLM's final norm as the logit lens reads it: `weight` and `variance_epsilon` (the toy's
    forward does not call it)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.variance_epsilon = 1e-6


class Inner(torch.nn.Module):
    def __init__(self, mlp=MLP, layers: int = LAYERS):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(Layer(mlp) for _ in range(layers))
        self.norm = RMSNorm()

    def forward(self, input_ids, positions):
        h = self.embed_tokens(input_ids) + 0.01 * positions[:, None].float()
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return h + residual


class ToyModel(torch.nn.Module):
    """`layers` decoder layers whose MLP is a `mlp()` (tests/plan/test_moe.py: a toy MoE)."""

    def __init__(self, seed: int = 0, mlp=MLP, layers: int = LAYERS):
        super().__init__()
        torch.manual_seed(seed)
        self.model = Inner(mlp, layers)
        self.lm_head = Linear(HIDDEN, VOCAB)   # its weight, [vocab, hidden], as vLLM's ParallelLMHead

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)


def mlp_nodes(p: str, i: int) -> list[Node]:
    """The nodes of layer i's MLP (`p` its path)."""
    return [Node(p, "MLP", "tensor", HIDDEN, HIDDEN, layer=i, source_ops=MLP_SOURCE),
            Node(f"{p}.up_proj", "Linear", "linear", HIDDEN, INTER, layer=i),
            Node(f"{p}.down_proj", "Linear", "linear", INTER, HIDDEN, layer=i)]


def attention_nodes(p: str, i: int, inner: str = "Attention") -> list[Node]:
    """Layer i's MLP nodes and an attention block as vLLM's Llama has it, its paged attention
    (class `inner`) at `self_attn.attn`: `toy_tree(mlp=attention_nodes)`."""
    return [*mlp_nodes(p, i),
            Node(f"model.layers.{i}.self_attn", "LlamaAttention", "tensor", HIDDEN, HIDDEN, layer=i),
            Node(f"model.layers.{i}.self_attn.attn", inner, "tensor", HIDDEN, HIDDEN, layer=i)]


def toy_tree(mlp=mlp_nodes, layers: int = LAYERS, arch: str = "ToyForCausalLM") -> ModuleTree:
    """The tree of `ToyModel(mlp=..., layers=...)`: `mlp(path, i)` gives layer i's MLP nodes."""
    nodes = [Node("model", "Inner", "tensor", HIDDEN, HIDDEN),
             Node("model.embed_tokens", "VocabParallelEmbedding", "tensor", None, HIDDEN),
             Node("model.layers", "ModuleList", "none", None, None)]
    for i in range(layers):
        p = f"model.layers.{i}"
        nodes += [Node(p, "Layer", "pair", HIDDEN, HIDDEN, layer=i), *mlp(f"{p}.mlp", i)]
    nodes += [Node("model.norm", "RMSNorm", "norm", HIDDEN, HIDDEN), Node("lm_head", "ParallelLMHead", "none", None, None)]
    return ModuleTree(model="toy", architecture=arch, hidden_size=HIDDEN, num_layers=layers,
                      vocab_size=VOCAB, dtype="float32", layers_path="model.layers", vllm_version="0.26.0",
                      nodes=tuple(nodes))


def toy_plan(taps, rows: int = 64, slots: int = 8, functions: dict | None = None):
    return build_plan("toy", taps, max_num_batched_tokens=rows, max_num_seqs=slots, tree=toy_tree(),
                      functions=functions)


def host_batch(dsts, srcs, sizes, stream) -> bool:
    """The driver's batched copy (memcpy.BatchCopy) on host memory: each copy by address, at once."""
    for d, s, n in zip(list(dsts), list(srcs), list(sizes)):
        ctypes.memmove(int(d), int(s), int(n))
    return True


def toy_buffers(layout, rows: int = 64, slots: int = 8) -> Buffers:
    """The worker's `Buffers` on the CPU, `slots` parameter slots and as many requests a step."""
    return Buffers(layout, rows, slots, 2, torch.device("cpu"), slots=slots)


class ToyCopyOut:
    """Copy-out on the CPU, with `CopyOut`'s methods (tapc/worker/copyout.py): copies done at
    once, by address as the GPU's batch makes them (with the repeated steps' addresses, whatever
    the batch), with no streams; `copies` counts the steps that copied out, `waited` the copies
    (their number) a collect waited for."""

    def __init__(self, pools: list[torch.Tensor]):
        self.pools = pools
        self.nonfinite_values = 0
        self.counting = False
        self.copies = 0
        self.waited: list[int] = []
        self.repeated = Repeated()
        self.repeated.MANY = 1          # every repeated step by its kept addresses

    def copy_out(self, segments, used, steps=1):
        if self.counting:
            for pool, n in zip(self.pools, used):
                self.nonfinite_values += int(torch.isfinite(pool[:n]).logical_not_().sum())
        copy_segments(segments, self.pools, host_batch, NS(cuda_stream=0), self.repeated)
        self.copies += 1
        return ToyEvent(self.copies, self.waited)

    def count_nonfinite(self, on):
        self.counting, self.nonfinite_values = on, 0 if on else self.nonfinite_values

    def nonfinite(self):
        return self.nonfinite_values if self.counting else None

    def tensors(self):
        return []


@dataclass
class ToyEvent:
    """A step's copy-out event (copies are done at once here): which step a wait was for."""
    step: int
    waited: list

    def synchronize(self):
        self.waited.append(self.step)

    def query(self):
        return True


class ToyRunner:
    """The parts of vLLM's V2 runner the hooks use; batches ordered decode first like V2."""

    def __init__(self, model, pad: int = 8):
        self.model = model
        self.pad = pad
        self.prompt_lens: dict[str, int] = {}
        self.index: dict[str, int] = {}
        self.req_states = NS(prompt_len=NS(np=np.zeros(64, dtype=np.int32)))
        self.sampler = None   # tests/worker/test_points.py samples on its own
        self.last = None
        self.model_config = NS(uses_mrope=False, uses_xdrope_dim=0)
        self.input_buffers = NS(positions=torch.zeros(MAX_ROWS, dtype=torch.long))   # written each step, as vLLM's

    def get_model(self):
        return self.model

    def capture_model(self):
        """vLLM captures its CUDA graphs here (the worker wraps it); the toy has none."""

    def execute_model(self, so, dummy_run: bool = False):
        for rid in so.finished_req_ids:   # its slot goes to a later request, as in vLLM's runner
            self.index.pop(rid, None)
        for r in so.scheduled_new_reqs:
            i = self.index.setdefault(r.req_id, min(set(range(len(self.index) + 1)) - set(self.index.values())))
            self.req_states.prompt_len.np[i] = len(r.prompt_token_ids)
        if dummy_run:
            return None
        batch = self.prepare_inputs(so, None)
        padded = batch.num_tokens_after_padding
        ids = torch.zeros(padded, dtype=torch.long)
        pos = self.input_buffers.positions[:padded].zero_()
        for i, rid in enumerate(batch.req_ids):
            a, b = batch.query_start_loc_np[i], batch.query_start_loc_np[i + 1]
            c = batch.num_computed_tokens_np[i]
            ids[a:b] = torch.tensor(so.tokens[rid][c:c + b - a])
            pos[a:b] = torch.arange(c, c + b - a)
        self.last = self.model(ids, pos)
        return None

    def prepare_inputs(self, so, batch_desc):
        n = so.num_scheduled_tokens
        req_ids = sorted(n, key=lambda r: (n[r] != 1, n[r]))
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int32)
        np.cumsum([n[r] for r in req_ids], out=qsl[1:])
        total = int(qsl[-1])
        return NS(req_ids=req_ids, query_start_loc_np=qsl,
                  num_computed_tokens_np=np.array([so.num_computed[r] for r in req_ids], dtype=np.int32),
                  num_tokens_after_padding=-(-total // self.pad) * self.pad,
                  idx_mapping_np=np.array([self.index[r] for r in req_ids], dtype=np.int64))


class ToyRunnerV1:
    """The parts of vLLM's V1 runner the V1 adapter uses. Like V1's `InputBatch`, requests keep
    their slot while they run; a request that leaves (finished, preempted) leaves a hole that the
    batch's last request moves into (`condense`), new and resumed requests go to the end; a
    resumed request comes in `scheduled_cached_reqs.resumed_req_ids`, not among the new ones."""

    resumes_as_cached = True

    def __init__(self, model, pad: int = 8, max_reqs: int = 16):
        self.model = model
        self.pad = pad
        self.prompt_len: dict[str, int] = {}
        self.input_batch = NS(req_ids=[], num_reqs=0, num_computed_tokens_cpu=np.zeros(max_reqs, dtype=np.int32),
                              num_prompt_tokens=np.zeros(max_reqs, dtype=np.int32))
        self.query_start_loc = NS(np=np.zeros(max_reqs + 1, dtype=np.int32))
        self.sampler = None
        self.last = None
        self.dummy_runs = 0
        self.model_config = NS(uses_mrope=False, uses_xdrope_dim=0)
        self.positions = torch.zeros(MAX_ROWS, dtype=torch.long)   # written each step, as vLLM's

    def get_model(self):
        return self.model

    def capture_model(self):
        """vLLM captures its CUDA graphs here (the worker wraps it); the toy has none."""

    def _update_states(self, so) -> None:
        batch = self.input_batch
        for rid in (*so.finished_req_ids, *(so.preempted_req_ids or ())):
            if rid in batch.req_ids:
                batch.req_ids[batch.req_ids.index(rid)] = None
        while None in batch.req_ids:   # condense: the last request fills the first hole
            hole = batch.req_ids.index(None)
            last = batch.req_ids.pop()
            if hole < len(batch.req_ids):
                batch.req_ids[hole] = last
        for r in so.scheduled_new_reqs:
            self.prompt_len[r.req_id] = len(r.prompt_token_ids)
        for rid in [r.req_id for r in so.scheduled_new_reqs] + sorted(so.scheduled_cached_reqs.resumed_req_ids):
            batch.req_ids.append(rid)
        batch.num_reqs = len(batch.req_ids)
        for i, rid in enumerate(batch.req_ids):
            batch.num_prompt_tokens[i] = self.prompt_len[rid]
            batch.num_computed_tokens_cpu[i] = so.num_computed.get(rid, 0)

    def execute_model(self, so):
        self._update_states(so)
        batch = self.input_batch
        n = [so.num_scheduled_tokens.get(rid, 0) for rid in batch.req_ids]
        qsl = self.query_start_loc.np
        qsl[0] = 0
        np.cumsum(n, out=qsl[1:batch.num_reqs + 1])
        total = int(qsl[batch.num_reqs])
        padded = -(-total // self.pad) * self.pad
        ids = torch.zeros(padded, dtype=torch.long)
        pos = self.positions[:padded].zero_()
        for i, rid in enumerate(batch.req_ids):
            a, b = qsl[i], qsl[i + 1]
            c = batch.num_computed_tokens_cpu[i]
            ids[a:b] = torch.tensor(so.tokens[rid][c:c + b - a])
            pos[a:b] = torch.arange(c, c + b - a)
        self.last = self._model_forward(input_ids=ids, positions=pos)
        return None

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions)

    def _dummy_run(self, num_tokens: int):
        self.dummy_runs += 1
        return self.model(torch.zeros(num_tokens, dtype=torch.long), torch.zeros(num_tokens, dtype=torch.long))


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    wire: WireRequest | None = None
    arrive: int = 0
    preempt_at: int | None = None   # preempted (recomputed from 0) once, at this step
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    cached: int = 0                 # prompt tokens served from the prefix cache (not run)


def next_token(tokens: list[int]) -> int:
    return (7 * len(tokens) + 3 * tokens[-1]) % VOCAB


def new_request(r: Req) -> NS:
    """What vLLM's scheduler output says of a request the worker has not seen."""
    return NS(req_id=r.rid, prompt_token_ids=list(r.prompt), num_computed_tokens=r.cached,
              sampling_params=NS(extra_args=None if r.wire is None else {"tapc": over_the_wire(r.wire.to_wire())},
                                 max_tokens=r.max_tokens))


class Scheduler:
    """Plays vLLM's scheduler, one `step` at a time: a token budget per step (chunked prefill),
    decode one token per step, requests arriving late or added while others run, finishing at
    max_tokens, and optionally one preemption (recompute from 0). With `max_seqs`, a request
    waits while that many run (vLLM's max_num_seqs). `produced`: the requests that got a token
    in the last step (a streaming engine's outputs)."""

    def __init__(self, runner, budget: int, max_seqs: int | None = None):
        self.runner, self.budget, self.max_seqs = runner, budget, max_seqs
        self.produced: list[Req] = []
        self.live: list[Req] = []
        self.added, self.finished, self.preempted = set(), set(), set()
        self.seen: set[str] = set()    # requests the worker has heard of (a V1 runner resumes them as cached)
        self.as_cached = getattr(runner, "resumes_as_cached", False)
        self.step_no = 0

    def add(self, r: Req) -> None:
        r.tokens = list(r.prompt)
        r.computed = r.cached
        self.live.append(r)

    def busy(self) -> bool:
        return bool(self.live)

    def abort(self, rid: str) -> Req | None:
        """Drop a request; the worker hears of it as finished with the next step."""
        r = next((r for r in self.live if r.rid == rid), None)
        if r is not None:
            self.live.remove(r)
            if rid in self.added:
                self.finished.add(rid)
                self.added.discard(rid)
        return r

    def step(self) -> list[Req]:
        """One scheduler step (one execute_model when anything is scheduled): the requests it finished."""
        new, sched, computed, resumed = [], {}, {}, set()
        left = self.budget
        for r in self.live:
            if r.arrive > self.step_no:
                continue
            if r.preempt_at == self.step_no and r.rid in self.added:
                self.preempted.add(r.rid)
                self.added.discard(r.rid)
                r.computed = 0
                continue
            if r.rid not in self.added and self.as_cached and r.rid in self.seen:
                resumed.add(r.rid)
                self.added.add(r.rid)
            elif r.rid not in self.added:
                if self.max_seqs is not None and len(self.added) >= self.max_seqs:
                    continue
                self.seen.add(r.rid)
                new.append(new_request(r))
                self.added.add(r.rid)
            n = min(len(r.tokens) - r.computed, left)
            if n > 0:
                sched[r.rid], computed[r.rid] = n, r.computed
                left -= n
        if sched:  # like vLLM, the worker hears of finished and preempted requests with a step
            cached = NS(resumed_req_ids=resumed, req_ids=list(computed), num_computed_tokens=list(computed.values()))
            # vLLM's worker steps under inference mode: what the hooks make there is an inference tensor
            with torch.inference_mode():
                self.runner.execute_model(NS(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                                             finished_req_ids=set(self.finished),
                                             preempted_req_ids=set(self.preempted), num_scheduled_tokens=sched,
                                             num_computed=computed, tokens={r.rid: r.tokens for r in self.live}))
            self.finished.clear()
            self.preempted.clear()
        done, self.produced = [], []
        for r in self.live:
            if r.rid in sched:
                r.computed += sched[r.rid]
                if r.computed == len(r.tokens):
                    r.tokens.append(next_token(r.tokens))
                    self.produced.append(r)
                    if len(r.tokens) - len(r.prompt) == r.max_tokens:
                        done.append(r)
                        self.finished.add(r.rid)
                        self.added.discard(r.rid)
        self.live = [r for r in self.live if r not in done]
        self.step_no += 1
        return done


def run(runner, reqs: list[Req], budget: int) -> None:
    """Schedule `reqs` to completion like vLLM's scheduler would, one execute_model per step."""
    sched = Scheduler(runner, budget)
    for r in reqs:
        sched.add(r)
    while sched.busy():
        sched.step()


def hooks_for(plan, model, rows: int = 64, slots: int = 8, pad: int = 8, tp_rank: int = 0, stage: int = 0,
              runner: str = "v2", inline: bool = False, switch: bool = False, prefix_rows: tuple | None = None,
              compiled: bool = True, functions: dict | None = None, kv_manager: type | None = None):
    """The toy runner of vLLM's `runner` ("v2" or "v1") with `plan` installed in `model`, as the
    worker installs it; and its hooks (`inline`: a worker on another node than the API; `switch`:
    with a `Switch` for the hooks to set, `hooks.component(Switch)`, without a driver: no graphs
    here; `prefix_rows`: (block, budget bytes) of kept prefix rows, `hooks.component(PrefixRows)`;
    `compiled` False: every step filled by the numpy reference, tapc/worker/fill.py;
    `functions`: the plan's compiled functions, by name; `kv_manager`: the prefix cache's class
    whose lookup the kept rows limit, a class of its own unless given). Built by the worker's
    own `assemble`."""
    from tapc.wire.config import EngineConfig
    from tapc.worker.assemble import Process, assemble
    from tapc.worker.layout import Layout

    layout = Layout(plan, tp_rank, stage)   # on several GPUs: this one's part of the plan
    buffers = toy_buffers(layout, rows, slots)
    toy, adapter = {"v2": (ToyRunner, V2Adapter), "v1": (ToyRunnerV1, V1Adapter)}[runner]
    runner = toy(model, pad)
    block, budget = prefix_rows or (0, 0)
    config = EngineConfig(plan.to_json(), "", rings=settings.TAPC_RINGS, prefix_rows=budget)
    # CPU memory, no driver, no pinning; small arena segments, so a run spans several files and
    # reuses freed space. With a switch, its idle check is patched into the ops process-wide:
    # callers put it back.
    process = Process(runner, adapter, buffers, ToyCopyOut(buffers.pools), functions or {},
                      lambda api_shm: not inline, block, switch, segment_bytes=4096,
                      kv_manager=kv_manager or type("ToyKVCacheKeepingRows", (ToyKVCache,), {}), compiled=compiled)
    hooks = assemble(layout, config, process).hooks
    return runner, hooks


def over_the_wire(message):
    """`message` after a trip through msgpack, as vLLM sends SamplingParams to the engine core
    and collective_rpc replies back (no pickle: only plain data survives)."""
    import msgspec

    return msgspec.msgpack.decode(msgspec.msgpack.encode(message))


def wire_for(plan, ask: TapRequest | None, tid: str) -> WireRequest | None:
    """What the API submits for `ask`, under tapc id `tid` (None: untapped)."""
    return None if ask is None else WireRequest(tid, check(plan, ask, tid))


def collect(hooks, reqs: list[Req], session: TapSession) -> dict[str, NS]:
    """The tapped requests' outputs as `VLLM.generate` returns them: collected from the
    worker, over the wire, finished by the API's session (`TapSession(plan)`). By request id."""
    tapped = [r for r in reqs if r.wire is not None]
    got = session.results(over_the_wire(hooks.collect([r.wire.id for r in tapped]).to_wire()))
    outs = {}
    for r in tapped:
        outs[r.rid] = output_of(r)
        session.finish(outs[r.rid], r.wire, got[r.wire.id])
    return outs


def output_of(req: Req):
    """What vLLM's RequestOutput carries that assembly reads."""
    return NS(request_id=req.rid, prompt_token_ids=req.prompt, finished=True,
              outputs=[NS(token_ids=req.tokens[len(req.prompt):])])


class ToyCore:
    """Plays vLLM's engine core client: `shutdown` stops its process (here: counted)."""

    def __init__(self):
        self.shutdowns = 0

    def shutdown(self) -> None:
        self.shutdowns += 1


class ToyEngine:
    """Plays vLLM's `LLMEngine` as a harvest drives it: `add_request` while others run, `step`
    returning the outputs of the requests that finished in it (`output_kind` FINAL_ONLY)."""

    def __init__(self, runner: ToyRunner, budget: int):
        self.sched = Scheduler(runner, budget)
        self.steps = 0
        self.engine_core = ToyCore()

    def add_request(self, request_id, prompt, params):
        bad = [t for t in prompt["prompt_token_ids"] if not 0 <= t < VOCAB]
        if bad:   # as vLLM's input processor refuses it
            raise ValueError(f"Token id {bad[0]} is out of vocabulary")
        wire = (params.extra_args or {}).get("tapc")
        self.sched.add(Req(request_id, list(prompt["prompt_token_ids"]), params.max_tokens,
                           None if wire is None else WireRequest.from_wire(wire), arrive=self.sched.step_no))
        return request_id

    def has_unfinished_requests(self) -> bool:
        return self.sched.busy()

    def step(self) -> list:
        self.steps += 1
        return [output_of(r) for r in self.sched.step()]

    def abort_request(self, request_ids) -> None:
        gone = set(request_ids)
        self.sched.live = [r for r in self.sched.live if r.rid not in gone]


class ToyKVCache:
    """Plays vLLM's `KVCacheManager` for the prefix cache: `get_computed_blocks` finds the
    longest run of a request's leading block hashes that are cached, short of its last token,
    unless it skips reading (a stand-in the worker's `cache_lookup_patch` can wrap)."""

    num_kv_cache_groups = 1

    def __init__(self, block: int):
        self.block = block
        self.cached: set = set()

    def get_computed_blocks(self, request):
        if request.skip_reading_prefix_cache:
            return None, 0, 0
        n = 0
        for h in request.block_hashes[: (request.num_tokens - 1) // self.block]:
            if h not in self.cached:
                break
            n += 1
        return None, n * self.block, 0


def block_hashes(salt, tokens: list[int], block: int) -> list[tuple]:
    """A request's block hashes, as vLLM chains them: each full block by its salt and every token to its end."""
    return [(salt, tuple(tokens[:k])) for k in range(block, len(tokens) + 1, block)]


class ToyLLM:
    """Plays `vllm.LLM` behind `tapc.VLLM`: `generate` schedules the submitted requests on the
    toy runner; `collective_rpc` reaches the hooks as the worker's methods do; `llm_engine`
    takes requests one at a time (a harvest's loop).

    With `block` set it plays vLLM's prefix cache too (`kv`, a ToyKVCache): the computed tokens of
    each finished request are cached in full blocks, keyed by the prompt's `cache_salt` and the
    tokens; a new request (unless its SamplingParams skip reading) starts after its longest
    cached prefix, short of its last prompt token, as vLLM does (`KVCacheManager.get_computed_blocks`).
    `cached` lists how many tokens each request got from the cache."""

    def __init__(self, runner: ToyRunner, hooks, budget: int = 16, block: int | None = None):
        self.runner, self.hooks, self.budget, self.block = runner, hooks, budget, block
        self.served = 0
        self.submitted = None   # the sampling params of the last call
        self.llm_engine = ToyEngine(runner, budget)
        self.rpcs: list[str] = []
        self.kv = ToyKVCache(block) if block else None
        self.cached: list[int] = []

    def generate(self, prompts, params, **kwargs):
        self.submitted = params
        wires = [(sp.extra_args or {}).get("tapc") for sp in params]
        reqs = [Req(f"r{self.served + i}", p["prompt_token_ids"], sp.max_tokens,
                    None if w is None else WireRequest.from_wire(w)) for i, (p, sp, w) in enumerate(zip(prompts, params, wires))]
        for r, p, sp in zip(reqs, prompts, params):
            if self.kv is not None:
                request = NS(request_id=r.rid, sampling_params=sp, num_tokens=len(r.prompt),
                             block_hashes=block_hashes(p.get("cache_salt"), r.prompt, self.block),
                             skip_reading_prefix_cache=bool(getattr(sp, "skip_reading_prefix_cache", False)))
                r.cached = self.kv.get_computed_blocks(request)[1]
        self.cached = [r.cached for r in reqs]
        self.served += len(reqs)
        run(self.runner, reqs, self.budget)
        if self.kv is not None:
            for r, p in zip(reqs, prompts):
                # the last token was sampled, never run
                self.kv.cached.update(block_hashes(p.get("cache_salt"), r.tokens[:-1], self.block))
        return [output_of(r) for r in reqs]

    def collective_rpc(self, method, args=()):
        """The worker's RPC `method`: the step loop's own, or the one a step component declares
        (`RunnerHooks.rpc`), as TapWorker's methods reach them."""
        self.rpcs.append(method)
        worker = {"tapc_collect": lambda ids, release=(): self.hooks.collect(ids, release).to_wire(),
                  "tapc_release": self.hooks.release, "tapc_close": self.hooks.arena.close}
        return [over_the_wire((worker.get(method) or self.hooks.rpc(method))(*args))]


def toy_vllm(taps: list[str], params: dict | None = None, block: int | None = None, prefix_rows: int = 0):
    """A `tapc.VLLM` over the toy engine (the API's own request handling and assembly), and
    the worker's hooks. `block`: the toy's prefix cache on, with blocks of that many tokens;
    `prefix_rows`: bytes of captured prompt rows the worker keeps (`prefix_rows_gib`), its
    lookup wrapped as the worker wraps vLLM's (patches.cache_lookup_patch)."""
    from tapc.api.llm import VLLM

    plan = toy_plan(taps)
    # a class of its own, so the worker's wrapper of its lookup lasts as long as this engine
    kv = type("ToyKVCacheKeepingRows", (ToyKVCache,), {})
    runner, hooks = hooks_for(plan, ToyModel(), prefix_rows=(block, prefix_rows) if prefix_rows else None,
                              kv_manager=kv)
    llm = VLLM.__new__(VLLM)
    llm.plan, llm.session = plan, TapSession(plan, params, prefix_rows=bool(prefix_rows))
    llm.llm = ToyLLM(runner, hooks, block=block)
    if prefix_rows:
        llm.llm.kv.__class__ = kv
    return llm, hooks
