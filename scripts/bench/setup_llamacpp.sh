#!/usr/bin/env bash
# Build .venv-llamacpp/: llama.cpp (through llama-cpp-python 0.3.36, built from source for this
# CPU: GGML_NATIVE, i.e. -march=native) for `bench.py --systems llamacpp` and the llama.cpp
# column of scripts/bench/step_times.py, and convert nanoserve's bundled model into the F32 and
# BF16 GGUFs it runs, so that both engines run the same weights. ~6 minutes on 2 cores, mostly
# the C++ build. Idempotent: what is already there is kept; never run by `make run`/`make test`.
#
#   bash scripts/bench/setup_llamacpp.sh            # from the repository root
#   MODEL_DIR=/tmp/models/llama-3.2-1b bash scripts/bench/setup_llamacpp.sh
#       # also convert another HF directory (e.g. scripts/bench/make_model.py's)
#
# The recipe: torch pinned to 2.13.0 (the CPU wheel; the converter imports torch, and an
# unpinned one would pull a multi-GB CUDA build), the llama-cpp-python sdist (its
# vendor/llama.cpp/ holds convert_hf_to_gguf.py and the gguf-py it goes with), built into the
# venv, then the converter's own needs. The model converted is the plain HF directory nanoserve
# loads (nanoserve.entrypoints.bundled.default_model_dir(), from nanoserve's .venv), so the GGUFs
# hold the same dequantized weights. They go to <nanoserve cache>/gguf/ (~/.cache/nanoserve/
# unless NANOSERVE_CACHE_DIR is set), where benchmarks/llamacpp_system.py looks for them.
set -euo pipefail

LLAMACPP_VERSION=0.3.36
TORCH_VERSION=2.13.0
VENV=${LLAMACPP_VENV:-.venv-llamacpp}
PY=${PYTHON:-python3}
SRC="$VENV/src"
SDIST="$SRC/llama_cpp_python-$LLAMACPP_VERSION.tar.gz"
TREE="$SRC/llama_cpp_python-$LLAMACPP_VERSION"

# nanoserve's own venv gives the model directory (and its cache root).
if [ ! -f .venv/.installed ]; then
    make .venv/.installed
fi
MODEL_DIR=${MODEL_DIR:-$(.venv/bin/python -c "from nanoserve.entrypoints.bundled import default_model_dir; print(default_model_dir())")}
GGUF_DIR=$(.venv/bin/python -c "from nanoserve.entrypoints.bundled import cache_root; print(cache_root() / 'gguf')")
NAME=$(basename "$MODEL_DIR")
# The converter reads that directory with transformers: the version that wrote it (nanoserve's;
# the 4.57 that the converter's requirements pin cannot read a 5.x tokenizer_config.json).
TRANSFORMERS_VERSION=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
mkdir -p "$SRC"
if [ ! -f "$SDIST" ]; then
    "$VENV/bin/python" -m pip download -q --no-binary :all: --no-deps \
        "llama-cpp-python==$LLAMACPP_VERSION" -d "$SRC"
fi
[ -f "$TREE/vendor/llama.cpp/convert_hf_to_gguf.py" ] || tar -xzf "$SDIST" -C "$SRC"

if ! "$VENV/bin/python" -c "import torch, transformers, gguf, sentencepiece, safetensors, sys
sys.exit(transformers.__version__ != '$TRANSFORMERS_VERSION')" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
    "$VENV/bin/python" -m pip install -q "transformers==$TRANSFORMERS_VERSION" numpy safetensors \
        "sentencepiece>=0.1.98,<0.3.0" "protobuf>=4.21.0,<5.0.0" "torch==$TORCH_VERSION"
    "$VENV/bin/python" -m pip install -q "$TREE/vendor/llama.cpp/gguf-py"
fi

if ! "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMACPP_VERSION')" 2>/dev/null; then
    echo "building llama-cpp-python $LLAMACPP_VERSION from source (~5 min on 2 cores)..."
    # GGML_NATIVE is on by default for a non-cross build: the kernels are compiled for this CPU.
    "$VENV/bin/python" -m pip install -q --no-binary llama-cpp-python "$SDIST"
fi

mkdir -p "$GGUF_DIR"
for outtype in f32 bf16; do
    out="$GGUF_DIR/$NAME-$outtype.gguf"
    if [ ! -f "$out" ]; then
        echo "converting $MODEL_DIR to $out"
        # Into a temporary name, then renamed: an interrupted conversion leaves no half a file.
        "$VENV/bin/python" "$TREE/vendor/llama.cpp/convert_hf_to_gguf.py" "$MODEL_DIR" \
            --outtype "$outtype" --outfile "$out.tmp"
        mv "$out.tmp" "$out"
    fi
done

"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__); print(llama_cpp.llama_print_system_info().decode())"
ls -la "$GGUF_DIR"
