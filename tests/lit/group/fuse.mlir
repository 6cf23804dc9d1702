// group: chains of ops that share a kernel become fused llm ops: silu(x·Wg) * (x·Wu) is one
// swiglu, and an add of a matmul to a value dead after it is the matmul's in-place residual.
// RUN: llmc-opt %s -p group | filecheck %s

// CHECK:      llm.phase = "group"
// CHECK-LABEL: func.func @decode
// CHECK-NOT:    llm.mul
// CHECK:        [[GU:%.*]] = llm.swiglu %x, %wg, %wu{{.*}} compute a8 : (tensor<1x32xf32>, tensor<64x32xf32>, tensor<64x32xf32>) -> tensor<1x64xf32>
// CHECK-NEXT:   [[WD:%.*]] = llm.weight @down q8_0
// CHECK-NEXT:   [[H:%.*]] = llm.matmul [[GU]], [[WD]] residual %x compute a8 : (tensor<1x64xf32>, tensor<32x64xf32> residual tensor<1x32xf32>) -> tensor<1x32xf32>
// CHECK-NOT:    llm.add
// CHECK:        llm.logits [[H]]
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "x86-64-v3", ["avx2"]>, llm.phase = "split"} {
  func.func @decode(%tokens: tensor<1xi32>, %pos: tensor<1xi32>, %kv: !llm.kv_cache<1x2x16x8xf32>) -> tensor<1x64xf32> attributes {llm.stage = "decode", llm.max_tokens = 1 : i64} {
    %embd = llm.weight @token_embd q8_0 : tensor<64x32xf32>
    %x = llm.embedding %tokens, %embd : (tensor<1xi32>, tensor<64x32xf32>) -> tensor<1x32xf32>
    %wg = llm.weight @gate q8_0 : tensor<64x32xf32>
    %g = llm.matmul %x, %wg compute a8 : (tensor<1x32xf32>, tensor<64x32xf32>) -> tensor<1x64xf32>
    %s = llm.silu %g : tensor<1x64xf32>
    %wu = llm.weight @up q8_0 : tensor<64x32xf32>
    %u = llm.matmul %x, %wu compute a8 : (tensor<1x32xf32>, tensor<64x32xf32>) -> tensor<1x64xf32>
    %gu = llm.mul %s, %u : tensor<1x64xf32>
    %wd = llm.weight @down q8_0 : tensor<32x64xf32>
    %d = llm.matmul %gu, %wd compute a8 : (tensor<1x64xf32>, tensor<32x64xf32>) -> tensor<1x32xf32>
    %h = llm.add %x, %d : tensor<1x32xf32>
    %logits = llm.logits %h, %embd compute a8 : (tensor<1x32xf32>, tensor<64x32xf32>) -> tensor<1x64xf32>
    func.return %logits : tensor<1x64xf32>
  }
}
