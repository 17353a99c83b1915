"""Model definitions on the paged kernels: one decoder for every supported family.

``weights`` reads Hugging Face checkpoints, ``decoder`` is the model (Llama, Mistral,
Qwen2, Qwen3, Qwen3-MoE, Mixtral, OLMoE, GPT-OSS), ``rope`` the rotary embeddings,
``lora_tables`` the per-slot adapter metadata, ``ops`` the kernel set (torch on CPU,
Triton on CUDA), ``random_checkpoint`` random test/demo checkpoints.
"""
