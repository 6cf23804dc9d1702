// split: one @forward becomes the entry points the generation loop calls, each with the KV cache
// resized to max_seq rows: @prefill and @prefill_kv (a chunk of at most prefill_chunk tokens, the
// last token's logits), @decode (one token), @score (every row's logits), @verify (the last token and
// up to `speculate` drafted ones, every row's logits; none with speculate=0).
// RUN: llmc-opt %s -p 'split{prefill_chunk=4 max_seq=16}' | filecheck %s
// RUN: llmc-opt %s -p 'split{max_seq=16 kv_type=f16 max_batch=2 speculate=3}' | filecheck %s --check-prefix=BATCH
// RUN: llmc-opt %s -p 'split{max_seq=16 speculate=0}' | filecheck %s --check-prefix=NONE

// CHECK:      llm.phase = "split"
// CHECK-NOT:  @forward
// CHECK:      func.func @prefill(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %kv: !llm.kv_cache<1x2x16x8xf32>) -> tensor<1x64xf32>
// CHECK-SAME:   attributes {llm.stage = "prefill", llm.max_tokens = 4 : i64}
// CHECK:        [[LAST:%.*]] = llm.last_token %h : tensor<?x32xf32> -> tensor<1x32xf32>
// CHECK-NEXT:   llm.logits [[LAST]], %embd compute a8 : (tensor<1x32xf32>, tensor<64x32xf32>) -> tensor<1x64xf32>
// CHECK:      func.func @prefill_kv({{.*}}) -> tensor<1x64xf32>
// CHECK-SAME:   attributes {llm.stage = "prefill_kv", llm.max_tokens = 4 : i64}
// CHECK:      func.func @decode(%tokens: tensor<1xi32>, %pos: tensor<1xi32>, %kv: !llm.kv_cache<1x2x16x8xf32>) -> tensor<1x64xf32>
// CHECK-SAME:   attributes {llm.stage = "decode", llm.max_tokens = 1 : i64}
// CHECK:        llm.attention {{.*}} : (tensor<1x4x8xf32>, tensor<1x2x8xf32>, tensor<1x2x8xf32>, tensor<1xi32>, !llm.kv_cache<1x2x16x8xf32>) -> tensor<1x4x8xf32>
// CHECK:      func.func @score({{.*}}) -> tensor<?x64xf32>
// CHECK-SAME:   attributes {llm.stage = "score", llm.max_tokens = 4 : i64}
// CHECK-NOT:    llm.last_token
// CHECK:        llm.logits %h, %embd compute a8 : (tensor<?x32xf32>, tensor<64x32xf32>) -> tensor<?x64xf32>
// CHECK:      func.func @verify(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %kv: !llm.kv_cache<1x2x16x8xf32>) -> tensor<?x64xf32>
// CHECK-SAME:   attributes {llm.stage = "verify", llm.max_tokens = 9 : i64}
// CHECK-NOT:    llm.last_token
// CHECK:        llm.logits %h, %embd compute a8 : (tensor<?x32xf32>, tensor<64x32xf32>) -> tensor<?x64xf32>

// An f16 cache of two sequences: every entry point takes each row's slot; @decode a token of each.
// BATCH:      func.func @decode(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %slots: tensor<?xi32>, %kv: !llm.kv_cache<1x2x16x8xf16, slots 2>) -> tensor<?x64xf32>
// BATCH-SAME:   attributes {llm.stage = "decode", llm.max_tokens = 2 : i64}
// BATCH:      func.func @verify(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %slots: tensor<?xi32>, %kv: !llm.kv_cache<1x2x16x8xf16, slots 2>) -> tensor<?x64xf32>
// BATCH-SAME:   attributes {llm.stage = "verify", llm.max_tokens = 4 : i64}

// NONE:       func.func @score
// NONE-NOT:   @verify
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "x86-64-v3", ["avx2"]>, llm.phase = "quantize"} {
  func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %kv: !llm.kv_cache<1x2x64x8xf32>) -> tensor<?x64xf32> {
    %embd = llm.weight @token_embd q8_0 : tensor<64x32xf32>
    %x = llm.embedding %tokens, %embd : (tensor<?xi32>, tensor<64x32xf32>) -> tensor<?x32xf32>
    %wq = llm.weight @q q8_0 : tensor<32x32xf32>
    %q = llm.matmul %x, %wq compute a8 : (tensor<?x32xf32>, tensor<32x32xf32>) -> tensor<?x32xf32>
    %wk = llm.weight @k q8_0 : tensor<16x32xf32>
    %k = llm.matmul %x, %wk compute a8 : (tensor<?x32xf32>, tensor<16x32xf32>) -> tensor<?x16xf32>
    %wv = llm.weight @v q8_0 : tensor<16x32xf32>
    %v = llm.matmul %x, %wv compute a8 : (tensor<?x32xf32>, tensor<16x32xf32>) -> tensor<?x16xf32>
    %qh = llm.reshape %q : tensor<?x32xf32> -> tensor<?x4x8xf32>
    %kh = llm.reshape %k : tensor<?x16xf32> -> tensor<?x2x8xf32>
    %vh = llm.reshape %v : tensor<?x16xf32> -> tensor<?x2x8xf32>
    %a = llm.attention %qh, %kh, %vh, %pos, %kv layer 0 : (tensor<?x4x8xf32>, tensor<?x2x8xf32>, tensor<?x2x8xf32>, tensor<?xi32>, !llm.kv_cache<1x2x64x8xf32>) -> tensor<?x4x8xf32>
    %h = llm.reshape %a : tensor<?x4x8xf32> -> tensor<?x32xf32>
    %logits = llm.logits %h, %embd compute a8 : (tensor<?x32xf32>, tensor<64x32xf32>) -> tensor<?x64xf32>
    func.return %logits : tensor<?x64xf32>
  }
}
