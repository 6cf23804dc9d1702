// lower: llm ops on tensors become tgt kernels on buffers. The entry point takes the token count
// %n, the cache as K and V buffers, and writes the logits to its last argument; weights keep their
// stored layout (pack chooses another); an a8 projection's input is quantized to int8 rows once
// (`tgt.quantize`), and the residual matmul accumulates into %x in place.
// RUN: llmc-opt %s -p lower | filecheck %s

// CHECK-LABEL: func.func @decode(%tokens: memref<1xi32>, %positions: memref<1xi32>, %n: index, %k_cache: memref<1x2x16x8xf32>, %v_cache: memref<1x2x16x8xf32>, %logits: memref<1x64xf32>)
// CHECK-SAME:    tgt.max_tokens = 1 : i64, tgt.kv_layout = "layer,kv_head,position,dim"
// CHECK:         [[EMBD:%.*]] = tgt.weight @token_embd : !tgt.weight<64x32, q8_0, stored>
// CHECK-NEXT:    [[X:%.*]] = tgt.alloc : memref<1x32xf32>
// CHECK-NEXT:    tgt.embedding %tokens, [[EMBD]] -> [[X]] rows %n
// CHECK:         tgt.quantize [[X]] -> [[XQ:%.*]] rows %n : memref<1x32xf32> -> !tgt.qrows<1x32>
// CHECK-NEXT:    tgt.swiglu [[XQ]], {{%.*}}, {{%.*}} -> [[GU:%.*]] rows %n
// CHECK:         tgt.matmul [[GU]], {{%.*}} -> [[X]] rows %n accumulate :
// CHECK:         tgt.matmul {{%.*}}, [[EMBD]] -> %logits rows %n :
// CHECK-NEXT:    func.return
// CHECK-NOT:     llm.
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "x86-64-v3", ["avx2"]>, llm.phase = "group"} {
  func.func @decode(%tokens: tensor<1xi32>, %pos: tensor<1xi32>, %kv: !llm.kv_cache<1x2x16x8xf32>) -> tensor<1x64xf32> attributes {llm.stage = "decode", llm.max_tokens = 1 : i64} {
    %embd = llm.weight @token_embd q8_0 : tensor<64x32xf32>
    %x = llm.embedding %tokens, %embd : (tensor<1xi32>, tensor<64x32xf32>) -> tensor<1x32xf32>
    %wg = llm.weight @gate q8_0 : tensor<64x32xf32>
    %wu = llm.weight @up q8_0 : tensor<64x32xf32>
    %gu = llm.swiglu %x, %wg, %wu compute a8 : (tensor<1x32xf32>, tensor<64x32xf32>, tensor<64x32xf32>) -> tensor<1x64xf32>
    %wd = llm.weight @down q8_0 : tensor<32x64xf32>
    %h = llm.matmul %gu, %wd residual %x compute a8 : (tensor<1x64xf32>, tensor<32x64xf32> residual tensor<1x32xf32>) -> tensor<1x32xf32>
    %logits = llm.logits %h, %embd compute a8 : (tensor<1x32xf32>, tensor<64x32xf32>) -> tensor<1x64xf32>
    func.return %logits : tensor<1x64xf32>
  }
}
