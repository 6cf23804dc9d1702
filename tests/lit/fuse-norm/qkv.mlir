// fuse-norm: three matmuls reading one norm's rows at decode (an attention's q, k and v) become one tgt.qkv,
// which normalizes and quantizes the rows once; in program order, biased or not, taking the last one's place
// (after the buffers defined between them). Two readers stay two matmuls.
// RUN: llmc-opt %s -p fuse-norm | filecheck %s

// CHECK-LABEL: func.func @decode
// CHECK-NOT:     tgt.matmul
// CHECK:         %v = tgt.alloc : memref<1x16xf32>
// CHECK-NEXT:    tgt.qkv %x, %wq, %wk, %wv -> %q, %k, %v rows %n bias %bq, %bk, %bv norm %g eps 1.000000e-05 quantize <1x32> isa avx2 : memref<1x32xf32>, !tgt.weight<32x32, q8_0, split>, !tgt.weight<16x32, q8_0, split>, !tgt.weight<16x32, q8_0, split> bias !tgt.weight<32, f32, stored>, !tgt.weight<16, f32, stored>, !tgt.weight<16, f32, stored> norm !tgt.weight<32, f32, stored> -> memref<1x32xf32>, memref<1x16xf32>, memref<1x16xf32>
// CHECK-NOT:     tgt.matmul
// CHECK-LABEL: func.func @verify
// CHECK-NOT:     tgt.qkv
// CHECK:         tgt.matmul %x, %wq -> %q rows %n norm %g eps 1.000000e-05 quantize <4x32> isa avx2
// CHECK:         tgt.matmul %x, %wk -> %k rows %n norm %g eps 1.000000e-05 quantize <4x32> isa avx2
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "x86-64-v3", ["avx2"]>, llm.phase = "lower"} {
  func.func @decode(%tokens: memref<1xi32>, %n: index) attributes {llm.stage = "decode", tgt.max_tokens = 1 : i64} {
    %token_embd = tgt.weight @token_embd : !tgt.weight<64x32, q8_0, split>
    %g = tgt.weight @norm : !tgt.weight<32, f32, stored>
    %wq = tgt.weight @wq : !tgt.weight<32x32, q8_0, split>
    %wk = tgt.weight @wk : !tgt.weight<16x32, q8_0, split>
    %wv = tgt.weight @wv : !tgt.weight<16x32, q8_0, split>
    %bq = tgt.weight @bq : !tgt.weight<32, f32, stored>
    %bk = tgt.weight @bk : !tgt.weight<16, f32, stored>
    %bv = tgt.weight @bv : !tgt.weight<16, f32, stored>
    %x = tgt.alloc : memref<1x32xf32>
    tgt.embedding %tokens, %token_embd -> %x rows %n : memref<1xi32>, !tgt.weight<64x32, q8_0, split> -> memref<1x32xf32>
    %h = tgt.alloc : !tgt.qrows<1x32>
    tgt.rms_norm %x, %g -> %h rows %n eps 1.000000e-05 : memref<1x32xf32>, !tgt.weight<32, f32, stored> -> !tgt.qrows<1x32>
    %q = tgt.alloc : memref<1x32xf32>
    tgt.matmul %h, %wq -> %q rows %n bias %bq isa avx2 : !tgt.qrows<1x32>, !tgt.weight<32x32, q8_0, split> bias !tgt.weight<32, f32, stored> -> memref<1x32xf32>
    %k = tgt.alloc : memref<1x16xf32>
    tgt.matmul %h, %wk -> %k rows %n bias %bk isa avx2 : !tgt.qrows<1x32>, !tgt.weight<16x32, q8_0, split> bias !tgt.weight<16, f32, stored> -> memref<1x16xf32>
    %v = tgt.alloc : memref<1x16xf32>
    tgt.matmul %h, %wv -> %v rows %n bias %bv isa avx2 : !tgt.qrows<1x32>, !tgt.weight<16x32, q8_0, split> bias !tgt.weight<16, f32, stored> -> memref<1x16xf32>
    func.return
  }
  func.func @verify(%tokens: memref<4xi32>, %n: index) attributes {llm.stage = "verify", tgt.max_tokens = 4 : i64} {
    %token_embd = tgt.weight @token_embd : !tgt.weight<64x32, q8_0, split>
    %g = tgt.weight @norm : !tgt.weight<32, f32, stored>
    %wq = tgt.weight @wq : !tgt.weight<32x32, q8_0, split>
    %wk = tgt.weight @wk : !tgt.weight<16x32, q8_0, split>
    %x = tgt.alloc : memref<4x32xf32>
    tgt.embedding %tokens, %token_embd -> %x rows %n : memref<4xi32>, !tgt.weight<64x32, q8_0, split> -> memref<4x32xf32>
    %h = tgt.alloc : !tgt.qrows<4x32>
    tgt.rms_norm %x, %g -> %h rows %n eps 1.000000e-05 : memref<4x32xf32>, !tgt.weight<32, f32, stored> -> !tgt.qrows<4x32>
    %q = tgt.alloc : memref<4x32xf32>
    tgt.matmul %h, %wq -> %q rows %n isa avx2 : !tgt.qrows<4x32>, !tgt.weight<32x32, q8_0, split> -> memref<4x32xf32>
    %k = tgt.alloc : memref<4x16xf32>
    tgt.matmul %h, %wk -> %k rows %n isa avx2 : !tgt.qrows<4x32>, !tgt.weight<16x32, q8_0, split> -> memref<4x16xf32>
    func.return
  }
}
