"""The `llm` dialect: a Llama-family decoder as a graph of tensor ops.

What the model computes, independent of framework, target and quantization scheme.
Activations are `tensor<?xDxf32>` values whose leading dimension is the token count;
weights are symbols into the model's weight store, never dense constants:

```mlir
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>,
                   %kv: !llm.kv_cache<30x3x8192x64xf32>) -> tensor<?x49152xf32> {
  %token_embd = llm.weight @token_embd q8_0 : tensor<49152x576xf32>
  %x = llm.embedding %tokens, %token_embd : (tensor<?xi32>, tensor<49152x576xf32>) -> tensor<?x576xf32>
  ...
  %logits = llm.logits %h, %token_embd : (tensor<?x576xf32>, tensor<49152x576xf32>) -> tensor<?x49152xf32>
  func.return %logits : tensor<?x49152xf32>
}
```

After `quantize`, every weight names its storage type and every matmul its compute
mode (`a32`: float activations; `a8`: activations quantized to int8 per 32 values).
After `group`, fused forms (`llm.swiglu`, matmuls with a `norm` prologue or a
`residual` to add, attention with `rope`) say which ops become one kernel.

Conventions: weight matrices are `[out, in]` (as stored by GGUF and Hugging Face), so
`llm.matmul %x, %w` is `x · wᵀ`; RoPE rotates the two halves of each head
(the Hugging Face / NeoX convention; the GGUF frontend undoes llama.cpp's row
permutation of Q and K so that both frontends meet here).
"""

from xdsl.ir import Dialect

from llmc.ir.llm.attributes import *  # noqa: F403 (the dialect's names are its modules' names)
from llmc.ir.llm.attributes import ActivationAttr, ComputeAttr, KVCacheType, RopeAttr, StorageAttr
from llmc.ir.llm.model_ops import *  # noqa: F403
from llmc.ir.llm.model_ops import MODEL_OPS, _UnaryOp  # noqa: F401 (lower and canonicalize dispatch on the bases)
from llmc.ir.llm.primitive_ops import *  # noqa: F403
from llmc.ir.llm.primitive_ops import PRIMITIVE_OPS, _BinaryOp, _ReduceOp  # noqa: F401
from llmc.ir.llm.shape_ops import *  # noqa: F403
from llmc.ir.llm.shape_ops import SHAPE_OPS

LLM = Dialect("llm", [*MODEL_OPS, *PRIMITIVE_OPS, *SHAPE_OPS],
              [StorageAttr, ComputeAttr, ActivationAttr, KVCacheType, RopeAttr])
