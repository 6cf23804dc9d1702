// plan-memory: every tgt.alloc gets an offset in one arena per entry point (tgt.arena_bytes), and
// buffers whose lifetimes do not overlap share bytes: %h_q reuses %x_q's once the swiglu has read it.
// It ends the lower phase.
// RUN: llmc-opt %s -p plan-memory | filecheck %s

// CHECK:       llm.phase = "lower"
// CHECK-LABEL: func.func @decode
// CHECK-SAME:    tgt.arena_bytes = 384 : i64
// CHECK:         %x = tgt.alloc offset 0 : memref<1x32xf32>
// CHECK:         %gu = tgt.alloc offset 256 : !tgt.qrows<1x64>
// CHECK-NEXT:    %x_q = tgt.alloc offset 128 : !tgt.qrows<1x32>
// CHECK:         %h_q = tgt.alloc offset 128 : !tgt.qrows<1x32>
// CHECK-NOT:     tgt.alloc :
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "x86-64-v3", ["avx2"]>, llm.phase = "group"} {
  func.func @decode(%tokens: memref<1xi32>, %positions: memref<1xi32>, %n: index, %k_cache: memref<1x2x16x8xf32>, %v_cache: memref<1x2x16x8xf32>, %logits: memref<1x64xf32>) attributes {llm.stage = "decode", tgt.max_tokens = 1 : i64, tgt.kv_layout = "layer,kv_head,position,dim"} {
    %token_embd = tgt.weight @token_embd : !tgt.weight<64x32, q8_0, split>
    %x = tgt.alloc : memref<1x32xf32>
    tgt.embedding %tokens, %token_embd -> %x rows %n : memref<1xi32>, !tgt.weight<64x32, q8_0, split> -> memref<1x32xf32>
    %gate = tgt.weight @gate : !tgt.weight<64x32, q8_0, split>
    %up = tgt.weight @up : !tgt.weight<64x32, q8_0, split>
    %gu = tgt.alloc : !tgt.qrows<1x64>
    %x_q = tgt.alloc : !tgt.qrows<1x32>
    tgt.quantize %x -> %x_q rows %n : memref<1x32xf32> -> !tgt.qrows<1x32>
    tgt.swiglu %x_q, %gate, %up -> %gu rows %n isa avx2 : !tgt.qrows<1x32>, !tgt.weight<64x32, q8_0, split>, !tgt.weight<64x32, q8_0, split> -> !tgt.qrows<1x64>
    %down = tgt.weight @down : !tgt.weight<32x64, q8_0, split>
    tgt.matmul %gu, %down -> %x rows %n accumulate isa avx2 : !tgt.qrows<1x64>, !tgt.weight<32x64, q8_0, split> -> memref<1x32xf32>
    %h_q = tgt.alloc : !tgt.qrows<1x32>
    tgt.quantize %x -> %h_q rows %n : memref<1x32xf32> -> !tgt.qrows<1x32>
    tgt.matmul %h_q, %token_embd -> %logits rows %n isa avx2 : !tgt.qrows<1x32>, !tgt.weight<64x32, q8_0, split> -> memref<1x64xf32>
    func.return
  }
}
