"""Writes a GGUF model as a Hugging Face directory (config, tokenizer, bfloat16 safetensors), for
engines that load only that form (vLLM's CPU build). The weights are the GGUF's dequantized, so the
directory runs the same model as `witcert --model` on that file. Runs in .venv (transformers, gguf).

    .venv/bin/python tools/gguf_to_hf.py models/SmolLM2-135M-Instruct.Q4_1.gguf models/SmolLM2-135M-Instruct-hf
"""
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def main(gguf: str, out: str) -> None:
    src, dst = Path(gguf), Path(out)
    if (dst / "config.json").exists():
        print(f"gguf_to_hf: {dst} present")
        return
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
    model.config.quantization_config = None  # the weights are written dense
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    tmp = dst.with_name(dst.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(dst)
    print(f"gguf_to_hf: wrote {dst}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: gguf_to_hf.py MODEL.gguf OUT_DIR")
    main(sys.argv[1], sys.argv[2])
