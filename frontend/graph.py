"""What the graph frontends (torch.export, ONNX) share: building an `llm` function op by op.

An exported causal LM takes `input_ids [1, T]` (and maybe `attention_mask`, `position_ids`,
past keys and values) and returns `logits [1, T, V]`. `GraphBuilder.decoder` wraps such a
graph in the entry point the rest of llmc compiles, `@forward(%tokens, %pos)`:

```mlir
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>) -> tensor<?x64xf32> {
  %0 = llm.cast %tokens : (tensor<?xi32>) -> tensor<?xi64>
  %input_ids = llm.reshape %0 : tensor<?xi64> -> tensor<1x?xi64>
  ...                                                  // the graph's own ops
  %logits = llm.reshape %out : tensor<1x?x64xf32> -> tensor<?x64xf32>
  func.return %logits : tensor<?x64xf32>
}
```
The graph's `attention_mask` is all ones, its past keys and values are empty (the KV cache
comes from `split`, after `optimize` has raised the attention), and any other outputs
(`present.*`) are dropped. Float parameters become `llm.weight` entries of the builder's
`WeightStore`; integer and boolean tensors become `llm.constant`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, i32, i64
from xdsl.ir import Attribute, Block, Operation, Region, SSAValue

from llmc.errors import ModelFormatError, UsageError
from llmc.frontend.model import Model, ModelConfig
from llmc.ir import llm
from llmc.ir.formats import Storage
from llmc.ir.interpreter import dense, tensor_type
from llmc.ir.weights import Weight, WeightStore
from llmc.runtime.codec import TextCodec

_FLOAT_STORAGE = {np.dtype(np.float32): Storage.F32, np.dtype(np.float16): Storage.F16}


def registrar(table: dict) -> Callable[..., Callable]:
    """`@maps(key, …)`: a decorator entering the function it decorates into `table` under each key,
    how each frontend fills its op table (`@_maps("Gelu")`, `@_maps(aten.gelu)`)."""
    def maps(*keys: object) -> Callable:
        def enter(fn: Callable) -> Callable:
            for key in keys:
                table[key] = fn
            return fn

        return enter

    return maps


class GraphBuilder:
    """Ops appended to one function's block, weights collected in `weights`.

        b = GraphBuilder.decoder(path)         # @forward(%tokens, %pos)
        ids = b.input_ids()
        y = b.add(llm.GatherOp(b.weight("embed", table), ids, 0))
        module = b.finish_decoder(logits)
    """

    def __init__(self, source: Path, arg_types: Sequence[Attribute], arg_names: Sequence[str]):
        self.source = source
        self.weights = WeightStore(source)
        self.block = Block(arg_types=list(arg_types))
        for arg, name in zip(self.block.args, arg_names):
            arg.name_hint = llm.ssa_name(name)
        self._input_ids: SSAValue | None = None
        self._positions: SSAValue | None = None

    @classmethod
    def decoder(cls, source: Path) -> GraphBuilder:
        """A builder of `@forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>)`."""
        return cls(source, [llm.tensor(None, element_type=i32)] * 2, ["tokens", "pos"])

    @property
    def args(self) -> tuple[SSAValue, ...]:
        return tuple(self.block.args)

    def add(self, op: Operation, name: str | None = None) -> SSAValue:
        """Append `op`; its (first) result, named `name` in the printed IR where given."""
        self.block.add_op(op)
        if name is not None and op.results:
            op.results[0].name_hint = llm.ssa_name(name)
        return op.results[0]

    def _batch_of_one(self, arg: SSAValue, name: str) -> SSAValue:
        ids = self.add(llm.CastOp(arg, llm.tensor(None, element_type=i64)))
        return self.add(llm.ReshapeOp(ids, (1, None)), name)

    def input_ids(self) -> SSAValue:
        """The graph's `input_ids`: `%tokens` as `tensor<1x?xi64>`."""
        if self._input_ids is None:
            self._input_ids = self._batch_of_one(self.block.args[0], "input_ids")
        return self._input_ids

    def position_ids(self) -> SSAValue:
        """The graph's `position_ids`: `%pos` as `tensor<1x?xi64>`."""
        if self._positions is None:
            self._positions = self._batch_of_one(self.block.args[1], "position_ids")
        return self._positions

    def attention_mask(self, dtype: np.dtype = np.dtype(np.int64)) -> SSAValue:
        """The graph's `attention_mask`: ones shaped like `input_ids` (one sequence, no padding)."""
        shape = self.add(llm.ShapeOfOp(self.input_ids(), llm.tensor(2, element_type=i64)))
        one = self.constant(np.ones((), dtype))
        return self.add(llm.FillOp(shape, one, tensor_type((1, None), dtype)), "attention_mask")

    def empty_past(self, shape: Sequence[int | None], dtype: np.dtype, name: str) -> SSAValue:
        """A past key or value input with no positions: `shape` with its sequence dimension 0.

        `shape` is `[batch, kv_heads, past, head_dim]` with the batch and the past symbolic or not."""
        if len(shape) != 4 or None in (shape[1], shape[3]):
            raise ModelFormatError(self.source, f"past input '{name}' must be [batch, kv_heads, past, head_dim] "
                                                f"with static heads and head_dim, got {list(shape)}")
        try:
            empty = np.zeros((1, shape[1], 0, shape[3]), dtype)
        except ValueError as e:  # numpy refuses dimensions whose product overflows
            raise ModelFormatError(self.source, f"past input '{name}' has impossible dimensions {list(shape)}") from e
        return self.add(llm.ConstantOp(dense(empty)), name)

    def constant(self, array: np.ndarray, name: str | None = None) -> SSAValue:
        array = np.asarray(array)
        if array.size > llm.ConstantOp.LIMIT:
            raise ModelFormatError(self.source, f"constant '{name}' of {array.size} {array.dtype} elements is too "
                                                f"large for the IR (at most {llm.ConstantOp.LIMIT})")
        return self.add(llm.ConstantOp(dense(array)), name)

    def weight(self, name: str, array: np.ndarray, transposed: bool = False) -> SSAValue:
        """A float parameter as `llm.weight @name`: f32 in the graph (the store keeps f16 data as f16).

        With `transposed`, the store keeps the matrix's transpose (`[out, in]`, as llmc's matmuls
        read weights) and the graph reads it through `llm.transpose`, so `x · W` of an exported
        `MatMul` is `x · (Wᵀ)ᵀ`."""
        if name in self.weights:
            raise ModelFormatError(self.source, f"two parameters are named '{name}'")
        if array.ndim == 0:  # (a scalar buffer, as Gemma's `embed_scale`: a constant, not a weight to stream)
            return self.constant(np.asarray(array, np.float32), name)
        storage = _FLOAT_STORAGE.get(array.dtype)
        if storage is None:
            array, storage = array.astype(np.float32), Storage.F32
        data = array.T if transposed else array
        if transposed and array.ndim != 2:
            raise ModelFormatError(self.source, f"only a matrix can be stored transposed, not '{name}' {array.shape}")
        self.weights.add(Weight(name, storage, tuple(data.shape), data))
        value = self.add(llm.WeightOp(name, storage, data.shape))
        if transposed:
            value = self.add(llm.TransposeOp(value, (1, 0)))
        return value  # f32: the store dequantizes f16 parameters, and the graph computes in f32

    def finish(self, outputs: Sequence[SSAValue], name: str = "forward") -> ModuleOp:
        """The module of one function returning `outputs`."""
        self.block.add_op(func.ReturnOp(*outputs))
        function = func.FuncOp(name, (self.block.arg_types, [v.type for v in outputs]), Region(self.block))
        return ModuleOp([function])

    def finish_decoder(self, logits: SSAValue) -> ModuleOp:
        """`@forward` returning `logits [1, T, V]` as `[T, V]` f32."""
        shape = llm.shape_of(logits)
        if len(shape) != 3 or shape[0] not in (1, None) or shape[2] is None:
            raise ModelFormatError(self.source, f"the logits output must be [1, tokens, vocabulary], got "
                                                f"tensor<{'x'.join('?' if d is None else str(d) for d in shape)}>")
        if llm.element_type(logits) != llm.f32:
            logits = self.add(llm.CastOp(logits, llm.tensor(*shape)))
        return self.finish([self.add(llm.ReshapeOp(logits, (None, shape[2])), "logits")])



