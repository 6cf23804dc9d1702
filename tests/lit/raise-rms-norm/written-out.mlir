// raise-rms-norm: RMSNorm written out (mean of squares, plus eps, reciprocal square root, times the
// input, times a weight) becomes llm.rms_norm with the eps it read.
// RUN: llmc-opt %s -p raise-rms-norm,dce | filecheck %s

// CHECK-LABEL: func.func @forward
// CHECK:       [[W:%.*]] = llm.weight @norm f32 : tensor<32xf32>
// CHECK-NEXT:  [[Y:%.*]] = llm.rms_norm %x, [[W]] eps 1.000000e-06 : tensor<1x?x32xf32>, tensor<32xf32>
// CHECK-NEXT:  func.return [[Y]]
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %x: tensor<1x?x32xf32>) -> tensor<1x?x32xf32> {
  %two = llm.constant dense<2.000000e+00> : tensor<f32>
  %eps = llm.constant dense<1.000000e-06> : tensor<f32>
  %sq = llm.pow %x, %two : (tensor<1x?x32xf32>, tensor<f32>) -> tensor<1x?x32xf32>
  %ms = llm.reduce_mean %sq axes [2] keepdims : (tensor<1x?x32xf32>) -> tensor<1x?x1xf32>
  %me = llm.add %ms, %eps : (tensor<1x?x1xf32>, tensor<f32>) -> tensor<1x?x1xf32>
  %sqrt = llm.sqrt %me : tensor<1x?x1xf32>
  %r = llm.reciprocal %sqrt : tensor<1x?x1xf32>
  %n = llm.mul %x, %r : (tensor<1x?x32xf32>, tensor<1x?x1xf32>) -> tensor<1x?x32xf32>
  %w = llm.weight @norm f32 : tensor<32xf32>
  %y = llm.mul %w, %n : (tensor<32xf32>, tensor<1x?x32xf32>) -> tensor<1x?x32xf32>
  func.return %y : tensor<1x?x32xf32>
}

// A mean of squares without the weight's product is not a norm the pass knows.
// CHECK-LABEL: func.func @no_weight
// CHECK-NOT:   llm.rms_norm
func.func @no_weight(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %x: tensor<1x?x32xf32>) -> tensor<1x?x32xf32> {
  %two = llm.constant dense<2.000000e+00> : tensor<f32>
  %sq = llm.pow %x, %two : (tensor<1x?x32xf32>, tensor<f32>) -> tensor<1x?x32xf32>
  %ms = llm.reduce_mean %sq axes [2] keepdims : (tensor<1x?x32xf32>) -> tensor<1x?x1xf32>
  %r = llm.rsqrt %ms : tensor<1x?x1xf32>
  %n = llm.mul %x, %r : (tensor<1x?x32xf32>, tensor<1x?x1xf32>) -> tensor<1x?x32xf32>
  func.return %n : tensor<1x?x32xf32>
}
