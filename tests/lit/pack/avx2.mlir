// pack: each weight's layout and each kernel's instruction set, from the target (AVX2 here): integer
// weights in the `tiles_avx2` layout (strips of 16 features × 32-blocks, the high bits' masks transposed for
// AVX2's shifts), every matmul `isa avx2`.
// RUN: llmc-opt %s -p pack | filecheck %s

// CHECK-NOT:    stored
// CHECK:        [[EMBD:%.*]] = tgt.weight @token_embd : !tgt.weight<64x32, q8_0, tiles_avx2>
// CHECK:        tgt.swiglu {{.*}} isa avx2 : !tgt.qrows<1x32>, !tgt.weight<64x32, q8_0, tiles_avx2>, !tgt.weight<64x32, q8_0, tiles_avx2> -> !tgt.qrows<1x64>
// CHECK:        tgt.matmul {{.*}} accumulate isa avx2 :
// CHECK:        tgt.matmul {{.*}}, [[EMBD]] -> %logits rows %n isa avx2 :
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "x86-64-v3", ["avx2"]>, llm.phase = "group"} {
  func.func @decode(%tokens: memref<1xi32>, %positions: memref<1xi32>, %n: index, %k_cache: memref<1x2x16x8xf32>, %v_cache: memref<1x2x16x8xf32>, %logits: memref<1x64xf32>) attributes {llm.stage = "decode", tgt.max_tokens = 1 : i64, tgt.kv_layout = "layer,kv_head,position,dim"} {
    %token_embd = tgt.weight @token_embd : !tgt.weight<64x32, q8_0, stored>
    %x = tgt.alloc : memref<1x32xf32>
    tgt.embedding %tokens, %token_embd -> %x rows %n : memref<1xi32>, !tgt.weight<64x32, q8_0, stored> -> memref<1x32xf32>
    %gate = tgt.weight @gate : !tgt.weight<64x32, q8_0, stored>
    %up = tgt.weight @up : !tgt.weight<64x32, q8_0, stored>
    %gu = tgt.alloc : !tgt.qrows<1x64>
    %x_q = tgt.alloc : !tgt.qrows<1x32>
    tgt.quantize %x -> %x_q rows %n : memref<1x32xf32> -> !tgt.qrows<1x32>
    tgt.swiglu %x_q, %gate, %up -> %gu rows %n : !tgt.qrows<1x32>, !tgt.weight<64x32, q8_0, stored>, !tgt.weight<64x32, q8_0, stored> -> !tgt.qrows<1x64>
    %down = tgt.weight @down : !tgt.weight<32x64, q8_0, stored>
    tgt.matmul %gu, %down -> %x rows %n accumulate : !tgt.qrows<1x64>, !tgt.weight<32x64, q8_0, stored> -> memref<1x32xf32>
    %h_q = tgt.alloc : !tgt.qrows<1x32>
    tgt.quantize %x -> %h_q rows %n : memref<1x32xf32> -> !tgt.qrows<1x32>
    tgt.matmul %h_q, %token_embd -> %logits rows %n : !tgt.qrows<1x32>, !tgt.weight<64x32, q8_0, stored> -> memref<1x64xf32>
    func.return
  }
}
