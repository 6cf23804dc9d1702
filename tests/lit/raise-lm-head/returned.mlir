// raise-lm-head: the matmul whose rows the entry point returns becomes llm.logits (the op later
// phases know as the LM head: decode computes its last row only).
// RUN: llmc-opt %s -p raise-lm-head | filecheck %s

// CHECK-LABEL: func.func @forward
// CHECK:       [[L:%.*]] = llm.logits %h, [[W:%.*]] : (tensor<?x32xf32>, tensor<64x32xf32>) -> tensor<?x64xf32>
// CHECK-NEXT:  func.return [[L]]
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %h: tensor<?x32xf32>) -> tensor<?x64xf32> {
  %w = llm.weight @output f32 : tensor<64x32xf32>
  %m = llm.matmul %h, %w : (tensor<?x32xf32>, tensor<64x32xf32>) -> tensor<?x64xf32>
  func.return %m : tensor<?x64xf32>
}

// A matmul that is not returned stays one.
// CHECK-LABEL: func.func @inner
// CHECK:       llm.matmul
// CHECK-NOT:   llm.logits
func.func @inner(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %h: tensor<?x32xf32>) -> tensor<?x64xf32> {
  %w = llm.weight @output f32 : tensor<64x32xf32>
  %m = llm.matmul %h, %w : (tensor<?x32xf32>, tensor<64x32xf32>) -> tensor<?x64xf32>
  %y = llm.add %m, %m : tensor<?x64xf32>
  func.return %y : tensor<?x64xf32>
}
