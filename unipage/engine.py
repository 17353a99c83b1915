"""`Engine`: the scheduler, the unified memory, the pool storage and the model runner in one loop.

    step():  out = scheduler.schedule()
             runner drops finished / aborted / preempted requests
             runner adds new requests and grows block tables
             result = runner.execute(out)               # forward + sampling; once the forward is
                 launched: storage starts the file reads of out.adapter_effects' loads, then
                 performs the effects in order (storage starts page copies; runner updates
                 slot tables, sent to the device at the next step)
             scheduler.update(StepResult(result.sampled, loads done, loads failed))

On CUDA an adapter's page copy runs on a side stream; the engine reports the
load done to the scheduler only once its event has completed (`PoolStorage.poll`),
so no request runs on an adapter before its weights are in the pool.  On CPU
a load completes inside the step that starts it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from unipage.adapters import EvictAdapter, LoadAdapter
from unipage.config import LoRAConfig, ModelConfig, PoolConfig, UnipageConfig
from unipage.errors import AdapterBusyError, ClosedError
from unipage.memory import UnifiedMemory
from unipage.models.decoder import DecoderLM
from unipage.models.dummy import DummyCheckpoint
from unipage.models.ops import ops_for
from unipage.models.moe_stacks import MoeStacks
from unipage.models.shrink_stack import ShrinkStack
from unipage.models.weights import Checkpoint, read_config
from unipage.runner import GraphLimits, ModelRunner, StepOutput
from unipage.scheduler import (
    Request,
    RequestOutput,
    Scheduler,
    SchedulerConfig,
    StepResult,
)
from unipage.storage import PoolStorage

log = logging.getLogger(__name__)

CPU_POOL_BYTES = 256 << 20  # default pool on CPU
GPU_POOL_FRACTION = 0.85  # default pool on CUDA: this share of the memory free after the weights
MAX_LAYER_ELEMS = 2**31 - 1  # the kernels address one layer of the pool with 32-bit element offsets
LOAD_FORMATS = ("safetensors", "dummy")
MAX_DENSE_LORA_SLOTS = 4096  # slot capacity given to a dense model's LoRA tables up front (at most)
STALL_STEPS = 1000  # empty steps in a row with work left and nothing in flight: report a stall


def default_pool(model: ModelConfig, device: torch.device, block_tokens: int = 16) -> PoolConfig:
    """CPU: 256 MiB.  CUDA: 85% of the free memory, at most what 32-bit offsets reach in one layer."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * GPU_POOL_FRACTION)
    else:
        budget = CPU_POOL_BYTES
    one_page = UnipageConfig(model, PoolConfig(block_tokens=block_tokens, num_pages=1))
    pages = min(budget // one_page.page_bytes, MAX_LAYER_ELEMS // one_page.page_elems)
    return PoolConfig(block_tokens=block_tokens, num_pages=max(1, pages))


def check_pool_size(config: UnipageConfig) -> None:
    if config.num_pages * config.page_elems > MAX_LAYER_ELEMS:
        raise ValueError(f"pool of {config.num_pages} pages x {config.page_elems} elements per layer exceeds "
                         f"the kernels' 32-bit offsets ({MAX_LAYER_ELEMS} elements per layer); use at most "
                         f"{MAX_LAYER_ELEMS // config.page_elems} pages")


class Engine:
    def __init__(self, model_dir: str | os.PathLike, *, device: str | torch.device | None = None,
                 dtype: str | None = None, pool: PoolConfig | None = None, lora: LoRAConfig | None = None,
                 scheduler: SchedulerConfig | None = None, kernels: str | None = None,
                 load_format: str = "safetensors", cuda_graphs: bool | str | None = None,
                 run_ahead: bool | None = None) -> None:
        """``load_format``: "safetensors" reads the checkpoint's weights; "dummy" needs only its
        ``config.json`` and draws random weights on the device (benchmarks at real shapes).
        ``cuda_graphs``: replay captured CUDA graphs for decode steps (`unipage.graphs`) and, piecewise
        around the attention, for the other steps (`unipage.mixed_graphs`); ``"decode"``: for decode
        steps only; False: none.  Default: both with the Triton kernels on CUDA.
        ``run_ahead``: each decode step launches the next one's graph before the host reads its tokens, so
        that the GPU does not wait for the host between decode steps (`ModelRunner.execute`; the scheduler
        then keeps KV room a token ahead, ``decode_kv_ahead``).  Default: on with the decode graphs, unless
        KV blocks hold one token.  `close` (or a ``with``
        block) releases the pool storage's shared memory and reader processes."""
        self.closed = False
        model_dir = os.fspath(model_dir)
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        hf = read_config(model_dir)
        self.hf_config = hf
        model = ModelConfig.from_hf(hf, dtype)
        dtype_t = getattr(torch, model.dtype)
        ckpt = (DummyCheckpoint(hf, dtype_t, self.device) if load_format == "dummy"
                else Checkpoint(model_dir, dtype_t, self.device))
        self.model = DecoderLM(hf, model, ckpt, ops_for(self.device, kernels))
        del ckpt
        lora = lora or LoRAConfig()
        self._build_stack(lora)  # before the pool takes its share of the free memory
        self.config = UnipageConfig(model, pool or default_pool(model, self.device), lora)
        check_pool_size(self.config)
        for stack in (self.model.stack, self.model.moe_stacks):
            if stack is not None:
                stack.set_slots(self.config.num_pages)
        self.memory = UnifiedMemory(self.config)
        self.storage = PoolStorage(self.config, self.device)
        try:
            max_len = min(int(hf.get("max_position_embeddings") or 4096), 8192)
            scheduler = scheduler or SchedulerConfig(max_model_len=max_len)
            limits = self._graph_limits(cuda_graphs, run_ahead, scheduler)
            if limits is not None and limits.run_ahead and not scheduler.decode_kv_ahead:
                scheduler = dataclasses.replace(scheduler, decode_kv_ahead=1)
            self.scheduler = Scheduler(self.memory, scheduler)
            self.runner = ModelRunner(self.model, self.storage.pool, self.config.pool.block_tokens, self.device,
                                      graphs=limits, lora_slots=self._lora_slots())
        except BaseException:  # no engine to close: release the storage here
            self.close()
            raise
        self.vocab_size = int(hf["vocab_size"])
        self._done: list[str] = []  # loads complete, to report at the next update
        self._failed: list[str] = []
        self._in_flight: dict[str, int] = {}  # adapter -> slot, CUDA copies not yet complete
        self._idle_steps = 0
        self.last_step: StepOutput | None = None

    def close(self) -> None:
        """Release the pool storage (`PoolStorage.close`: its reader processes stop, its shared-memory ring
        and host-copy files go); requests still live are abandoned.  Safe to call again.  After it,
        `add_request`, `step`, `add_adapter`, `remove_adapter` and `capture_graphs` raise `ClosedError`."""
        self.closed = True
        self.storage.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError("the engine is closed: no requests or steps after close()")

    def _build_stack(self, lora: LoRAConfig) -> None:
        """The model's shrink stack (`shrink_stack`), where one is small enough; the projections' old weights
        go back to the device's free memory, which sizes the default pool."""
        self.model.stack = ShrinkStack.build(self.model.layers, lora.max_adapters_per_batch, lora.max_rank,
                                             self.model.ops.fill_entry)
        if lora.moe_stack_entries and any(layer.router is not None for layer in self.model.layers):
            self.model.moe_stacks = MoeStacks(self.model.layers, self.model.model, lora.moe_stack_entries,
                                              lora.max_rank)
        if self.model.stack is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _graph_limits(self, wanted: bool | str | None, ahead: bool | None,
                      sched: SchedulerConfig) -> GraphLimits | None:
        if not (wanted is None or isinstance(wanted, bool) or (isinstance(wanted, str) and wanted == "decode")):
            raise ValueError(f"cuda_graphs must be None, True, False or 'decode', got {wanted!r}")
        if ahead not in (None, True, False):
            raise ValueError(f"run_ahead must be None, True or False, got {ahead!r}")
        triton = self.model.ops.name == "triton"
        if wanted and not triton:
            raise ValueError("cuda_graphs needs the Triton kernels on a CUDA device")
        if not (triton if wanted is None else wanted):
            if ahead:
                raise ValueError("run_ahead needs the decode CUDA graphs (cuda_graphs)")
            return None
        if self.config.pool.block_tokens == 1:  # (every decode would need the page it is run ahead into)
            if ahead:
                raise ValueError("run_ahead needs KV blocks of more than one token")
            ahead = False
        mixed = 0 if wanted == "decode" else sched.max_num_batched_tokens
        return GraphLimits(sched.max_num_seqs, sched.max_model_len, self.config.lora.max_adapters_per_batch, mixed,
                           ahead is not False)

    def _lora_slots(self) -> int | None:
        """Dense models: LoRA tables sized for every adapter the pool could hold (an adapter takes at least
        a page), so their shape — and the decode graphs over them — never change as adapters come and go.
        MoE models grow them on demand: the expert alignment's work scales with the slot capacity."""
        if self.config.model.num_experts:
            return None
        return min(self.config.num_pages, MAX_DENSE_LORA_SLOTS)

    def capture_graphs(self) -> int:
        """Capture the CUDA graphs of every decode batch-size bucket and mixed-step token bucket now rather
        than on first use (a serving start-up step: call it once the adapters in use are resident);
        returns how many graphs (decode) and piece sets (mixed) were captured, 0 without graphs.  A later
        change of the LoRA tables' shape (`LoraTables`) drops them, and they are captured again as
        batches need them."""
        self._check_open()
        runner = self.runner
        return sum(graphs.capture_all() for graphs in (runner.graphs, runner.mixed) if graphs is not None)

    # -- adapters ------------------------------------------------------------
    def add_adapter(self, name: str, path: str | os.PathLike) -> None:
        """Register a PEFT adapter directory under ``name`` (loaded into the pool when first used)."""
        self._check_open()
        self.memory.register_adapter(name, os.fspath(path))

    def remove_adapter(self, name: str) -> None:
        """Unregister ``name``; an `AdapterBusyError` while a live request uses it."""
        self._check_open()
        users = [r.request_id for r in self.scheduler.requests.values() if r.adapter == name]
        if users or name in self._in_flight:
            raise AdapterBusyError(f"adapter {name!r} is used by live requests {users[:5]} or loading; "
                                   f"wait for them or abort them first")
        self.memory.adapters.unregister(name)

    # -- requests ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._check_open()
        bad = [t for t in request.prompt_token_ids if isinstance(t, int) and not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request.request_id!r}: token ids {bad[:5]} outside the vocabulary "
                             f"[0, {self.vocab_size})")
        self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; the requests' new tokens and finishes.

        The adapter effects are performed while the GPU runs the step's forward pass (``execute``'s
        ``during``): no request of this batch reads an adapter being loaded or evicted now, and the pages
        a load writes were free when the step was scheduled, so no kernel of this step touches them
        either.  Their host work (submitting file reads, staging, copy launches, slot tables) then
        overlaps the GPU instead of delaying the forward pass's launch.
        """
        self._check_open()
        out = self.scheduler.schedule()
        self.runner.drop(out)
        self.runner.admit(out)
        if out.adapter_effects or self._in_flight:  # page copies may start in this step: they need not wait
            self.storage.mark_step()  # for it (no copies, no mark: an event record is tens of us on an H200 host)

        performed = False

        def during() -> None:
            nonlocal performed
            self.storage.start_reads(out.adapter_effects)  # before the copies of host copies: reads take longest
            performed = True  # (if submitting raised, `_abandon` performs the effects, reads included)
            self._perform(out.adapter_effects)
            self._poll_loads()  # reads finished: start their page copies

        try:
            result = self.runner.execute(out, during)
        except Exception:
            self._abandon(out, performed)
            raise
        self._poll_loads()  # copies finished while the step ran: report them in this update, a step sooner
        self.last_step = result
        done, failed, self._done, self._failed = self._done, self._failed, [], []
        outputs = self.scheduler.update(StepResult(result.sampled, done, failed))
        self._watch_progress(out, outputs)
        return outputs

    def _abandon(self, out, performed: bool) -> None:
        """The step's forward pass raised: still perform its adapter effects (the adapter manager counts on
        them), and have the scheduler preempt the step's requests, so that the engine can go on (the next
        step drops them from the runner and recomputes them)."""
        try:
            if not performed:
                self._perform(out.adapter_effects)
        finally:
            self.scheduler.abandon_step()

    # -- adapter effects -----------------------------------------------------
    def _perform(self, effects) -> None:
        for effect in effects:
            result = self.storage.apply([effect])
            if isinstance(effect, LoadAdapter):
                self.runner.slot_loaded(effect.slot, effect.pages, effect.layout)
                if result.failed:
                    self.runner.slot_evicted(effect.slot)
                    self._failed.append(effect.name)
                elif result.done:
                    self._done.append(effect.name)
                else:
                    self._in_flight[effect.name] = effect.slot
            elif isinstance(effect, EvictAdapter):
                self.runner.slot_evicted(effect.slot)

    def _poll_loads(self) -> None:
        if self._in_flight:
            result = self.storage.poll()
            for name in result.done:
                self._in_flight.pop(name, None)
                self._done.append(name)
            for name, _ in result.failed:  # a file read in the background failed
                self.runner.slot_evicted(self._in_flight.pop(name))
                self._failed.append(name)

    def _watch_progress(self, out, outputs) -> None:
        busy = out.req_ids or out.adapter_effects or outputs or self._in_flight
        self._idle_steps = 0 if busy else self._idle_steps + 1
        if self._in_flight and not out.req_ids:
            time.sleep(0.0002)  # a copy is in flight and nothing else can run
        if self._idle_steps >= STALL_STEPS and self.scheduler.has_unfinished():
            waiting = [(r.request_id, r.status.value, r.adapter) for r in self.scheduler.requests.values()][:5]
            raise RuntimeError(f"no progress in {STALL_STEPS} steps with requests left, e.g. {waiting}; "
                               f"the pool ({self.config.num_pages} pages) may be too small for them")
