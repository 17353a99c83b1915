"""The baseline of `benchmarks/serve.py --setup d`: transformers + PEFT ``generate`` with adapter switching.

What a user of those libraries would write: one `PeftModel`, every adapter
added with ``load_adapter``, the requests grouped by adapter (in order of
first appearance) and cut into batches of ``batch``; ``set_adapter`` before
each batch, then ``generate`` (greedy, exactly the requested tokens:
``min_new_tokens = max_new_tokens``).  The model has random weights
(``from_config``), made directly on the device.
"""

from __future__ import annotations

import time

import torch
from serve_driver import Workload, log


def adapter_batches(work: Workload, batch: int) -> list[tuple[str, list[int]]]:
    """``(adapter, request indices)`` per generate call: same-adapter groups cut into ``batch``-sized pieces."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(work.adapters):
        if name is None:
            raise ValueError("the PEFT baseline runs adapter requests only")
        groups.setdefault(name, []).append(i)
    return [(name, idx[k:k + batch]) for name, idx in groups.items() for k in range(0, len(idx), batch)]


def load_peft(config, adapters: dict[str, str], device: torch.device, dtype: torch.dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


@torch.inference_mode()
def generate(model, work: Workload, indices: list[int], tokens: int, device: torch.device) -> int:
    ids = torch.tensor([work.prompts[i] for i in indices], device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                         min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    made = out.shape[1] - ids.shape[1]
    if made != tokens:
        raise RuntimeError(f"generate made {made} tokens, asked for {tokens}")
    return made * len(indices)


def run_peft(config, adapters: dict[str, str], work: Workload, device: torch.device, dtype: torch.dtype,
             batch: int, warmup_tokens: int) -> dict:
    """Output tokens/s of ``work`` (its prompts, adapters and output lengths) through transformers + PEFT."""
    if len(set(work.outputs)) != 1:
        raise ValueError("the PEFT baseline needs one output length for all requests")
    model = load_peft(config, adapters, device, dtype)
    batches = adapter_batches(work, batch)
    model.set_adapter(batches[0][0])
    generate(model, work, batches[0][1], warmup_tokens, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start, made = time.perf_counter(), 0
    for k, (name, indices) in enumerate(batches):
        model.set_adapter(name)
        made += generate(model, work, indices, work.outputs[0], device)
        if (k + 1) % max(1, len(batches) // 5) == 0:
            log(f"peft baseline: {k + 1}/{len(batches)} generate calls, {time.perf_counter() - start:.0f} s")
    sync()
    wall = time.perf_counter() - start
    return {"requests": len(work.prompts), "output_tokens": made, "duration_s": round(wall, 4),
            "output_tokens_per_s": round(made / wall, 2), "generate_calls": len(batches),
            "adapter_switches": len(batches)}
