"""Export time: a transformers causal LM rewritten for the pooled paged cache (paged, ring,
latent and linear-attention layers; the attention kernels; fused and quantized projections) and
compiled into one package (``aoti_sessions.llm.export``, ``aoti-sessions export``). Nothing at run
time imports it."""
