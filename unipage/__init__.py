"""unipage: serve many LoRA adapters of one dense or MoE base model on one GPU, with one paged pool
for the KV cache and the adapters' weights.

``unipage.LLM`` (offline generation) and ``unipage.SamplingParams`` are imported lazily, so the
pure-Python bookkeeping (``unipage.config``, ``unipage.memory``, ``unipage.scheduler``) stays
usable without importing torch.
"""

__all__ = ["LLM", "Completion", "SamplingParams"]


def __getattr__(name: str):
    if name in ("LLM", "Completion"):
        from unipage import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from unipage.scheduler import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'unipage' has no attribute {name!r}")
