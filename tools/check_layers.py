#!/usr/bin/env python3
"""Fails when a file includes a layer it may not (docs/design.md, "The layers").

A file under src/<layer>/ may include "<other>/..." headers only of the layers MAY_INCLUDE lists for
its own, itself among them; bench/ includes as engine does. Run by ctest
(Layers.NoFileIncludesALayerItMayNot) or on its own.
"""
import pathlib
import re
import sys

# Per layer, lowest first, the layers its files may include, siblings named explicitly.
MAY_INCLUDE = {
    "base": {"base"},
    "cert": {"base", "cert"},
    "quant": {"base", "cert", "quant"},
    "cache": {"base", "cert", "quant", "cache"},
    "attn": {"base", "cert", "quant", "cache", "attn"},
    "kernel": {"base", "cert", "quant", "cache", "attn", "kernel"},
    "attn/cuda": {"base", "cert", "quant", "cache", "attn", "kernel", "attn/cuda"},
    "model": {"base", "cert", "quant", "cache", "attn", "kernel", "attn/cuda", "model"},
    "gate": {"base", "cert", "quant", "cache", "attn", "kernel", "attn/cuda", "model", "gate"},
    "engine": {"base", "cert", "quant", "cache", "attn", "kernel", "attn/cuda", "model", "gate", "engine"},
    "capi": {"base", "cert", "quant", "cache", "attn", "kernel", "attn/cuda", "model", "gate", "engine", "capi"},
    "python": {"base", "cert", "quant", "cache", "attn", "kernel", "attn/cuda", "model", "gate", "engine", "capi",
               "python"},
    "apps": {"base", "cert", "quant", "cache", "attn", "kernel", "attn/cuda", "model", "gate", "engine", "capi",
             "python", "apps"},
}
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
        if own not in MAY_INCLUDE:
            bad.append(f"{rel}: folder '{own}' is not a layer")
            continue
        for layer in INCLUDE.findall(path.read_text(encoding="utf-8")):
            if layer in MAY_INCLUDE and layer not in MAY_INCLUDE[own]:
                bad.append(f"{rel}: includes {layer}/, which layer {own} may not")
    for line in bad:
        print(line, file=sys.stderr)
    print(f"check_layers: {len(files)} files, {len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
