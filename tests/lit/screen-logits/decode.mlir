// screen-logits: decode's LM head (int16 rows of its own, tiles layout, `isa vnni512`), here 2/3 of the
// step's weight products, gets `screen 2.0`; a matmul into a buffer of the step's own does not, nor
// does prefill's LM head (`last_row`, from an RMSNorm's rows).
// RUN: llmc-opt %s -p screen-logits | filecheck %s
// RUN: llmc-opt %s -p "screen-logits{margin=0.5}" | filecheck %s --check-prefix=MARGIN

// CHECK-LABEL: func.func @decode
// CHECK:         tgt.matmul %x, %wq -> %q rows %n norm %g eps 1.000000e-05 quantize <1x32xi16> isa vnni512
// CHECK:         tgt.matmul %x, %token_embd -> %logits rows %n norm %g eps 1.000000e-05 quantize <1x32xi16> screen 2.000000e+00 isa vnni512
// CHECK-LABEL: func.func @prefill
// CHECK-NOT:     screen
// MARGIN:        quantize <1x32xi16> screen 5.000000e-01 isa vnni512
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "icelake-server", ["avx512vnni"]>, llm.phase = "lower"} {
  func.func @decode(%tokens: memref<1xi32>, %n: index, %logits: memref<1x64xf32>) attributes {llm.stage = "decode", tgt.max_tokens = 1 : i64} {
    %token_embd = tgt.weight @token_embd : !tgt.weight<64x32, q8_0, tiles>
    %g = tgt.weight @norm : !tgt.weight<32, f32, stored>
    %wq = tgt.weight @wq : !tgt.weight<32x32, q8_0, tiles>
    %x = tgt.alloc : memref<1x32xf32>
    tgt.embedding %tokens, %token_embd -> %x rows %n : memref<1xi32>, !tgt.weight<64x32, q8_0, tiles> -> memref<1x32xf32>
    %q = tgt.alloc : memref<1x32xf32>
    tgt.matmul %x, %wq -> %q rows %n norm %g eps 1.000000e-05 quantize <1x32xi16> isa vnni512 : memref<1x32xf32>, !tgt.weight<32x32, q8_0, tiles> norm !tgt.weight<32, f32, stored> -> memref<1x32xf32>
    tgt.matmul %x, %token_embd -> %logits rows %n norm %g eps 1.000000e-05 quantize <1x32xi16> isa vnni512 : memref<1x32xf32>, !tgt.weight<64x32, q8_0, tiles> norm !tgt.weight<32, f32, stored> -> memref<1x64xf32>
    func.return
  }
  func.func @prefill(%tokens: memref<32xi32>, %n: index, %logits: memref<1x64xf32>) attributes {llm.stage = "prefill", tgt.max_tokens = 32 : i64} {
    %token_embd = tgt.weight @token_embd : !tgt.weight<64x32, q8_0, tiles>
    %g = tgt.weight @norm : !tgt.weight<32, f32, stored>
    %x = tgt.alloc : memref<32x32xf32>
    tgt.embedding %tokens, %token_embd -> %x rows %n : memref<32xi32>, !tgt.weight<64x32, q8_0, tiles> -> memref<32x32xf32>
    %h = tgt.alloc : !tgt.qrows<32x32xi16>
    tgt.rms_norm %x, %g -> %h rows %n eps 1.000000e-05 : memref<32x32xf32>, !tgt.weight<32, f32, stored> -> !tgt.qrows<32x32xi16>
    tgt.matmul %h, %token_embd -> %logits rows %n last_row isa vnni512 : !tgt.qrows<32x32xi16>, !tgt.weight<64x32, q8_0, tiles> -> memref<1x64xf32>
    func.return
  }
}
