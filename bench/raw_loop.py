"""The reference for GPU throughput: a raw length-sorted bf16 forward loop over an encoder (no memprune code).

The model's weights are cast to bf16 (no autocast), texts are sorted by length so batches carry
little padding, and nothing but tokenization, the forward pass and mean pooling runs. The benches
report memprune's throughput as a ratio to this loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence


def raw_bf16_bullets_per_s(encoder: str, texts: Sequence[str], batch_size: int, max_length: int,
                           device: str = "cuda") -> float:
    """Bullets per second of the raw loop over `texts` on `device` (after one warm-up batch)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from memprune.encoders import resolve_encoder

    path = resolve_encoder(encoder)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, torch_dtype=torch.bfloat16).to(device).eval()
    ordered = sorted(texts, key=len)

    def run(batch: Sequence[str]) -> None:
        enc = tok(list(batch), padding=True, truncation=True, max_length=max_length, return_tensors="pt").to(device)
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        (hidden * mask).sum(1) / mask.sum(1)

    with torch.inference_mode():
        run(ordered[:batch_size])
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for i in range(0, len(ordered), batch_size):
            run(ordered[i:i + batch_size])
        if device == "cuda":
            torch.cuda.synchronize()
    return len(ordered) / (time.perf_counter() - started)
