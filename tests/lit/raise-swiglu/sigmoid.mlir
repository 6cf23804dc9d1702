// raise-swiglu: x * sigmoid(x) becomes the gate activation op (`group` later fuses it with the
// gate and up projections into one SwiGLU kernel).
// RUN: llmc-opt %s -p raise-swiglu,dce | filecheck %s

// CHECK-LABEL: func.func @forward
// CHECK-NOT:   llm.sigmoid
// CHECK:       [[A:%.*]] = llm.{{[a-z_]+}} %g : tensor<?x48xf32>
// CHECK-NEXT:  func.return [[A]]
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %g: tensor<?x48xf32>) -> tensor<?x48xf32> {
  %s = llm.sigmoid %g : tensor<?x48xf32>
  %a = llm.mul %g, %s : tensor<?x48xf32>
  func.return %a : tensor<?x48xf32>
}

// y * sigmoid(x) with y other than x is not an activation.
// CHECK-LABEL: func.func @gated
// CHECK:       llm.sigmoid
// CHECK-NEXT:  llm.mul
func.func @gated(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %g: tensor<?x48xf32>, %u: tensor<?x48xf32>) -> tensor<?x48xf32> {
  %s = llm.sigmoid %g : tensor<?x48xf32>
  %a = llm.mul %u, %s : tensor<?x48xf32>
  func.return %a : tensor<?x48xf32>
}
