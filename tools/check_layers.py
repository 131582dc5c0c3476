#!/usr/bin/env python3
"""Fails when a file includes a layer it may not (docs/design.md, "The layers").

A file under src/<layer>/ (src/attention/<part>/ for the attention layers) may include headers of its
own layer and of the layers below it in ORDER; bench/ includes as engine does. Run by ctest
(Layers.NoFileIncludesALayerItMayNot) or on its own.
"""
import pathlib
import re
import sys

# The layers, lowest first: a file may include its own layer and those below it. The attention
# layer is three, side by side in one folder: the scalar reference, the CPU kernels above it and
# the CUDA kernel above those.
ORDER = ["base", "cert", "formats", "kvcache", "attention/reference", "attention/cpu", "attention/cuda", "model",
         "gate", "engine", "capi", "python", "apps"]
MAY_INCLUDE = {layer: set(ORDER[: i + 1]) for i, layer in enumerate(ORDER)}
# The layer an include names: its first folder, or attention/<part>.
INCLUDE = re.compile(r'^\s*#\s*include\s+"((?:attention/[a-z_]+)|[a-z_]+)/', re.M)


def layer_of(rel: pathlib.Path) -> str:
    if rel.parts[0] != "src":
        return "engine"
    return "/".join(rel.parts[1:3]) if rel.parts[1] == "attention" else rel.parts[1]


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
