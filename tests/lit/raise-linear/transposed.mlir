// raise-linear: an activation times a transposed weight becomes llm.matmul on [tokens, width] rows,
// and a bias added to it the matmul's `bias`.
// RUN: llmc-opt %s -p raise-linear,dce | filecheck %s

// CHECK-LABEL: func.func @forward
// CHECK-NOT:   llm.batch_matmul
// CHECK-DAG:   [[W:%.*]] = llm.weight @w f32 : tensor<48x32xf32>
// CHECK-DAG:   [[B:%.*]] = llm.weight @b f32 : tensor<48xf32>
// CHECK-DAG:   [[ROWS:%.*]] = llm.reshape %x : tensor<1x?x32xf32> -> tensor<?x32xf32>
// CHECK:       [[M:%.*]] = llm.matmul [[ROWS]], [[W]] bias [[B]] : (tensor<?x32xf32>, tensor<48x32xf32>, tensor<48xf32>) -> tensor<?x48xf32>
// CHECK-NEXT:  [[Z:%.*]] = llm.reshape [[M]] : tensor<?x48xf32> -> tensor<1x?x48xf32>
// CHECK-NEXT:  func.return [[Z]]
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %x: tensor<1x?x32xf32>) -> tensor<1x?x48xf32> {
  %w = llm.weight @w f32 : tensor<48x32xf32>
  %b = llm.weight @b f32 : tensor<48xf32>
  %wt = llm.transpose %w axes [1, 0] : (tensor<48x32xf32>) -> tensor<32x48xf32>
  %y = llm.batch_matmul %x, %wt : (tensor<1x?x32xf32>, tensor<32x48xf32>) -> tensor<1x?x48xf32>
  %z = llm.add %y, %b : (tensor<1x?x48xf32>, tensor<48xf32>) -> tensor<1x?x48xf32>
  func.return %z : tensor<1x?x48xf32>
}

// A product with an activation (not a weight) stays a batch_matmul.
// CHECK-LABEL: func.func @activations
// CHECK:       llm.batch_matmul
// CHECK-NOT:   llm.matmul
func.func @activations(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %x: tensor<1x?x32xf32>, %w: tensor<48x32xf32>) -> tensor<1x?x48xf32> {
  %wt = llm.transpose %w axes [1, 0] : (tensor<48x32xf32>) -> tensor<32x48xf32>
  %y = llm.batch_matmul %x, %wt : (tensor<1x?x32xf32>, tensor<32x48xf32>) -> tensor<1x?x48xf32>
  func.return %y : tensor<1x?x48xf32>
}
