"""The scorer model: encoder + mean pooling + head, LoRA, safetensors-only save/load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from memprune.scorer import (
    DEFAULT_ENCODER,
    HeadSettings,
    LoraSettings,
    Scorer,
    ScorerConfig,
    ScorerError,
    build_head,
    canonical_encoder,
    head_input_dim,
    mean_pool,
    resolve_encoder,
    save_artifact,
)

TEXTS = ["Lucas has a sister named Pilar.", "It rained this morning.", "Priya is a florist.", "ok"]


@pytest.fixture(scope="module")
def vanilla(minilm_path: str) -> Scorer:
    return Scorer.build(ScorerConfig(encoder=minilm_path, max_length=32), seed=3)


def test_encoder_names(minilm_path: str, tmp_path: Path) -> None:
    assert canonical_encoder(minilm_path) == DEFAULT_ENCODER  # portable name in scorer.json
    assert canonical_encoder("all-MiniLM-L6-v2") == DEFAULT_ENCODER
    assert Path(resolve_encoder(DEFAULT_ENCODER)).resolve() == Path(minilm_path).resolve()  # offline
    assert canonical_encoder(str(tmp_path)) == str(tmp_path.resolve())
    assert canonical_encoder("intfloat/multilingual-e5-base") == "intfloat/multilingual-e5-base"


def test_mean_pool_ignores_padding() -> None:
    hidden = torch.tensor([[[1.0, 1.0], [3.0, 3.0], [100.0, 100.0]]])
    assert torch.allclose(mean_pool(hidden, torch.tensor([[1, 1, 0]])), torch.tensor([[2.0, 2.0]]))


def test_head_is_seeded_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = build_head(8, HeadSettings(hidden=4), 0), build_head(8, HeadSettings(hidden=4), 0), build_head(
        8, HeadSettings(hidden=4), 1
    )
    assert torch.equal(torch.rand(1), before)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.net[0].weight, c.net[0].weight)
    assert head_input_dim(a.state_dict()) == 8 and head_input_dim(build_head(5, HeadSettings(hidden=0), 0).state_dict()) == 5


def test_score_range_order_and_embedding_shortcut(vanilla: Scorer) -> None:
    scores = vanilla.score(TEXTS, batch_size=3)
    assert scores.shape == (4,) and scores.dtype == np.float64
    assert ((scores > 0) & (scores < 1)).all()
    # batch composition (padding) does not change a text's score; order is kept
    assert np.allclose(vanilla.score(TEXTS[::-1], batch_size=1)[::-1], scores, atol=1e-6)
    emb = vanilla.embed(TEXTS)
    assert emb.shape == (4, 384)
    assert np.allclose(vanilla.score_embeddings(emb), scores, atol=1e-6)
    assert vanilla.score([]).shape == (0,)
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        vanilla.score(["a", None])  # type: ignore[list-item]


def test_save_load_vanilla_roundtrip(vanilla: Scorer, tmp_path: Path) -> None:
    vanilla.save(tmp_path / "a")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["head.safetensors", "scorer.json"]
    cfg = json.loads((tmp_path / "a" / "scorer.json").read_text())
    assert cfg["encoder"] == DEFAULT_ENCODER and cfg["embedding_dim"] == 384 and cfg["lora"] is None
    loaded = Scorer.load(tmp_path / "a")
    assert np.array_equal(loaded.score(TEXTS), vanilla.score(TEXTS))


def test_lora_roundtrip_and_peft_compatible(minilm_path: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModel

    scorer = Scorer.build(ScorerConfig(encoder=minilm_path, max_length=32), seed=0)
    base_scores = scorer.score(TEXTS)
    scorer.add_lora(LoraSettings(r=4, alpha=8, target_modules=["query", "value"]), seed=0)
    scorer.freeze_encoder()
    trainable = {n for n, p in scorer.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable)
    assert np.allclose(scorer.score(TEXTS), base_scores, atol=1e-6)  # LoRA B starts at 0
    with torch.no_grad():
        for name, p in scorer.encoder.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    tuned = scorer.score(TEXTS)
    assert not np.allclose(tuned, base_scores, atol=1e-4)

    scorer.save(tmp_path / "s2")
    names = sorted(str(p.relative_to(tmp_path / "s2")) for p in (tmp_path / "s2").rglob("*") if p.is_file())
    assert names == ["adapter/adapter_config.json", "adapter/adapter_model.safetensors", "head.safetensors", "scorer.json"]
    loaded = Scorer.load(tmp_path / "s2")
    assert loaded.has_lora and loaded.config.lora is not None and loaded.config.lora.r == 4
    assert np.allclose(loaded.score(TEXTS), tuned, atol=1e-6)
    # the adapter directory is a plain peft adapter
    peft_model = PeftModel.from_pretrained(AutoModel.from_pretrained(minilm_path), str(tmp_path / "s2" / "adapter"))
    assert sum("lora_B" in n for n, _ in peft_model.named_parameters()) > 0


def test_load_errors_name_the_problem(vanilla: Scorer, tmp_path: Path) -> None:
    with pytest.raises(ScorerError, match="no scorer.json"):
        Scorer.load(tmp_path / "missing")
    vanilla.save(tmp_path / "v")
    cfg = json.loads((tmp_path / "v" / "scorer.json").read_text())
    cfg["lora"] = {"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": ["query", "value"]}
    (tmp_path / "v" / "scorer.json").write_text(json.dumps(cfg))
    with pytest.raises(ScorerError, match="adapter_model.safetensors is missing"):
        Scorer.load(tmp_path / "v")
    save_artifact(tmp_path / "w", vanilla.config.model_copy(update={"head": HeadSettings(hidden=7)}), vanilla.head_state())
    with pytest.raises(ScorerError, match="head weights do not match"):
        Scorer.load(tmp_path / "w")
    with pytest.raises(ScorerError, match="cannot be loaded"):
        Scorer.build(ScorerConfig(encoder=str(tmp_path / "not-a-model")))


# ----------------------------------------------------------------- precision


@pytest.fixture(scope="module")
def fitted(minilm_path: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Scorer, Any, Path]:
    """A scorer whose linear head is fitted (ridge, fp32 embeddings) to synthetic usefulness labels, so its
    scores spread like a trained scorer's; with the bullets it scores and its saved artifact."""
    import pyarrow.parquet as pq

    from memprune.synth import generate

    out = tmp_path_factory.mktemp("precision")
    generate(conversations=6, sessions=3, out=out, seed=1)
    bullets = pq.read_table(out / "bullets.parquet").to_pandas()
    scorer = Scorer.build(ScorerConfig(encoder=minilm_path, head={"hidden": 0, "dropout": 0.0}), seed=3)
    assert scorer.precision == "fp32"  # auto, resolved on the CPU
    emb = scorer.embed(bullets["text"].tolist())
    y = np.clip(0.1 + 0.8 * bullets["recurs"].to_numpy(float), 0.05, 0.95)
    x = np.c_[emb, np.ones(len(emb))]
    w = np.linalg.solve(x.T @ x + np.eye(x.shape[1]), x.T @ np.log(y / (1 - y)))
    with torch.no_grad():
        scorer.head.net[1].weight.copy_(torch.tensor(w[:-1], dtype=torch.float32)[None])
        scorer.head.net[1].bias.copy_(torch.tensor(w[-1:], dtype=torch.float32))
    return scorer, bullets, scorer.save(out / "scorer")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_scores_agree_with_fp32(fitted: tuple[Scorer, Any, Path], precision: str) -> None:
    """Stated tolerance: |score - fp32 score| <= 0.03 per bullet, and per session (the unit pruning ranks
    in) Spearman >= 0.95 with fp32, >= 0.99 on average. Runs on the CPU; on CUDA it is the same autocast."""
    from scipy.stats import spearmanr

    from memprune.prune import MemoryPruner

    scorer, bullets, artifact = fitted
    texts = bullets["text"].tolist()
    exact = scorer.score(texts)
    assert exact.std() > 0.15  # a spread like a trained scorer's, else ranks would be noise
    pruner = MemoryPruner(artifact, precision=precision)  # the live-session path loads it at that precision
    half = pruner.score(texts)
    assert pruner.scorer.precision == precision and not np.array_equal(half, exact)  # it really ran in 16 bits
    assert np.abs(half - exact).max() <= 0.03
    rhos = [spearmanr(g["a"], g["b"]).statistic
            for _, g in bullets.assign(a=exact, b=half).groupby(["conversation_id", "session_index"])]
    assert min(rhos) >= 0.95 and np.mean(rhos) >= 0.99, (min(rhos), np.mean(rhos))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_scores_agree_with_the_cpu_fp32_scores(fitted: tuple[Scorer, Any, Path], precision: str) -> None:
    """The same artifact on a CUDA device (what the GPU prune job and `MemoryPruner` on a GPU host run): fp32
    within 1e-4 of the CPU, bf16 within the 16-bit tolerance above; the session ranks agree."""
    from scipy.stats import spearmanr

    from memprune.prune import MemoryPruner

    scorer, bullets, artifact = fitted
    texts = bullets["text"].tolist()
    exact = scorer.score(texts)
    pruner = MemoryPruner(artifact, device="cuda", precision=precision)
    assert str(pruner.scorer.device).startswith("cuda") and pruner.scorer.precision == precision
    got = pruner.score(texts)
    assert np.abs(got - exact).max() <= (1e-4 if precision == "fp32" else 0.03)
    rhos = [spearmanr(g["a"], g["b"]).statistic
            for _, g in bullets.assign(a=exact, b=got).groupby(["conversation_id", "session_index"])]
    assert min(rhos) >= 0.95 and np.mean(rhos) >= 0.99, (min(rhos), np.mean(rhos))


def test_precision_is_set_at_construction_only(fitted: tuple[Scorer, Any, Path]) -> None:
    """Precision is a keyword of `Scorer.load`/`Scorer.build`, resolved there from the device, then read-only."""
    from memprune.prune import MemoryPruner
    from memprune.decision import PruneError

    scorer, _, artifact = fitted
    assert Scorer.load(artifact).precision == "fp32" and Scorer.load(artifact, precision="bf16").precision == "bf16"
    with pytest.raises(ValueError, match="precision must be one of"):
        Scorer.load(artifact, precision="int8")  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        scorer.precision = "bf16"  # type: ignore[misc]
    with pytest.raises(PruneError, match="set when the scorer is loaded"):
        MemoryPruner(scorer, precision="bf16")
    assert MemoryPruner(scorer).scorer.precision == "fp32"


def test_precision_resolution() -> None:
    from memprune.precision import autocast, resolve_precision

    assert resolve_precision("auto", "cpu") == "fp32" and resolve_precision("bf16", "cpu") == "bf16"
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_precision("int8", "cpu")
    with autocast("bf16", "cpu"):
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16
    with autocast("auto", "cpu"):
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float32
