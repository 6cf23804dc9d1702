// quantize: each weight's storage and each projection's compute mode, from the options and the
// target (AVX2: integer dot products, so a8/a16 for integer weights).
// RUN: llmc-opt %s -p 'quantize{quant=q4_0 compute=a8}' | filecheck %s --check-prefix=Q4
// RUN: llmc-opt %s -p quantize | filecheck %s --check-prefix=AUTO
// RUN: not llmc-opt %s -p 'quantize{compute=a4}' 2>&1 | filecheck %s --check-prefix=COMPUTE

// --quant q4_0: float matrices become q4_0; vectors stay f32; the embedding and LM head's table stays
// at q8_0 or above; a8 for every integer weight.
// Q4:      llm.phase = "quantize"
// Q4:      llm.weight @token_embd q8_0 : tensor<64x32xf32>
// Q4:      llm.weight @norm f32 : tensor<32xf32>
// Q4:      llm.weight @up q4_0 : tensor<64x32xf32>
// Q4-NEXT: llm.matmul {{.*}} compute a8 :
// Q4:      llm.weight @down q4_1 : tensor<32x64xf32>
// Q4-NEXT: llm.matmul {{.*}} compute a8 :
// Q4:      llm.logits {{.*}} compute a8 :

// Defaults: stored types kept; float weights compute a32; `auto` without calibration data (as in
// `llmc opt`) ranks the integer ones by width, and AVX2's budget takes them all at a16.
// AUTO:      llm.weight @token_embd f32
// AUTO:      llm.weight @up f32
// AUTO-NEXT: llm.matmul {{.*}} compute a32 :
// AUTO:      llm.weight @down q4_1
// AUTO-NEXT: llm.matmul {{.*}} compute a16 :
// AUTO:      llm.logits {{.*}} compute a32 :

// COMPUTE: llmc: error: --compute must be one of auto, a32, a8, a16, got 'a4'
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "x86-64-v3", ["avx2"]>, llm.phase = "optimize"} {
  func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>) -> tensor<?x64xf32> {
    %token_embd = llm.weight @token_embd f32 : tensor<64x32xf32>
    %x = llm.embedding %tokens, %token_embd : (tensor<?xi32>, tensor<64x32xf32>) -> tensor<?x32xf32>
    %norm = llm.weight @norm f32 : tensor<32xf32>
    %h = llm.rms_norm %x, %norm eps 1.000000e-05 : tensor<?x32xf32>, tensor<32xf32>
    %up = llm.weight @up f32 : tensor<64x32xf32>
    %u = llm.matmul %h, %up : (tensor<?x32xf32>, tensor<64x32xf32>) -> tensor<?x64xf32>
    %down = llm.weight @down q4_1 : tensor<32x64xf32>
    %d = llm.matmul %u, %down : (tensor<?x64xf32>, tensor<32x64xf32>) -> tensor<?x32xf32>
    %logits = llm.logits %d, %token_embd : (tensor<?x32xf32>, tensor<64x32xf32>) -> tensor<?x64xf32>
    func.return %logits : tensor<?x64xf32>
  }
}
