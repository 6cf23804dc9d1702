// `llmc opt` moves the module's phase on as phase passes run, so split and group chain on a module
// at `quantize` (split records "split", which group needs); group alone refuses it.
// RUN: llmc-opt %s -p 'split{max_seq=16},group' | filecheck %s
// RUN: not llmc-opt %s -p group 2>&1 | filecheck %s --check-prefix=ERR

// CHECK:       llm.phase = "group"
// CHECK-LABEL: func.func @decode
// CHECK:         llm.swiglu %x, %wg, %wu{{.*}} : (tensor<1x32xf32>, tensor<64x32xf32>, tensor<64x32xf32>) -> tensor<1x64xf32>
// ERR: llmc: error: pass 'group' needs IR after phase 'split'; this module is at phase 'quantize'
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "x86-64-v3", ["avx2"]>, llm.phase = "quantize"} {
  func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %kv: !llm.kv_cache<1x2x64x8xf32>) -> tensor<?x64xf32> {
    %embd = llm.weight @token_embd q8_0 : tensor<64x32xf32>
    %x = llm.embedding %tokens, %embd : (tensor<?xi32>, tensor<64x32xf32>) -> tensor<?x32xf32>
    %wg = llm.weight @gate q8_0 : tensor<64x32xf32>
    %g = llm.matmul %x, %wg compute a8 : (tensor<?x32xf32>, tensor<64x32xf32>) -> tensor<?x64xf32>
    %s = llm.silu %g : tensor<?x64xf32>
    %wu = llm.weight @up q8_0 : tensor<64x32xf32>
    %u = llm.matmul %x, %wu compute a8 : (tensor<?x32xf32>, tensor<64x32xf32>) -> tensor<?x64xf32>
    %gu = llm.mul %s, %u : tensor<?x64xf32>
    %wd = llm.weight @down q8_0 : tensor<32x64xf32>
    %d = llm.matmul %gu, %wd compute a8 : (tensor<?x64xf32>, tensor<32x64xf32>) -> tensor<?x32xf32>
    %logits = llm.logits %d, %embd compute a8 : (tensor<?x32xf32>, tensor<64x32xf32>) -> tensor<?x64xf32>
    func.return %logits : tensor<?x64xf32>
  }
}
