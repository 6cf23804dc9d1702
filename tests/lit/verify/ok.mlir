// verify: a module whose ops all verify comes out as it went in.
// RUN: llmc-opt %s -p verify | filecheck %s

// CHECK:      func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %x: tensor<?x32xf32>) -> tensor<?x48xf32>
// CHECK-NEXT:   %w = llm.weight @w f32 : tensor<48x32xf32>
// CHECK-NEXT:   %y = llm.matmul %x, %w : (tensor<?x32xf32>, tensor<48x32xf32>) -> tensor<?x48xf32>
// CHECK-NEXT:   func.return %y
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %x: tensor<?x32xf32>) -> tensor<?x48xf32> {
  %w = llm.weight @w f32 : tensor<48x32xf32>
  %y = llm.matmul %x, %w : (tensor<?x32xf32>, tensor<48x32xf32>) -> tensor<?x48xf32>
  func.return %y : tensor<?x48xf32>
}
