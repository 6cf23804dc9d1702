// verify: an op whose types disagree is refused in one line that names the op and the dimensions
// (`llmc opt` verifies what it reads; the pass checks again between other passes).
// RUN: not llmc-opt %s -p verify 2>&1 | filecheck %s

// CHECK: llmc: error: IR does not verify: llm.matmul: reduction dimension (input vs weight) mismatch: 32 vs 16
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %x: tensor<?x32xf32>) -> tensor<?x48xf32> {
  %w = llm.weight @w f32 : tensor<48x16xf32>
  %y = llm.matmul %x, %w : (tensor<?x32xf32>, tensor<48x16xf32>) -> tensor<?x48xf32>
  func.return %y : tensor<?x48xf32>
}
