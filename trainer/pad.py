"""Pads a trained model's experts with zero units: the board-shaped presets' export.

    python pad.py --preset board|board-small IN.gguf OUT.gguf

Each expert's SwiGLU units go from the trained width to the preset's `pad_ff`: the gate and up
experts gain rows of zeros (their products are exactly zero, and silu(0) * 0 = 0), and the down
experts gain columns of zeros, which multiply those zeros. The model computes the same function,
in the same order for every nonzero term, so its perplexity and greedy text do not change
(`make-model` checks both); only the file's bytes and the multiplications by zero grow. Works on
f32 and Q8_0 files: a Q8_0 block of zeros is 34 zero bytes (a zero scale and zero quants), the
same block `sluice quantize` writes for 32 zero weights, so padding the quantized model gives the
bytes quantizing a padded f32 model would.
"""

import argparse
import sys

import gguf
import numpy as np

from train import PRESETS

# The zero bytes of `n` weights in each type padding supports.
_BLOCK = {
    gguf.GGMLQuantizationType.F32: (1, 4),
    gguf.GGMLQuantizationType.Q8_0: (32, 34),
}


def zero_bytes(ttype, n, name):
    """The bytes of `n` zero weights of type `ttype` (an error names the tensor otherwise)."""
    if ttype not in _BLOCK:
        raise SystemExit(f"pad.py: {name} is {ttype.name}; only F32 and Q8_0 experts can be padded")
    block, size = _BLOCK[ttype]
    if n % block:
        raise SystemExit(f"pad.py: {name}: {n} weights are not whole {ttype.name} blocks of {block}")
    return n // block * size


def field_value(field):
    """A reader field's value and types, as GGUFWriter.add_key_value takes them."""
    vtype = field.types[0]
    sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
    return field.contents(), vtype, sub


def pad(src, dst, ff_pad):
    """Writes `src` to `dst` with every expert `ff_pad` units wide."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    ff_key = f"{arch}.expert_feed_forward_length"
    ff = int(r.fields[ff_key].contents())
    if ff_pad < ff:
        raise SystemExit(f"pad.py: {src} has experts {ff} wide, wider than the pad {ff_pad}")
    w = gguf.GGUFWriter(dst, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        value, vtype, sub = field_value(field)
        if name == ff_key:
            value = ff_pad
        w.add_key_value(name, value, vtype, sub)
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            # (experts, ff, row bytes): rows of zeros after the trained ones.
            data = np.pad(data.view(np.uint8), ((0, 0), (0, ff_pad - ff), (0, 0)))
        elif t.name.endswith("ffn_down_exps.weight"):
            # (experts, embd, ff's bytes): each row's zero weights after its trained ones.
            extra = zero_bytes(t.tensor_type, ff_pad - ff, t.name)
            data = np.pad(data.view(np.uint8), ((0, 0), (0, 0), (0, extra)))
        else:
            w.add_tensor(t.name, data.view(np.uint8), raw_dtype=t.tensor_type)
            continue
        zero_bytes(t.tensor_type, ff_pad, t.name)
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=[p for p, v in PRESETS.items() if v.get("pad_ff")], required=True)
    ap.add_argument("src")
    ap.add_argument("dst")
    a = ap.parse_args()
    pad(a.src, a.dst, PRESETS[a.preset]["pad_ff"])
    print(a.dst, file=sys.stderr)


if __name__ == "__main__":
    main()
