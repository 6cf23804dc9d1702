// dce: ops whose results nobody reads are erased, a weight read by nothing with them.
// RUN: llmc-opt %s -p dce | filecheck %s

// CHECK-LABEL: func.func @forward
// CHECK-NOT:   @unused
// CHECK:       [[W:%.*]] = llm.weight @used f32
// CHECK-NEXT:  [[Y:%.*]] = llm.matmul %x, [[W]]
// CHECK-NEXT:  func.return [[Y]]
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %x: tensor<?x32xf32>) -> tensor<?x48xf32> {
  %dead_w = llm.weight @unused f32 : tensor<16x32xf32>
  %dead = llm.matmul %x, %dead_w : (tensor<?x32xf32>, tensor<16x32xf32>) -> tensor<?x16xf32>
  %w = llm.weight @used f32 : tensor<48x32xf32>
  %y = llm.matmul %x, %w : (tensor<?x32xf32>, tensor<48x32xf32>) -> tensor<?x48xf32>
  func.return %y : tensor<?x48xf32>
}
