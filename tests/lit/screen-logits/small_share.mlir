// screen-logits: an LM head below `min_share` (1/3) of decode's weight products stays exact: here its
// 64x32 are a quarter of them (SwiGLU's gate and up 96x32 each); with min_share 0.1 it is screened.
// RUN: llmc-opt %s -p screen-logits | filecheck %s
// RUN: llmc-opt %s -p "screen-logits{min_share=0.1}" | filecheck %s --check-prefix=LOW

// CHECK-NOT:     screen
// LOW:           screen 2.000000e+00
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "icelake-server", ["avx512vnni"]>, llm.phase = "lower"} {
  func.func @decode(%tokens: memref<1xi32>, %n: index, %logits: memref<1x64xf32>) attributes {llm.stage = "decode", tgt.max_tokens = 1 : i64} {
    %token_embd = tgt.weight @token_embd : !tgt.weight<64x32, q8_0, tiles>
    %g = tgt.weight @norm : !tgt.weight<32, f32, stored>
    %gate = tgt.weight @gate : !tgt.weight<96x32, q8_0, tiles>
    %up = tgt.weight @up : !tgt.weight<96x32, q8_0, tiles>
    %x = tgt.alloc : memref<1x32xf32>
    tgt.embedding %tokens, %token_embd -> %x rows %n : memref<1xi32>, !tgt.weight<64x32, q8_0, tiles> -> memref<1x32xf32>
    %gu = tgt.alloc : memref<1x96xf32>
    tgt.swiglu %x, %gate, %up -> %gu rows %n norm %g eps 1.000000e-05 quantize <1x32xi16> isa vnni512 : memref<1x32xf32>, !tgt.weight<96x32, q8_0, tiles>, !tgt.weight<96x32, q8_0, tiles> norm !tgt.weight<32, f32, stored> -> memref<1x96xf32>
    tgt.matmul %x, %token_embd -> %logits rows %n norm %g eps 1.000000e-05 quantize <1x32xi16> isa vnni512 : memref<1x32xf32>, !tgt.weight<64x32, q8_0, tiles> norm !tgt.weight<32, f32, stored> -> memref<1x64xf32>
    func.return
  }
}
