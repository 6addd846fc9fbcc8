"""The reference model as a Hugging Face safetensors repository, converted once from its GGUF.

Model delivery tests serve SmolLM2-135M-Instruct from a hub mirror and an S3 server the way a
real repository looks: `config.json`, `generation_config.json`, `model.safetensors`, the
tokenizer files with the chat template, and files the engine does not need (a README, an
ONNX export) that the fetcher must skip. The conversion dequantizes the GGUF with the engine's
own reader (Hugging Face tensor names), stores float16 weights, and takes the config and the
tokenizer from transformers' GGUF support. It runs once per conversion version and is cached
outside the repository (`$DAVIT_CACHE/models/...`, default `~/.cache/davit`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tests.support import reference_gguf

CONVERSION_VERSION = "1"
REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Files a repository also carries that serving never reads.
EXTRA_FILES = {
    "README.md": "---\nlicense: apache-2.0\n---\n# SmolLM2-135M-Instruct (converted from GGUF)\n",
    "onnx/model.onnx": "not an ONNX model: a file the fetcher must skip\n",
}


def cache_root() -> Path:
    return Path(os.environ.get("DAVIT_CACHE") or Path.home() / ".cache" / "davit")


def smollm2_safetensors() -> Path:
    """The converted repository directory (converted on first use, about a minute)."""
    target = cache_root() / "models" / f"smollm2-135m-instruct-safetensors-v{CONVERSION_VERSION}"
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="convert-", dir=target.parent))
    try:
        _convert(reference_gguf(), work)
        (work / ".complete").write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from davit_engine.loader import gguf_file

    config, tensors = gguf_file.load(gguf)
    weights = {name: tensor.to(torch.float16).contiguous() for name, tensor in tensors}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_config.torch_dtype = "float16"
    hf_config.tie_word_embeddings = "lm_head.weight" not in weights
    hf_config.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name, text in EXTRA_FILES.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    assert config.num_layers == 30, config


if __name__ == "__main__":
    # hack/install.sh converts the model once, so the first delivery test does not.
    print(smollm2_safetensors())
