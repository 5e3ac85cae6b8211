#!/usr/bin/env bash
# The GPU path run for real (benchmarks/gpu_check.py says what each stage measures), on a GPU machine
# that has Python 3.12, torch and transformers but no network and none of the project's other
# packages: they travel as wheels in benchmarks/gpu_bundle/ (ignored by git, ~25 MiB).
#
#   bash benchmarks/gpu_check.sh --prepare    here, with PyPI: the bundle (wheels built or fetched
#                                             for cp312 manylinux, SmolLM2-135M's config and
#                                             tokenizer, an ALFWorld subset); minutes once, then kept
#   bash benchmarks/gpu_check.sh [--stages A,B]  on the GPU machine: install the bundle, run the
#                                             stages (all by default; results: $OUT, else
#                                             benchmarks/results/gpu/)
#   bash benchmarks/gpu_check.sh --rehearse [--stages A,B]  here: the same install and stages on the CPU, tiny
#                                             sizes, in .venv-gpu (Python 3.12 with the GPU machine's
#                                             torch and transformers; made on first use, ~4 GB)
#
# docs/gpu.md has the device run's exact command.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
BUNDLE=benchmarks/gpu_bundle
PY312=${PY312:-$(command -v python3.12 || true)}  # builds the wheels and the rehearsal venv
PROJECT_PY=${PROJECT_PY:-.venv/bin/python}  # the project's venv here: reads SmolLM2's GGUF
REHEARSAL_VENV=.venv-gpu

# What the GPU machine lacks, at the versions the CPU venv is tested with (torch, transformers,
# numpy, accelerate, peft and the rest are there: docs/gpu.md).
# deepspeed, jericho and fast_downward_textworld are source-only on PyPI: built here, for cp312.
# jericho's frotz library and the planner are compiled against this machine's glibc (2.36, Debian
# 12); the image's Python 3.12.3 is Ubuntu 24.04's (glibc 2.39), which runs them: the smoke stage's
# ALFWorld reset and step is where that shows.
BUILT="deepspeed==0.19.8 jericho==3.3.1 fast_downward_textworld==20.6.4"
# deepspeed's pydantic; omegaconf for recipes; alfworld and textworld's pure-Python needs; rapidfuzz,
# which envs/webshop imports when `envs` registers every env.
FETCHED="pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0
  omegaconf==2.4.0 alfworld==0.4.2 textworld==1.7.0 mementos==1.3.1 TatSu==5.8.3 hashids==1.3.1 termcolor==3.3.0
  more-itertools==11.2.1 prompt_toolkit==3.0.53 wcwidth==0.9.4 RapidFuzz==3.14.6"
# The GPU image's versions of what the stages import (docs/gpu.md, "The GPU check"), for the
# rehearsal venv; it then drops what that image does not have (pip brings them as dependencies).
IMAGE_PINS="torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 safetensors==0.8.0 tokenizers==0.23.2
  huggingface_hub==1.33.0 numpy==2.5.2 peft psutil pyyaml rich tqdm matplotlib tensorboard requests jinja2
  packaging einops msgpack ninja py-cpuinfo typer"
NOT_IN_IMAGE="pydantic pydantic-core annotated-types typing-inspection tzdata"

need_py312() {
  [ -n "$PY312" ] || { echo "error: no Python 3.12: put python3.12 on PATH or set PY312=/path/to/python3.12" >&2; exit 2; }
}

prepare() {
  need_py312
  mkdir -p "$BUNDLE/wheels"
  # the global pip constraint here caps torch for the CPU venvs; nothing fetched here is torch
  PIP_CONSTRAINT= "$PY312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$BUNDLE/wheels" $FETCHED
  PIP_CONSTRAINT= "$PY312" -m pip wheel -q --no-deps -w "$BUNDLE/wheels" $BUILT
  "$PROJECT_PY" benchmarks/gpu_check.py prepare
  du -sh "$BUNDLE"
}

rehearsal_venv() {
  [ -x "$REHEARSAL_VENV/bin/python" ] && return
  need_py312
  "$PY312" -m venv "$REHEARSAL_VENV"
  PIP_CONSTRAINT= "$REHEARSAL_VENV/bin/pip" install -q $IMAGE_PINS
  "$REHEARSAL_VENV/bin/pip" uninstall -q -y $NOT_IN_IMAGE
}

# Install the bundle and the project (--no-deps: nothing is fetched, nothing the image has is
# replaced), then run every stage; the log goes beside the results.
run_stages() {
  local python=$1 site=$2 out=$3; shift 3
  rm -rf "$site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$BUNDLE"/wheels/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  # --no-build-isolation: the image's setuptools builds it, nothing is fetched. Where that fails,
  # the checkout on PYTHONPATH runs the same code (nothing reads the project's installed metadata).
  "$python" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . \
    || export PYTHONPATH="$PWD:$PYTHONPATH"
  mkdir -p "$out"
  "$python" benchmarks/gpu_check.py run "$@" 2>&1 | tee "$out/gpu_check.log"
}

case "${1:-}" in
  --prepare)
    prepare ;;
  --rehearse)
    shift
    [ -d "$BUNDLE/wheels" ] || prepare
    rehearsal_venv
    # its own extension folder: DeepSpeed's CPU comm op built for this torch and Python
    export TORCH_EXTENSIONS_DIR=$HOME/.cache/turnopd/torch_extensions_gpu_rehearsal OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    start=$SECONDS
    run_stages "$REHEARSAL_VENV/bin/python" /tmp/turnopd_gpu_check_site "${OUT:-runs/gpu_check_rehearsal}" --rehearse "$@"
    echo "rehearsal: $((SECONDS - start)) s"
    ;;
  "" | --stages)
    [ -d "$BUNDLE/wheels" ] || { echo "no $BUNDLE: run 'bash benchmarks/gpu_check.sh --prepare' where PyPI is reachable" >&2; exit 2; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    run_stages python3 /tmp/turnopd_gpu_check_site "${OUT:-benchmarks/results/gpu}" "$@"
    ;;
  *)
    echo "usage: bash benchmarks/gpu_check.sh [--prepare | --rehearse] [--stages A,B]" >&2; exit 2 ;;
esac
