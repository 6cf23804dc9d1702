// fuse-norm: at decode (tgt.max_tokens 1) the RMSNorm into quantized rows goes, and its readers
// normalize and quantize the float rows themselves (`norm ... quantize <1x32>`); a norm whose rows a
// reader reads while it writes the float rows (accumulate into %x) stays, and so do prefill's (32 rows).
// RUN: llmc-opt %s -p fuse-norm | filecheck %s

// CHECK-LABEL: func.func @decode
// CHECK-NOT:     %h = tgt.alloc
// CHECK:         tgt.matmul %x, %wq -> %q rows %n norm %g eps 1.000000e-05 quantize <1x32> isa avx2 : memref<1x32xf32>, !tgt.weight<32x32, q8_0, split> norm !tgt.weight<32, f32, stored> -> memref<1x32xf32>
// CHECK:         tgt.swiglu %x, %gate, %up -> %gu rows %n norm %g eps 1.000000e-05 quantize <1x32> isa avx2 : memref<1x32xf32>
// CHECK:         tgt.rms_norm %x, %g -> %h2
// CHECK-NEXT:    tgt.matmul %h2, %wq -> %x rows %n accumulate isa avx2 : !tgt.qrows<1x32>
// CHECK-LABEL: func.func @prefill
// CHECK:         tgt.rms_norm %x, %g -> %h
// CHECK-NOT:     quantize <
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "x86-64-v3", ["avx2"]>, llm.phase = "lower"} {
  func.func @decode(%tokens: memref<1xi32>, %n: index) attributes {llm.stage = "decode", tgt.max_tokens = 1 : i64} {
    %token_embd = tgt.weight @token_embd : !tgt.weight<64x32, q8_0, split>
    %g = tgt.weight @norm : !tgt.weight<32, f32, stored>
    %wq = tgt.weight @wq : !tgt.weight<32x32, q8_0, split>
    %gate = tgt.weight @gate : !tgt.weight<64x32, q8_0, split>
    %up = tgt.weight @up : !tgt.weight<64x32, q8_0, split>
    %x = tgt.alloc : memref<1x32xf32>
    tgt.embedding %tokens, %token_embd -> %x rows %n : memref<1xi32>, !tgt.weight<64x32, q8_0, split> -> memref<1x32xf32>
    %h = tgt.alloc : !tgt.qrows<1x32>
    tgt.rms_norm %x, %g -> %h rows %n eps 1.000000e-05 : memref<1x32xf32>, !tgt.weight<32, f32, stored> -> !tgt.qrows<1x32>
    %q = tgt.alloc : memref<1x32xf32>
    tgt.matmul %h, %wq -> %q rows %n isa avx2 : !tgt.qrows<1x32>, !tgt.weight<32x32, q8_0, split> -> memref<1x32xf32>
    %gu = tgt.alloc : !tgt.qrows<1x64>
    tgt.swiglu %h, %gate, %up -> %gu rows %n isa avx2 : !tgt.qrows<1x32>, !tgt.weight<64x32, q8_0, split>, !tgt.weight<64x32, q8_0, split> -> !tgt.qrows<1x64>
    %h2 = tgt.alloc : !tgt.qrows<1x32>
    tgt.rms_norm %x, %g -> %h2 rows %n eps 1.000000e-05 : memref<1x32xf32>, !tgt.weight<32, f32, stored> -> !tgt.qrows<1x32>
    tgt.matmul %h2, %wq -> %x rows %n accumulate isa avx2 : !tgt.qrows<1x32>, !tgt.weight<32x32, q8_0, split> -> memref<1x32xf32>
    func.return
  }
  func.func @prefill(%tokens: memref<32xi32>, %n: index) attributes {llm.stage = "prefill", tgt.max_tokens = 32 : i64} {
    %token_embd = tgt.weight @token_embd : !tgt.weight<64x32, q8_0, split>
    %g = tgt.weight @norm : !tgt.weight<32, f32, stored>
    %wq = tgt.weight @wq : !tgt.weight<32x32, q8_0, split>
    %x = tgt.alloc : memref<32x32xf32>
    tgt.embedding %tokens, %token_embd -> %x rows %n : memref<32xi32>, !tgt.weight<64x32, q8_0, split> -> memref<32x32xf32>
    %h = tgt.alloc : !tgt.qrows<32x32>
    tgt.rms_norm %x, %g -> %h rows %n eps 1.000000e-05 : memref<32x32xf32>, !tgt.weight<32, f32, stored> -> !tgt.qrows<32x32>
    %q = tgt.alloc : memref<32x32xf32>
    tgt.matmul %h, %wq -> %q rows %n isa avx2 : !tgt.qrows<32x32>, !tgt.weight<32x32, q8_0, split> -> memref<32x32xf32>
    func.return
  }
}
