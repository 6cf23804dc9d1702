"""Build the `llm` graph of a Llama-family decoder from a `ModelConfig` and its weights.

Both frontends call `build_module`, which is why a GGUF file and a Hugging Face directory
holding the same weights import to the same IR. Weight symbols follow GGUF's tensor
names without the `.weight` suffix (`@blk.3.attn_q`, `@blk.3.attn_q.bias`).

One block, as the IR shows it (Qwen2 adds `bias` operands to the Q/K/V matmuls, Qwen3 an
`llm.rms_norm` of each head of q and k before RoPE, Mistral a `window` to the attention,
Gemma a scaled embedding, `llm.gelu_tanh`, norms after attention and after the feed-forward,
attention `scale` and `softcap`, and a `softcap` on the logits; a mixture of experts an
`llm.moe` for the feed-forward):

```mlir
%h = llm.rms_norm %x, %blk_0_attn_norm eps 1.000000e-05 : tensor<?x576xf32>, tensor<576xf32>
%q = llm.matmul %h, %blk_0_attn_q : (tensor<?x576xf32>, tensor<576x576xf32>) -> tensor<?x576xf32>
... k, v, reshape to heads, rope on q and k ...
%a = llm.attention %qr, %kr, %v3, %pos, %kv layer 0 : (...) -> tensor<?x9x64xf32>
%o = llm.matmul %a2, %blk_0_attn_output : ...
%x1 = llm.add %x, %o : tensor<?x576xf32>
... rms_norm, gate/up matmuls, silu, mul, down matmul, add ...
```
"""

from __future__ import annotations

from xdsl.dialects import builtin, func
from xdsl.ir import Block, Operation, Region, SSAValue

from llmc.errors import ModelFormatError
from llmc.frontend.model import ModelConfig
from llmc.ir import llm
from llmc.ir.weights import WeightStore


