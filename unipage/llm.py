"""`unipage.LLM`: offline generation over a Hugging Face checkpoint with many PEFT adapters.

    from unipage import LLM, SamplingParams

    llm = LLM("path/to/Qwen3-30B-A3B", adapters={"sql": "adapters/sql", "chat": "adapters/chat"})
    outs = llm.generate(["SELECT", "Hello", "Hi"], SamplingParams(temperature=0),
                        adapters=["sql", "chat", None], max_tokens=64)
    print(outs[0].text, outs[0].finish_reason)

Every prompt runs under its own adapter (or none) in one continuously batched
run; prompts are text when the model directory has a ``tokenizer.json``, or
lists of token ids.  Bad input — an unknown adapter, a prompt too long,
bad sampling values — raises ``ValueError`` naming the cause before anything runs.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field

import torch

from unipage.config import LoRAConfig, PoolConfig
from unipage.engine import Engine
from unipage.scheduler import Request, SamplingParams, SchedulerConfig


@dataclass
class Completion:
    """The result of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens (a stop token, when one ended it, is the last)
    finish_reason: str  # "stop", "length", "abort", "slo" or "load_failed"
    adapter: str | None
    text: str | None = None  # decoded tokens when the model has a tokenizer
    logits: list[torch.Tensor] = field(default_factory=list)  # [V] float32 per token (return_logits=True)


class Tokenizer:
    """The model directory's ``tokenizer.json`` through the `tokenizers` library, and its stop tokens."""

    def __init__(self, model_dir: str, hf_config: dict) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.eos_token_ids = _eos_ids(model_dir, hf_config)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def _eos_ids(model_dir: str, hf_config: dict) -> tuple[int, ...]:
    eos = hf_config.get("eos_token_id")
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


class LLM:
    def __init__(self, model_dir: str | os.PathLike, adapters: dict[str, str] | None = None, *,
                 device: str | torch.device | None = None, dtype: str | None = None,
                 pool: PoolConfig | None = None, lora: LoRAConfig | None = None,
                 scheduler: SchedulerConfig | None = None, kernels: str | None = None,
                 load_format: str = "safetensors", cuda_graphs: bool | str | None = None,
                 run_ahead: bool | None = None) -> None:
        """Load ``model_dir`` (config.json + safetensors) onto ``device`` (default CUDA if present)
        in ``dtype`` (default the checkpoint's); register ``adapters`` {name: PEFT directory}.
        ``load_format="dummy"``: random weights from config.json alone (benchmarks).
        ``cuda_graphs``: replay CUDA graphs of decode and mixed steps; ``"decode"``: of decode steps
        only (default: both, with the Triton kernels; see `Engine`).  ``run_ahead``: decode steps launch
        their successors before their tokens reach the host (default: with the decode graphs; `Engine`).
        `close` (or a ``with`` block) releases the engine's shared memory and reader processes."""
        model_dir = os.fspath(model_dir)
        self.engine = Engine(model_dir, device=device, dtype=dtype, pool=pool, lora=lora, scheduler=scheduler,
                             kernels=kernels, load_format=load_format,
                             cuda_graphs=cuda_graphs, run_ahead=run_ahead)
        try:
            has_tokenizer = os.path.exists(os.path.join(model_dir, "tokenizer.json"))
            self.tokenizer = Tokenizer(model_dir, self.engine.hf_config) if has_tokenizer else None
            self._ids = itertools.count()
            for name, path in (adapters or {}).items():
                self.add_adapter(name, path)
        except BaseException:  # no LLM to close: release the engine here
            self.close()
            raise

    def close(self) -> None:
        """Close the engine (`Engine.close`); safe to call again.  `generate` then raises `ClosedError`."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_adapter(self, name: str, path: str | os.PathLike) -> None:
        self.engine.add_adapter(name, path)

    def remove_adapter(self, name: str) -> None:
        self.engine.remove_adapter(name)

    def generate(self, prompts, sampling: SamplingParams | list[SamplingParams] | None = None, *,
                 adapter: str | None = None, adapters: list[str | None] | None = None, max_tokens: int = 16,
                 stop_token_ids: tuple[int, ...] | None = None, ignore_eos: bool = False,
                 return_logits: bool = False) -> list[Completion]:
        """Generate for every prompt; results in prompt order.

        prompts: a string or token-id list, or a list of them.  sampling: one `SamplingParams` for all
        or one per prompt (default: temperature 1).  adapter: for every prompt; adapters: one per
        prompt (None = base model).  stop_token_ids: extra stop tokens (the tokenizer's EOS stops
        too unless ignore_eos).  return_logits: keep each generated token's logits.
        """
        prompts = self._prompts(prompts)
        names = self._per_prompt("adapters", adapters, [adapter] * len(prompts), len(prompts))
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        params = self._per_prompt("sampling", params, params, len(prompts))
        stops = tuple(stop_token_ids or ())
        if self.tokenizer is not None and not ignore_eos:
            stops += self.tokenizer.eos_token_ids
        requests = [Request(f"gen-{next(self._ids)}", ids, name, p, max_tokens, stops)
                    for ids, name, p in zip(prompts, names, params)]
        self._submit(requests)
        return self._run(requests, return_logits)

    # -- helpers -----------------------------------------------------------
    def _prompts(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        out = []
        for prompt in prompts:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer.json in the model directory; "
                                     "pass token id lists instead")
                prompt = self.tokenizer.encode(prompt)
            out.append(list(prompt))
        return out

    @staticmethod
    def _per_prompt(what: str, given, default, count: int) -> list:
        values = default if given is None else list(given)
        if len(values) != count:
            raise ValueError(f"{what} has {len(values)} entries for {count} prompts")
        return values

    def _submit(self, requests: list[Request]) -> None:
        added = []
        try:
            for req in requests:
                self.engine.add_request(req)
                added.append(req.request_id)
        except ValueError:  # RequestError, UnknownAdapterError, a token outside the vocabulary
            for rid in added:  # all or nothing
                self.engine.abort(rid)
            raise

    def _run(self, requests: list[Request], return_logits: bool) -> list[Completion]:
        runner = self.engine.runner
        runner.keep_logits = return_logits
        tokens = {r.request_id: [] for r in requests}
        logits = {r.request_id: [] for r in requests}
        reasons: dict[str, str] = {}
        try:
            while len(reasons) < len(requests):
                outputs = self.engine.step()
                for rid, row in self.engine.last_step.logits.items():
                    logits.get(rid, []).append(row)
                for out in outputs:
                    if out.request_id in tokens:
                        tokens[out.request_id] += out.new_token_ids
                        if out.finished:
                            reasons[out.request_id] = out.finish_reason.value
        finally:
            runner.keep_logits = False
            for rid in set(tokens) - set(reasons):
                self.engine.abort(rid)
        return [self._completion(r, tokens[r.request_id], reasons[r.request_id], logits[r.request_id])
                for r in requests]

    def _completion(self, req: Request, tokens: list[int], reason: str, logits: list) -> Completion:
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else None
        return Completion(req.request_id, list(req.prompt_token_ids), tokens, reason, req.adapter, text, logits)
