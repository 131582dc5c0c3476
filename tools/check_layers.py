#!/usr/bin/env python3
"""Fails when a file includes a layer above its own (docs/design.md, "The layers").

Layers, lowest first; a file under src/<layer>/ may include only "<layer>/..." headers of its own
layer or a lower one. bench/ may include anything up to engine, never apps.
"""
import pathlib
import re
import sys

LAYERS = ["base", "cert", "quant", "cache", "attn", "kernel", "attn/cuda", "model", "gate", "engine", "capi", "python",
          "apps"]
# src/attn/cuda/ (the CUDA kernel) is a layer of its own, above the CPU kernel.
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+(?:/cuda(?=/))?)/', re.M)


def layer_of(rel: pathlib.Path) -> str:
    if rel.parts[0] != "src":
        return "engine"
    return "attn/cuda" if rel.parts[1:3] == ("attn", "cuda") else rel.parts[1]


def main() -> int:
    root = pathlib.Path(__file__).resolve().parent.parent
    bad = []
    files = [p for p in (root / "src").rglob("*") if p.suffix in (".h", ".cc", ".inc", ".cu", ".cuh")]
    files += [p for p in (root / "bench").rglob("*") if p.suffix in (".h", ".cc")]
    for path in sorted(files):
        rel = path.relative_to(root)
        own = layer_of(rel)
        if own not in LAYERS:
            bad.append(f"{rel}: folder '{own}' is not a layer")
            continue
        for layer in INCLUDE.findall(path.read_text(encoding="utf-8")):
            if layer in LAYERS and LAYERS.index(layer) > LAYERS.index(own):
                bad.append(f"{rel}: includes {layer}/, above its layer {own}")
    for line in bad:
        print(line, file=sys.stderr)
    print(f"check_layers: {len(files)} files, {len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
