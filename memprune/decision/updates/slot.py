"""The built-in update judge `slot`: does the later bullet B state a new value of the attribute that A states? (no LLM)

A cross-encoder reads each pair together, "A [SEP] B": the all-MiniLM-L6-v2 encoder that memprune installs, with a
low-rank (LoRA) change to each layer's linear maps, mean-pooled into a linear head; B updates A
at probability >= the threshold stored with the weights. Reading both texts at once lets it tell an update phrased
unlike the first fact ("lives in Bergen", later "moved to Oslo", "packed up and settled in Oslo") from a compatible
related fact ("visited Oslo", "has a cousin in Oslo", "also has a dog now"), which no comparison of two separately
made embeddings did (the judge before this one: 30% recall on held-out phrasings, docs/prune.md).

Its weights `slot.safetensors`, next to this module (the LoRA matrices, the head and the threshold; safetensors, no
pickle; 1.3 MB), are written by `bench/lifecycle_bench.py --fit` (`fit` below) from synthetic updates
(`memprune synth --updates`) and the *fit* phrasing families of `memprune.synth.families`; its held-out families
(other verbs, other kinds, the first person) are never fitted on and are what the bench reports. The judge does
not read the scorer's embeddings: it works beside any scorer.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from memprune.decision.updates.registry import Pairs, UpdateJudgeEntry, register

WEIGHTS = Path(__file__).with_name("slot.safetensors")
TARGETS = ("query", "key", "value", "output.dense", "intermediate.dense")  # every layer's linear maps (no pooler)
MAX_LENGTH = 128  # tokens of a pair ("A [SEP] B"); longer pairs are cut (a bullet is a sentence or two)
BATCH = 64


def weights(path: Path = WEIGHTS) -> dict[str, Any]:
    """The fitted tensors: per targeted projection `<module>.lora_A`, `.lora_B`; `lora_scale`, `head.weight`,
    `head.bias`, `threshold`."""
    if not path.exists():
        raise ValueError(f"update judge 'slot': no fitted weights at {path} (bench/lifecycle_bench.py --fit)")
    from safetensors.torch import load_file

    return load_file(str(path))


@functools.lru_cache(maxsize=2)
def _model(path: str, mtime: float) -> tuple[Any, Any, Any, float]:  # keyed by mtime: a refit file is read again
    """(tokenizer, encoder with the LoRA change merged, head, threshold), loaded once per process."""
    import torch

    from memprune.encoders import load_encoder

    w = weights(Path(path))
    encoder, tokenizer = load_encoder(None)
    params = dict(encoder.named_parameters())
    with torch.no_grad():
        for name in sorted({k.rsplit(".lora_", 1)[0] for k in w if ".lora_" in k}):
            params[f"{name}.weight"] += (w[f"{name}.lora_B"] @ w[f"{name}.lora_A"]) * w["lora_scale"]
    head = torch.nn.Linear(w["head.weight"].shape[1], 1)
    head.load_state_dict({"weight": w["head.weight"], "bias": w["head.bias"]})
    encoder.eval()
    return tokenizer, encoder, head.eval(), float(w["threshold"][0])


def model(path: Path = WEIGHTS) -> tuple[Any, Any, Any, float]:
    if not path.exists():
        weights(path)  # the one clear error
    return _model(str(path), path.stat().st_mtime)


def logits(tokenizer: Any, encoder: Any, head: Any, a: list[str], b: list[str]) -> Any:
    """The head's logit of each pair (torch, with gradients where the caller has them on)."""
    from memprune.encoders import mean_pool

    batch = tokenizer(a, b, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    batch = {k: v.to(next(encoder.parameters()).device) for k, v in batch.items()}
    return head(mean_pool(encoder(**batch).last_hidden_state, batch["attention_mask"]))[:, 0]


def probability(a: list[str], b: list[str], path: Path = WEIGHTS) -> np.ndarray:
    """P(B updates A) of each pair, batched by length."""
    import torch

    tokenizer, encoder, head, _ = model(path)
    out = np.zeros(len(a), dtype=np.float32)
    order = np.argsort([len(x) + len(y) for x, y in zip(a, b)], kind="stable")
    with torch.inference_mode():
        for k in range(0, len(order), BATCH):
            idx = order[k:k + BATCH]
            out[idx] = torch.sigmoid(logits(tokenizer, encoder, head, [a[i] for i in idx],
                                            [b[i] for i in idx])).float().numpy()
    return out


def judge(pairs: Pairs, settings: Any = None) -> np.ndarray:
    """B updates A where `probability` is >= the threshold stored with the weights."""
    if not len(pairs):
        return np.zeros(0, dtype=bool)
    return probability(list(pairs.a), list(pairs.b)) >= model()[3]


def fit(a: list[str], b: list[str], y: np.ndarray, seed: int = 0, epochs: int = 3, rank: int = 8, alpha: int = 16,
        lr: float = 5e-4, batch: int = 32, log: Any = print) -> dict[str, Any]:
    """Fit the judge on labelled pairs (y: B updates A): LoRA on the installed encoder plus the head, seeded; the
    tensors `weights` reads, without the threshold (chosen on other pairs by the caller)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from memprune.encoders import load_encoder

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    encoder, tokenizer = load_encoder(None)
    encoder = get_peft_model(encoder, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.1, bias="none",
                                                 target_modules=list(TARGETS)))
    head = torch.nn.Linear(encoder.config.hidden_size, 1)
    params = [p for p in encoder.parameters() if p.requires_grad] + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    target = torch.tensor(np.asarray(y, dtype=np.float32))
    encoder.train()
    for epoch in range(epochs):
        perm, total = rng.permutation(len(a)), 0.0
        for k in range(0, len(perm), batch):
            idx = perm[k:k + batch]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                logits(tokenizer, encoder, head, [a[i] for i in idx], [b[i] for i in idx]), target[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            if (k // batch) % 50 == 0:
                log(f"fit: epoch {epoch + 1}/{epochs}, pair {k}/{len(perm)}, loss {float(loss.detach()):.4f}")
        log(f"fit: epoch {epoch + 1}/{epochs} loss {total / len(a):.4f}")
    out: dict[str, Any] = {}
    for name, module in encoder.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            out[f"{name}.lora_A"] = module.lora_A["default"].weight.detach().clone().contiguous()
            out[f"{name}.lora_B"] = module.lora_B["default"].weight.detach().clone().contiguous()
    out["lora_scale"] = torch.tensor(alpha / rank)
    out["head.weight"] = head.weight.detach().clone().contiguous()
    out["head.bias"] = head.bias.detach().clone().contiguous()
    return out


def save(tensors: dict[str, Any], threshold: float, path: Path = WEIGHTS, meta: dict[str, str] | None = None) -> None:
    """Write the judge's weights with its threshold (safetensors)."""
    import torch
    from safetensors.torch import save_file

    save_file({**{k: v for k, v in tensors.items() if k != "threshold"},
               "threshold": torch.tensor([threshold], dtype=torch.float32)}, str(path), metadata=meta or {})


ENTRY = register(UpdateJudgeEntry(
    "slot", "built-in: a cross-encoder (the installed MiniLM with a LoRA change) reads the pair together and says "
    "whether the later fact gives a new value of the same attribute; fitted on synthetic update families", judge))
