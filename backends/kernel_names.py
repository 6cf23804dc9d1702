"""Kernel identity, shared by the backends: when two kernel ops are one function, and its readable name.

    kernel_name(op)   # "matmul_q4_1_a8_k576_n576_acc"
"""

from __future__ import annotations

import hashlib

import numpy as np

from llmc.ir import llm, tgt
from llmc.ir.interpreter import rope_inv_freq


def rope_table(head_dim: int, rope: llm.RopeAttr) -> tuple[str, np.ndarray]:
    """The name and values of the constant table of a RoPE's pair frequencies (`rope_inv_freq`)."""
    values = rope_inv_freq(head_dim, rope)
    return f"rope_inv_freq_{values.size}_{hashlib.sha1(values.tobytes()).hexdigest()[:12]}", values


def kernel_key(op: tgt.Kernel) -> tuple:
    """What makes two kernel ops the same function: op, operand roles and types (row buffers
    without their number of rows), properties."""
    operands = tuple((name, tgt.per_row(value.type) if name in op.ROWS else str(value.type))
                     for name, value in op.abi())
    props = tuple(sorted((k, str(v)) for k, v in op.properties.items() if k != "operandSegmentSizes"))
    return (op.name, operands, props)


def kernel_name(op: tgt.Kernel) -> str:
    """A readable function name: the op, then the storage and mode of a matmul, then shapes."""
    base = op.name.removeprefix("tgt.")
    parts = [base]
    weights = [v.type for _, v in op.abi() if isinstance(v.type, tgt.WeightType) and len(v.type.shape) == 2]
    if weights:
        parts.append(weights[0].storage.value)
    if isinstance(op, tgt.Projection):
        rows = op.rows_type()
        parts.append(f"a{rows.bits}" if isinstance(rows, tgt.QRowsType) else "a32")
        widths = [w.shape[0] for w in weights[:3 if isinstance(op, tgt.QkvOp) else 1]]  # (SwiGLU: the gate's)
        parts.append(f"k{weights[0].shape[1]}_n{'_'.join(map(str, widths))}")
        flags = {"bias": "bias", "bq": "bias", "norm": "norm", "accumulate": "acc", "last_row": "last"}
        parts += [short for name, short in flags.items() if getattr(op, name, None) is not None]
    if "out" in dict(op.abi()) and tgt.is_quantized(op.out):
        parts.append(f"q{op.out.type.bits}")
    return "_".join(parts)
