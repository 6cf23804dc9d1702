// refine-shapes: a dimension an exported graph leaves open (`?`) that is the same number for every
// token count becomes that number; one that follows the token count stays `?`. Here the shape
// [T, 4, 8] of a reshape is computed from shape_of, so its type says only tensor<?x?x?xf32>.
// RUN: llmc-opt %s -p refine-shapes | filecheck %s

// CHECK-LABEL: func.func @forward
// CHECK:       llm.reshape %x to %s : tensor<?x32xf32> to tensor<3xi64> -> tensor<?x4x8xf32>
// CHECK:       func.return {{%.*}} : tensor<?x4x8xf32>
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>) -> tensor<?x?x?xf32> {
  %t = llm.cast %tokens : (tensor<?xi32>) -> tensor<?xf32>
  %column = llm.reshape %t : tensor<?xf32> -> tensor<?x1xf32>
  %ones = llm.constant dense<1.000000e+00> : tensor<32xf32>
  %x = llm.mul %column, %ones : (tensor<?x1xf32>, tensor<32xf32>) -> tensor<?x32xf32>
  %n = llm.shape_of %tokens : (tensor<?xi32>) -> tensor<1xi64>
  %heads = llm.constant dense<[4, 8]> : tensor<2xi64>
  %s = llm.concat %n, %heads axis 0 : (tensor<1xi64>, tensor<2xi64>) -> tensor<3xi64>
  %y = llm.reshape %x to %s : tensor<?x32xf32> to tensor<3xi64> -> tensor<?x?x?xf32>
  func.return %y : tensor<?x?x?xf32>
}
