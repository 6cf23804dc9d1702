// raise-attention: causal scaled-dot-product attention written out (scores scaled by 1/sqrt(8), a
// mask from the positions, softmax, times v) becomes llm.attention, which reads and writes the KV
// cache: the entry point gains the cache argument %kv.
// RUN: llmc-opt %s -p raise-attention,canonicalize,dce | filecheck %s

// CHECK-LABEL: func.func @forward
// CHECK-SAME:  %kv: !llm.kv_cache<1x4x4096x8xf32>
// CHECK-NOT:   llm.softmax
// CHECK:       [[Q:%.*]] = llm.reshape {{%.*}} : tensor<1x?x4x8xf32> -> tensor<?x4x8xf32>
// CHECK:       [[K:%.*]] = llm.reshape {{%.*}} : tensor<1x?x4x8xf32> -> tensor<?x4x8xf32>
// CHECK:       [[V:%.*]] = llm.reshape {{%.*}} : tensor<1x?x4x8xf32> -> tensor<?x4x8xf32>
// CHECK-NEXT:  [[A:%.*]] = llm.attention [[Q]], [[K]], [[V]], %pos, %kv layer 0 : {{.*}} -> tensor<?x4x8xf32>
// CHECK-NEXT:  llm.reshape [[A]] : tensor<?x4x8xf32> -> tensor<1x?x4x8xf32>
// CHECK-NOT:   llm.softmax
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %q: tensor<1x4x?x8xf32>, %k: tensor<1x4x?x8xf32>, %v: tensor<1x4x?x8xf32>) -> tensor<1x4x?x8xf32> {
  %kt = llm.transpose %k axes [0, 1, 3, 2] : (tensor<1x4x?x8xf32>) -> tensor<1x4x8x?xf32>
  %s = llm.batch_matmul %q, %kt : (tensor<1x4x?x8xf32>, tensor<1x4x8x?xf32>) -> tensor<1x4x?x?xf32>
  %scale = llm.constant dense<0.353553385> : tensor<f32>
  %ss = llm.mul %s, %scale : (tensor<1x4x?x?xf32>, tensor<f32>) -> tensor<1x4x?x?xf32>
  %row = llm.reshape %pos : tensor<?xi32> -> tensor<1x1x?x1xi32>
  %col = llm.reshape %pos : tensor<?xi32> -> tensor<1x1x1x?xi32>
  %seen = llm.less_equal %col, %row : (tensor<1x1x1x?xi32>, tensor<1x1x?x1xi32>) -> tensor<1x1x?x?xi1>
  %zero = llm.constant dense<0.000000e+00> : tensor<f32>
  %lowest = llm.constant dense<-3.40282347e+38> : tensor<f32>
  %mask = llm.where %seen, %zero, %lowest : (tensor<1x1x?x?xi1>, tensor<f32>, tensor<f32>) -> tensor<1x1x?x?xf32>
  %sm = llm.add %ss, %mask : (tensor<1x4x?x?xf32>, tensor<1x1x?x?xf32>) -> tensor<1x4x?x?xf32>
  %p = llm.softmax %sm axis 3 : tensor<1x4x?x?xf32>
  %o = llm.batch_matmul %p, %v : (tensor<1x4x?x?xf32>, tensor<1x4x?x8xf32>) -> tensor<1x4x?x8xf32>
  func.return %o : tensor<1x4x?x8xf32>
}