def expected_weights(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the graph needs, by symbol, with its logical shape."""
    c = config
    q_width, kv_width = c.heads * c.head_dim, c.kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd": (c.vocab_size, c.hidden), "output_norm": (c.hidden,)}
    if not c.tied_embeddings:
        shapes["output"] = (c.vocab_size, c.hidden)
    for i in range(c.layers):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm": (c.hidden,),
            b + "attn_q": (q_width, c.hidden),
            b + "attn_k": (kv_width, c.hidden),
            b + "attn_v": (kv_width, c.hidden),
            b + "attn_output": (c.hidden, q_width),
            b + "ffn_norm": (c.hidden,),
        }
        if c.experts:
            e, f = c.experts, c.expert_ffn
            shapes |= {b + "ffn_gate_inp": (e, c.hidden), b + "ffn_gate_exps": (e, f, c.hidden),
                       b + "ffn_up_exps": (e, f, c.hidden), b + "ffn_down_exps": (e, c.hidden, f)}
        else:
            shapes |= {b + "ffn_gate": (c.ffn, c.hidden), b + "ffn_up": (c.ffn, c.hidden),
                       b + "ffn_down": (c.hidden, c.ffn)}
        if c.qkv_bias:
            shapes |= {b + "attn_q.bias": (q_width,), b + "attn_k.bias": (kv_width,), b + "attn_v.bias": (kv_width,)}
        if c.qk_norm:
            shapes |= {b + "attn_q_norm": (c.head_dim,), b + "attn_k_norm": (c.head_dim,)}
        if c.post_norms:
            shapes |= {b + "post_attention_norm": (c.hidden,), b + "post_ffw_norm": (c.hidden,)}
    return shapes


def check_weights(config: ModelConfig, weights: WeightStore) -> None:
    """Every needed tensor is present with the shape the config implies, and no other."""
    if config.layers * 9 > len(weights):  # bound the work before listing what a crafted count implies
        raise ModelFormatError(weights.source, f"{config.layers} layers need at least {config.layers * 9} tensors, "
                                               f"the file has {len(weights)}")
    expected = expected_weights(config)
    for name in weights:
        if name not in expected:
            raise ModelFormatError(weights.source, f"unexpected tensor '{name}' (not part of a supported architecture)")
    for name, shape in expected.items():
        if name not in weights:
            raise ModelFormatError(weights.source, f"missing tensor '{name}'")
        if weights[name].shape != shape:
            found = "x".join(map(str, weights[name].shape))
            want = "x".join(map(str, shape))
            raise ModelFormatError(weights.source, f"tensor '{name}' has shape {found}, the config implies {want}")


class _GraphBuilder:
    """Appends ops to one block, naming results for readable IR."""

    def __init__(self, block: Block, weights: WeightStore):
        self.block = block
        self.weights = weights
        self.loaded: dict[str, SSAValue] = {}

    def add(self, op: Operation, name: str | None = None) -> SSAValue:
        self.block.add_op(op)
        result = op.results[0]
        if name is not None:
            result.name_hint = name
        return result

    def weight(self, sym: str) -> SSAValue:
        """An `llm.weight` for `sym`, created once per function."""
        if sym not in self.loaded:
            w = self.weights[sym]
            self.loaded[sym] = self.add(llm.WeightOp(sym, w.storage, w.shape))
        return self.loaded[sym]

    def linear(self, x: SSAValue, sym: str, bias: bool, name: str) -> SSAValue:
        b = self.weight(sym + ".bias") if bias else None
        return self.add(llm.MatmulOp(x, self.weight(sym), b), name)


def build_module(config: ModelConfig, weights: WeightStore) -> builtin.ModuleOp:
    """The `forward` function of the model in the `llm` dialect."""
    check_weights(config, weights)
    c = config
    kv_type = llm.KVCacheType(c.layers, c.kv_heads, c.context_length, c.head_dim)
    ids_type = llm.tensor(None, element_type=builtin.i32)
    block = Block(arg_types=[ids_type, ids_type, kv_type])
    tokens, pos, kv = block.args
    tokens.name_hint, pos.name_hint, kv.name_hint = "tokens", "pos", "kv"
    g = _GraphBuilder(block, weights)

    x = g.add(llm.EmbeddingOp(tokens, g.weight("token_embd"), c.embedding_scale), "x")
    for i in range(c.layers):
        b, n = f"blk.{i}.", f"l{i}_"
        h = g.add(llm.RMSNormOp(x, g.weight(b + "attn_norm"), c.rms_eps), n + "attn_in")
        q = g.linear(h, b + "attn_q", c.qkv_bias, n + "q")
        k = g.linear(h, b + "attn_k", c.qkv_bias, n + "k")
        v = g.linear(h, b + "attn_v", c.qkv_bias, n + "v")
        q = g.add(llm.ReshapeOp(q, [None, c.heads, c.head_dim]), n + "q_heads")
        k = g.add(llm.ReshapeOp(k, [None, c.kv_heads, c.head_dim]), n + "k_heads")
        v = g.add(llm.ReshapeOp(v, [None, c.kv_heads, c.head_dim]), n + "v_heads")
        if c.qk_norm:
            q = g.add(llm.RMSNormOp(q, g.weight(b + "attn_q_norm"), c.rms_eps), n + "q_normed")
            k = g.add(llm.RMSNormOp(k, g.weight(b + "attn_k_norm"), c.rms_eps), n + "k_normed")
        q = g.add(llm.RopeOp(q, pos, c.rope_for(i)), n + "q_rot")
        k = g.add(llm.RopeOp(k, pos, c.rope_for(i)), n + "k_rot")
        scoring = llm.AttentionOp.scoring_properties(window=c.window(i), softcap=c.attn_softcap, scale=c.attn_scale)
        a = g.add(llm.AttentionOp(q, k, v, pos, kv, i, **scoring), n + "attn")
        a = g.add(llm.ReshapeOp(a, [None, c.heads * c.head_dim]), n + "attn_flat")
        o = g.linear(a, b + "attn_output", False, n + "attn_out")
        if c.post_norms:
            o = g.add(llm.RMSNormOp(o, g.weight(b + "post_attention_norm"), c.rms_eps), n + "attn_out_normed")
        x = g.add(llm.AddOp(x, o), n + "x_attn")

        h = g.add(llm.RMSNormOp(x, g.weight(b + "ffn_norm"), c.rms_eps), n + "ffn_in")
        if c.experts:
            experts = (g.weight(b + name) for name in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
            down = g.add(llm.MoeOp(h, *experts, c.experts_used, c.experts_normalized), n + "experts")
        else:
            gate = g.linear(h, b + "ffn_gate", False, n + "gate")
            gate = g.add(llm.ACTIVATION_OPS[c.activation](gate), n + "gate_act")
            up = g.linear(h, b + "ffn_up", False, n + "up")
            down = g.linear(g.add(llm.MulOp(gate, up), n + "gated"), b + "ffn_down", False, n + "down")
        if c.post_norms:
            down = g.add(llm.RMSNormOp(down, g.weight(b + "post_ffw_norm"), c.rms_eps), n + "down_normed")
        x = g.add(llm.AddOp(x, down), n + "x_out")

    h = g.add(llm.RMSNormOp(x, g.weight("output_norm"), c.rms_eps), "final")
    head = g.weight("token_embd" if c.tied_embeddings else "output")
    logits = g.add(llm.LogitsOp(h, head, softcap=c.final_softcap), "logits")
    block.add_op(func.ReturnOp(logits))
    forward = func.FuncOp("forward", (block.arg_types, [logits.type]), Region(block))
    return builtin.ModuleOp([forward])
