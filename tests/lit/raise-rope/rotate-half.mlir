// raise-rope: rotate-half RoPE written out, q * cos + rotate_half(q) * sin with cos and sin computed
// from the positions, becomes llm.rope at the entry point's %pos; the fitted frequencies are base
// 10000 (the inverse frequencies 10000^(-2i/8) are constants here: a graph's weight needs its data).
// RUN: llmc-opt %s -p raise-rope,canonicalize,dce | filecheck %s

// CHECK-LABEL: func.func @forward
// CHECK-NOT:   llm.cos
// CHECK:       [[T:%.*]] = llm.transpose %q axes [0, 2, 1, 3] : (tensor<1x4x?x8xf32>) -> tensor<1x?x4x8xf32>
// CHECK-NEXT:  [[R:%.*]] = llm.reshape [[T]] : tensor<1x?x4x8xf32> -> tensor<?x4x8xf32>
// CHECK-NEXT:  [[ROPE:%.*]] = llm.rope [[R]], %pos <theta 10000.0> : tensor<?x4x8xf32>, tensor<?xi32>
// CHECK-NEXT:  [[BACK:%.*]] = llm.reshape [[ROPE]] : tensor<?x4x8xf32> -> tensor<1x?x4x8xf32>
// CHECK-NEXT:  [[Y:%.*]] = llm.transpose [[BACK]] axes [0, 2, 1, 3] : (tensor<1x?x4x8xf32>) -> tensor<1x4x?x8xf32>
// CHECK-NEXT:  func.return [[Y]]
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %q: tensor<1x4x?x8xf32>) -> tensor<1x4x?x8xf32> {
  %p = llm.cast %pos : (tensor<?xi32>) -> tensor<?xf32>
  %p3 = llm.reshape %p : tensor<?xf32> -> tensor<1x?x1xf32>
  %inv_freq = llm.constant dense<[1.000000e+00, 1.000000e-01, 1.000000e-02, 1.000000e-03]> : tensor<4xf32>
  %f = llm.mul %p3, %inv_freq : (tensor<1x?x1xf32>, tensor<4xf32>) -> tensor<1x?x4xf32>
  %ff = llm.concat %f, %f axis 2 : (tensor<1x?x4xf32>, tensor<1x?x4xf32>) -> tensor<1x?x8xf32>
  %cos3 = llm.cos %ff : tensor<1x?x8xf32>
  %sin3 = llm.sin %ff : tensor<1x?x8xf32>
  %cos = llm.reshape %cos3 : tensor<1x?x8xf32> -> tensor<1x1x?x8xf32>
  %sin = llm.reshape %sin3 : tensor<1x?x8xf32> -> tensor<1x1x?x8xf32>
  %a = llm.mul %q, %cos : (tensor<1x4x?x8xf32>, tensor<1x1x?x8xf32>) -> tensor<1x4x?x8xf32>
  %zero = llm.constant dense<0> : tensor<1xi64>
  %half = llm.constant dense<4> : tensor<1xi64>
  %end = llm.constant dense<9223372036854775807> : tensor<1xi64>
  %axis = llm.constant dense<3> : tensor<1xi64>
  %step = llm.constant dense<1> : tensor<1xi64>
  %lo = llm.slice %q, %zero, %half, %axis, %step : (tensor<1x4x?x8xf32>, tensor<1xi64>, tensor<1xi64>, tensor<1xi64>, tensor<1xi64>) -> tensor<1x4x?x4xf32>
  %hi = llm.slice %q, %half, %end, %axis, %step : (tensor<1x4x?x8xf32>, tensor<1xi64>, tensor<1xi64>, tensor<1xi64>, tensor<1xi64>) -> tensor<1x4x?x4xf32>
  %n = llm.neg %hi : tensor<1x4x?x4xf32>
  %rot = llm.concat %n, %lo axis 3 : (tensor<1x4x?x4xf32>, tensor<1x4x?x4xf32>) -> tensor<1x4x?x8xf32>
  %b = llm.mul %rot, %sin : (tensor<1x4x?x8xf32>, tensor<1x1x?x8xf32>) -> tensor<1x4x?x8xf32>
  %y = llm.add %a, %b : tensor<1x4x?x8xf32>
  func.return %y : tensor<1x4x?x8xf32>
}
