// canonicalize: a reshape of a reshape is one reshape, one back to its input's type is the input,
// and a transpose of a transpose that cancels is gone (dce erases what they leave unused).
// RUN: llmc-opt %s -p canonicalize,dce | filecheck %s

// CHECK-LABEL: func.func @reshapes
// CHECK-NEXT:  [[R:%.*]] = llm.reshape %x : tensor<?x32xf32> -> tensor<?x4x8xf32>
// CHECK-NEXT:  func.return [[R]]
func.func @reshapes(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %x: tensor<?x32xf32>) -> tensor<?x4x8xf32> {
  %a = llm.reshape %x : tensor<?x32xf32> -> tensor<1x?x32xf32>
  %b = llm.reshape %a : tensor<1x?x32xf32> -> tensor<?x4x8xf32>
  func.return %b : tensor<?x4x8xf32>
}

// CHECK-LABEL: func.func @round_trip
// CHECK-NEXT:  func.return %x
func.func @round_trip(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %x: tensor<?x32xf32>) -> tensor<?x32xf32> {
  %a = llm.reshape %x : tensor<?x32xf32> -> tensor<?x4x8xf32>
  %b = llm.reshape %a : tensor<?x4x8xf32> -> tensor<?x32xf32>
  %t = llm.transpose %b axes [1, 0] : (tensor<?x32xf32>) -> tensor<32x?xf32>
  %u = llm.transpose %t axes [1, 0] : (tensor<32x?xf32>) -> tensor<?x32xf32>
  func.return %u : tensor<?x32xf32>
}

// Elementwise ops of small constants are the constants they compute.
// CHECK-LABEL: func.func @fold
// CHECK-NEXT:  [[C:%.*]] = llm.constant dense<3.000000e+00> : tensor<2xf32>
// CHECK-NEXT:  func.return [[C]]
func.func @fold(%tokens: tensor<?xi32>, %pos: tensor<?xi32>) -> tensor<2xf32> {
  %a = llm.constant dense<1.000000e+00> : tensor<2xf32>
  %b = llm.constant dense<2.000000e+00> : tensor<2xf32>
  %c = llm.add %a, %b : tensor<2xf32>
  func.return %c : tensor<2xf32>
}
