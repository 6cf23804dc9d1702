// raise-embedding: rows of a weight gathered by the token ids become llm.embedding
// (a reshape back to the graph's [1, T, D]); dce then drops the gather and the casts.
// RUN: llmc-opt %s -p raise-embedding,dce | filecheck %s

// CHECK-LABEL: func.func @forward
// CHECK:       [[TABLE:%.*]] = llm.weight @embed f32 : tensor<64x32xf32>
// CHECK-NEXT:  [[E:%.*]] = llm.embedding %tokens, [[TABLE]] : (tensor<?xi32>, tensor<64x32xf32>) -> tensor<?x32xf32>
// CHECK-NEXT:  [[X:%.*]] = llm.reshape [[E]] : tensor<?x32xf32> -> tensor<1x?x32xf32>
// CHECK-NEXT:  func.return [[X]]
// CHECK-NOT:   llm.gather
// CHECK-LABEL: func.func @positions
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>) -> tensor<1x?x32xf32> {
  %0 = llm.cast %tokens : (tensor<?xi32>) -> tensor<?xi64>
  %ids = llm.reshape %0 : tensor<?xi64> -> tensor<1x?xi64>
  %table = llm.weight @embed f32 : tensor<64x32xf32>
  %x = llm.gather %table, %ids axis 0 : (tensor<64x32xf32>, tensor<1x?xi64>) -> tensor<1x?x32xf32>
  func.return %x : tensor<1x?x32xf32>
}

// A gather by anything but the token ids stays.
// RUN: llmc-opt %s -p raise-embedding | filecheck %s --check-prefix=OTHER
// OTHER-LABEL: func.func @positions
// OTHER:       llm.gather
// OTHER-NOT:   llm.embedding
func.func @positions(%tokens: tensor<?xi32>, %pos: tensor<?xi32>) -> tensor<?x32xf32> {
  %table = llm.weight @pos_embed f32 : tensor<64x32xf32>
  %x = llm.gather %table, %pos axis 0 : (tensor<64x32xf32>, tensor<?xi32>) -> tensor<?x32xf32>
  func.return %x : tensor<?x32xf32>
}