GRAPH_SUFFIXES = {".onnx": "onnx", ".pt2": "torch.export"}


def graph_tokenizer(source: Path, tokenizer: str | None) -> TextCodec:
    """A graph file's tokenizer: `tokenizer` (anything `llmc tokenize` takes: a tokenizer.json's
    directory, a .gguf file, a known model name), else the `tokenizer.json` beside the file
    (with `tokenizer_config.json`'s chat template)."""
    from llmc.frontend import KNOWN_MODELS, load_tokenizer
    from llmc.frontend.hf import load_hf_tokenizer

    if tokenizer is not None:
        if not Path(tokenizer).exists() and tokenizer not in KNOWN_MODELS:
            raise UsageError(f"--tokenizer {tokenizer}: no such file or directory (give a tokenizer.json, its "
                             "directory, a .gguf file or a known model name)")
        spec = str(Path(tokenizer).parent) if Path(tokenizer).name == "tokenizer.json" else tokenizer
        return load_tokenizer(spec)
    if not (source.parent / "tokenizer.json").is_file():
        raise UsageError(f"{source}: no tokenizer.json beside it; give one with --tokenizer PATH (a tokenizer.json, "
                         "its directory, a .gguf file or a known model name)")
    return load_hf_tokenizer(source.parent)


def graph_model(source: Path, module: ModuleOp, weights: WeightStore, tokenizer: str | None) -> Model:
    """The `Model` of an imported graph; its config is read from the raised IR (`graph_config`)."""
    return Model(source, None, weights, lambda: graph_tokenizer(source, tokenizer),  # type: ignore[arg-type]
                 graph=module)


def graph_config(module: ModuleOp, source: Path) -> ModelConfig:
    """The facts of a raised graph's `@forward`, for the manifest and `llmc verify`; an error when
    `optimize` did not raise the attention (llmc needs it to cache keys and values)."""
    from llmc.ir import find_function

    ops = list(find_function(module, "forward").body.block.ops)
    attention = [op for op in ops if isinstance(op, llm.AttentionOp)]
    embedding = next((op for op in ops if isinstance(op, llm.EmbeddingOp)), None)
    logits = next((op for op in ops if isinstance(op, llm.LogitsOp)), None)
    if not attention or embedding is None or logits is None:
        missing = "attention" if not attention else "token embedding" if embedding is None else "LM head"
        raise ModelFormatError(source, f"optimize found no {missing} it could raise, so llmc cannot cache this "
                                       "graph's keys and values (see the IR with --compile-to optimize)")
    counted = sorted({op.name for op in ops if isinstance(op, (llm.ShapeOfOp, llm.RangeOp))})
    if counted:
        raise ModelFormatError(source, f"ops that count the tokens ({', '.join(counted)}) are left after optimize: "
                                       "positions computed inside the graph would restart at 0 in every decode step "
                                       "(its RoPE or a mask was not raised; see --compile-to optimize)")
    _, heads, head_dim = llm.shape_of(attention[0].query)
    kv_heads = llm.shape_of(attention[0].key)[1]
    rope = next((op.rope for op in ops if isinstance(op, llm.RopeOp)), None)
    norm = next((op for op in ops if isinstance(op, llm.RMSNormOp)), None)
    widths = [llm.shape_of(op.result)[1] for op in ops if isinstance(op, llm.MatmulOp)]
    cache = attention[0].kv_cache.type
    assert isinstance(cache, llm.KVCacheType)
    table, head = embedding.table.owner, logits.weight.owner
    return ModelConfig(
        arch=GRAPH_SUFFIXES.get(source.suffix, "graph"), vocab_size=llm.shape_of(logits.result)[1] or 0,
        hidden=llm.shape_of(embedding.result)[1] or 0, layers=len(attention), heads=heads or 0, kv_heads=kv_heads or 0,
        head_dim=head_dim or 0, ffn=max(widths, default=1) or 1,
        rope_theta=rope.theta.data if rope is not None else 10000.0,
        rms_eps=norm.eps.value.data if norm is not None else 1e-6, context_length=cache.capacity.data,
        tied_embeddings=isinstance(table, llm.WeightOp) and isinstance(head, llm.WeightOp)
        and table.sym_name == head.sym_name)
